"""Download what a command needs from a Hub repo into the Hugging Face cache, then read it as a local folder.

Two passes through :func:`huggingface_hub.snapshot_download`, both pinned to the resolved commit: the small
files planning reads (configs, indexes, ``reshard.json``, trackers), which also caches the repo's file list;
then the weight files the layout reads (:func:`reshard.hub.select.weight_files`) and the files copied beside
the output. With ``HF_HUB_OFFLINE=1`` both passes are served by the cache, and huggingface_hub raises when its
cached file list shows a requested file missing; where it has no such list, reshard checks what it chose.
"""

from __future__ import annotations

import logging
import os
import posixpath
from pathlib import Path

from reshard.errors import HubError
from reshard.formats.tokenizer import TOKENIZER_FILES
from reshard.hub.api import hub_errors, progress_bars
from reshard.hub.select import literal, plan_patterns, side_patterns, weight_files
from reshard.hub.source import HubCheckpoint, resolve

logger = logging.getLogger(__name__)


def snapshot(ckpt: HubCheckpoint, patterns: list[str]) -> tuple[Path, list[str]]:
    """Fetch the files of ``ckpt``'s commit matching ``patterns``: the snapshot folder and every file of the repo.

    Call inside :func:`reshard.hub.api.hub_errors` with a resolved ``ckpt``.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError

    offline = constants.is_offline_mode()
    try:
        folder = snapshot_download(
            ckpt.repo_id,
            revision=ckpt.commit,
            cache_dir=ckpt.cache_dir,
            allow_patterns=patterns,
            local_files_only=offline,  # the cache only, checked against its listing when it has one
        )
    except IncompleteSnapshotError as err:
        missing = [f for f in _listed(ckpt, patterns) or [] if not (Path(err.snapshot_path) / f).is_file()]
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise HubError(
            f"not in the cache: {', '.join(missing[:3])}{more}",
            path=str(ckpt),
            hint="HF_HUB_OFFLINE=1 reads the cache only: run it once online",
        ) from None
    files = _listed(ckpt, None)
    if files is None:  # offline, from files cached without a listing: what is on disk
        files = [Path(top, n).relative_to(folder).as_posix() for top, _, names in os.walk(folder) for n in names]
    return Path(folder), files


def _listed(ckpt: HubCheckpoint, patterns: list[str] | None) -> list[str] | None:
    """The repo's files at the commit (those matching ``patterns``), from the listing the cache keeps; None
    when it keeps none."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    from huggingface_hub.utils import filter_repo_objects

    try:
        tree = get_cached_repo_tree(ckpt.repo_id, revision=ckpt.commit, cache_dir=ckpt.cache_dir)
    except CachedRepoTreeNotFoundError:
        return None
    return list(filter_repo_objects([f.path for f in tree], allow_patterns=patterns))


def download_checkpoint(ckpt: HubCheckpoint, *, progress: bool = True) -> Path:
    """The local folder (or file) of ``ckpt`` in the cache, downloading only what reading it takes.

    Args:
        ckpt: the repo, revision and folder (its ``cache_dir``, else ``HF_HUB_CACHE``).
        progress: huggingface_hub's progress bars on stderr.

    Returns:
        ``.../models--{org}--{name}/snapshots/{commit}/{path}``: a folder reshard reads like any other.

    Raises:
        HubError: unknown repo or revision, no access, a file missing at that revision, or (offline) a file
            the cache does not hold, named.

    Example:
        >>> download_checkpoint(HubCheckpoint("acme/tiny-tp2"))  # doctest: +SKIP
        PosixPath('/home/me/.cache/huggingface/hub/models--acme--tiny-tp2/snapshots/0a1b.../')
    """
    ckpt = resolve(ckpt)
    planning = plan_patterns(ckpt.path)
    with hub_errors(ckpt):
        with progress_bars(False):
            folder, files = snapshot(ckpt, planning)
        weights = weight_files(files, ckpt.path, lambda path: (folder / path).read_text(), where=ckpt.at)
        wanted = [*planning, *side_patterns(ckpt.path, files), *map(literal, weights)]
        logger.info("%s: downloading %d weight file(s) and what goes with them", ckpt, len(weights))
        with progress_bars(progress):
            folder, _ = snapshot(ckpt, wanted)
    missing = [w for w in weights if not (folder / w).is_file()]
    if missing:
        raise HubError(
            f"{missing[0]} is not in the cache" + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""),
            path=str(ckpt),
            hint="run it once online (or unset HF_HUB_OFFLINE)",
        )
    return folder / ckpt.path if ckpt.path else folder


def download_tokenizer(ckpt: HubCheckpoint) -> Path:
    """The local folder of the tokenizer files (:data:`reshard.formats.tokenizer.TOKENIZER_FILES`, nothing else) of
    ``ckpt``'s folder, in the cache (``--tokenizer REPO``).

    Raises:
        HubError: unknown repo or revision, no access, or (offline) files the cache does not hold.
    """
    ckpt = resolve(ckpt)
    patterns = [literal(posixpath.join(ckpt.path, name)) for name in TOKENIZER_FILES]
    with hub_errors(ckpt), progress_bars(False):
        folder, _ = snapshot(ckpt, patterns)
    return folder / ckpt.path if ckpt.path else folder


__all__ = ["download_checkpoint", "download_tokenizer", "snapshot"]
