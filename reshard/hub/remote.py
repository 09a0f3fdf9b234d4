"""Open a Hub checkpoint from its safetensors headers alone (``inspect`` and ``check`` on a repo id).

Only small files (configs, indexes, ``reshard.json``) are downloaded, into the cache; the headers come by
range requests through huggingface_hub: :meth:`~huggingface_hub.HfApi.get_safetensors_metadata` for the HF
layout at the repo's root, :meth:`~huggingface_hub.HfApi.parse_safetensors_file_metadata` for the files it does
not find (rank folders, rank-named files, a sub-folder). They are laid out in a temporary header-only mirror
(each file its header and a hole the size of its data), which the layouts' own ``discover`` reads as they read
any folder, so a repo is recognised, checked and reported exactly as the same files on disk would be. The
:class:`~reshard.layouts.SourceCheckpoint` handed back names the repo's files and cannot read tensor bytes.
"""

from __future__ import annotations

import json
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from reshard.config import ModelConfig
from reshard.errors import CorruptFileError, HubError, ReshardError
from reshard.formats.readers import FileReader, TensorHeader
from reshard.hub.api import counting, hub_api, hub_errors, progress_bars
from reshard.hub.download import download_checkpoint, snapshot
from reshard.hub.select import plan_patterns, weight_files
from reshard.hub.source import HubCheckpoint, resolve
from reshard.io.staging import temporary_folder
from reshard.layouts import SourceCheckpoint, discover
from reshard.manifest import Manifest, find_manifest
from reshard.options import ReadOptions

if TYPE_CHECKING:
    import torch
    from huggingface_hub import SafetensorsFileMetadata

# The mirror sits this deep in its temporary folder, so that looking for config.json above the checkpoint
# (config.find_config: up to 3 levels) never leaves it.
_DEPTH = ("a", "b", "c", "repo")


@dataclass
class HeaderOnlyReader(FileReader):
    """A tensor file of a Hub repo known by its header: every attempt to read its bytes is an error."""

    path: Path
    headers: dict[str, TensorHeader]
    extras: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def _refuse(self, key: str) -> NoReturn:
        raise HubError(
            "tensor bytes cannot be read: the checkpoint was opened from the Hub for its headers only",
            path=self.path,
            tensor=key,
            hint="convert, fix and verify download the weights they need",
        )

    def get(self, key: str) -> torch.Tensor:
        self._refuse(key)

    def read_into(self, key: str, out: torch.Tensor, *, start: int = 0) -> None:
        self._refuse(key)

    def prefetch(self, key: str) -> None:
        self._refuse(key)

    def evict(self, key: str) -> None:
        self._refuse(key)


def open_headers(ckpt: HubCheckpoint, options: ReadOptions) -> tuple[SourceCheckpoint, Manifest | None]:
    """``ckpt`` as a source whose tensors are known from headers only, and the ``reshard.json`` beside it.

    Offline (``HF_HUB_OFFLINE=1``) the checkpoint is read from the cache instead, as downloaded before.
    ``source.hub`` records the repo, revision, commit and what the client received.

    Raises:
        HubError: unknown repo or revision, no access, a file missing at that revision, torch weight files
            (whose tensors cannot be listed without downloading them whole).
        ReshardError: what the layout finds wrong with the files, naming them by their repo paths.
    """
    from huggingface_hub import constants

    if constants.is_offline_mode():
        folder = download_checkpoint(ckpt, progress=False)
        source = discover(folder, options)
        source.hub = _record(resolve(ckpt), None)
        return source, find_manifest(folder)
    with counting() as transfer, progress_bars(False):
        ckpt = resolve(ckpt)
        with hub_errors(ckpt):
            snapshot_folder, files = snapshot(ckpt, plan_patterns(ckpt.path))
            where = ckpt.at
            weights = weight_files(files, ckpt.path, lambda p: (snapshot_folder / p).read_text(), where=where)
            torch_files = [w for w in weights if not w.endswith(".safetensors")]
            if torch_files:
                raise HubError(
                    f"{torch_files[0]} is a torch file: its tensors cannot be listed without downloading it whole",
                    path=where,
                    hint="inspect and check read safetensors headers over HTTP; `hf download` it to inspect it",
                )
            headers = _read_headers(ckpt, weights, files)
    sizes = _sizes(ckpt, weights)
    with temporary_folder(prefix="reshard-headers-") as tmp:
        mirror = tmp.joinpath(*_DEPTH)
        mirror.mkdir(parents=True)
        for name in _present(snapshot_folder, files, plan_patterns(ckpt.path)):
            (mirror / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(snapshot_folder / name, mirror / name)
        for name in weights:
            (mirror / name).parent.mkdir(parents=True, exist_ok=True)
            _write_header_only(mirror / name, headers[name], sizes.get(name), where=f"{where}/{name}")
        local = mirror / ckpt.path if ckpt.path else mirror
        try:
            source, manifest = discover(local, options), find_manifest(local)
        except ReshardError as err:
            raise _renamed(err, str(mirror), where) from None
        source = _header_only(source, mirror, where, ckpt)
    source.hub = _record(ckpt, transfer)
    return source, manifest


def _read_headers(ckpt: HubCheckpoint, weights: list[str], files: list[str]) -> dict[str, SafetensorsFileMetadata]:
    """Each weight file's parsed header, by range requests (several files at once, as huggingface_hub does)."""
    api, found = hub_api(), {}
    at_root = not ckpt.path and all("/" not in w for w in weights)
    if at_root and (SAFETENSORS_SINGLE_FILE in files or SAFETENSORS_INDEX_FILE in files):
        found.update(api.get_safetensors_metadata(ckpt.repo_id, revision=ckpt.commit).files_metadata)
    rest = [w for w in weights if w not in found]

    def parse(name: str) -> SafetensorsFileMetadata:
        return api.parse_safetensors_file_metadata(ckpt.repo_id, name, revision=ckpt.commit)

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rest)))) as pool:
        found.update(zip(rest, pool.map(parse, rest), strict=True))
    return found


def _sizes(ckpt: HubCheckpoint, weights: list[str]) -> dict[str, int]:
    """File sizes from the cached repo listing (for the truncated-file check)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        tree = get_cached_repo_tree(ckpt.repo_id, revision=ckpt.commit, cache_dir=ckpt.cache_dir)
    except CachedRepoTreeNotFoundError:  # a cache that could not keep it: no size check
        return {}
    wanted = set(weights)
    return {f.path: f.size for f in tree if f.path in wanted and f.size is not None}


def _present(folder: Path, files: list[str], patterns: list[str]) -> list[str]:
    from huggingface_hub.utils import filter_repo_objects

    return [f for f in filter_repo_objects(files, allow_patterns=patterns) if (folder / f).is_file()]


def _write_header_only(path: Path, meta: SafetensorsFileMetadata, size: int | None, *, where: str) -> None:
    """A valid safetensors file holding ``meta``'s header and a hole as long as its data (a sparse file)."""
    header: dict[str, Any] = {"__metadata__": meta.metadata} if meta.metadata else {}
    for name, info in meta.tensors.items():
        header[name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
    end = max((info.data_offsets[1] for info in meta.tensors.values()), default=0)
    if size is not None and 8 + end > size:
        raise CorruptFileError(f"truncated: {size} bytes, its header places tensor bytes up to {8 + end}", path=where)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + end)


def _renamed(err: ReshardError, mirror: str, where: str) -> ReshardError:
    """``err`` naming the repo's files (``org/name@commit/file``) instead of the mirror's."""
    if err.path and err.path.startswith(mirror):
        err.path = where + err.path[len(mirror) :]
    err.args = (err.one_line(),)
    return err


def _header_only(source: SourceCheckpoint, mirror: Path, where: str, ckpt: HubCheckpoint) -> SourceCheckpoint:
    """``source`` read from the mirror, renamed to the repo's paths, its readers unable to read bytes."""

    def named(path: Path) -> Path:
        return Path(where) / path.relative_to(mirror) if path != mirror else Path(where)

    readers: dict[Path, HeaderOnlyReader] = {}
    ranks = []
    for rank in source.ranks:
        refs = {}
        for name, ref in rank.items():
            reader = readers.get(ref.file)
            if reader is None:
                reader = readers[ref.file] = HeaderOnlyReader(named(ref.file), dict(ref.reader.headers))
            refs[name] = replace(ref, reader=reader)
        ranks.append(refs)
    config = source.config
    if config is not None and config.path is not None and config.path.is_relative_to(mirror):
        config = ModelConfig(config.raw, named(config.path))
    header_only = HubError(
        "opened from the Hub for its headers only", path=str(ckpt), hint="convert and fix download the weights"
    )
    return replace(
        source,
        path=named(source.path),
        ranks=ranks,
        config=config,
        notes=[n.replace(str(mirror), where) for n in source.notes],
        side_files=[],
        refusal=header_only,
    )


def _record(ckpt: HubCheckpoint, transfer: Any) -> dict[str, Any]:
    record = {"repo": ckpt.repo_id, "revision": ckpt.revision, "commit": ckpt.commit, "path_in_repo": ckpt.path}
    if transfer is not None:
        record |= {"bytes_transferred": transfer.bytes, "requests": transfer.requests}
    return record


__all__ = ["HeaderOnlyReader", "open_headers"]
