"""What a CKPT argument names: a local path, or a Hugging Face Hub repo at a revision (and a folder in it).

A local path that exists wins. Otherwise ``org/name``, ``org/name@revision`` (``@refs/pr/3`` too), an
``hf://`` URI or a Hub web URL is a repo, parsed by huggingface_hub's own :func:`~huggingface_hub.parse_hf_uri`;
a folder or file inside the repo follows the revision (``org/name@main/tp2``). Anything else is a path that
does not exist. The revision is resolved once to a commit (:func:`resolve`) and every later request names that
commit, so a repo that moves during a run cannot mix two versions.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from reshard.errors import HubError, ReshardError

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_URL = ("hf://", "http://", "https://", "huggingface.co/", "hf.co/")


@dataclass(frozen=True)
class HubCheckpoint:
    """A checkpoint in a Hub model repo: ``repo_id`` at ``revision`` (None: the default branch), in ``path``.

    Attributes:
        repo_id: ``org/name``.
        revision: what the user asked for (a branch, tag, PR ref or commit); None for the default branch.
        path: a folder or file inside the repo ("" for its root).
        commit: the 40-hex commit ``revision`` resolved to (None until :func:`resolve`).
        cache_dir: the Hugging Face cache to use (None: huggingface_hub's, ``HF_HUB_CACHE``).
        typed_as_path: the argument as given when it could as well be a local path (``runs/ckpt-tp2``): if the repo
            cannot be had, the missing path is said first.
    """

    repo_id: str
    revision: str | None = None
    path: str = ""
    commit: str | None = None
    cache_dir: Path | None = None
    typed_as_path: str | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        """``org/name@commit/path`` once resolved (``@revision`` before): itself a valid CKPT argument."""
        return self.at + (f"/{self.path}" if self.path else "")

    @property
    def at(self) -> str:
        """``org/name@commit`` (``@revision`` before :func:`resolve`): the repo at the commit read."""
        at = self.commit or self.revision
        return self.repo_id + (f"@{at}" if at else "")


def checkpoint_argument(text: str) -> Path | HubCheckpoint:
    """A CKPT argument as a local path (when it exists) or a Hub checkpoint.

    Raises:
        ReshardError: neither an existing path nor a repo id.

    Example:
        >>> checkpoint_argument("acme/llama@v1.0/tp2")
        HubCheckpoint(repo_id='acme/llama', revision='v1.0', path='tp2', commit=None, cache_dir=None)
    """
    if os.path.exists(text):
        return Path(text)
    from huggingface_hub import constants, parse_hf_uri
    from huggingface_hub.errors import HfUriError

    typed_as_path = None
    if text.startswith(_URL):
        uri_text = text
    elif not text.startswith(("/", ".", "~")) and text.split("@", 1)[0].count("/") == 1:
        first = text.split("/", 1)[0]
        if os.path.isdir(first):  # ``runs/ckpt-tp2`` beside a folder ``runs``: a local path mistyped, not a repo
            raise ReshardError(
                f"no such file or folder (not read as a Hub repo: {first!r} is a local folder)",
                path=text,
                hint=f"check the path; to read the Hub repo, write hf://{text}",
            )
        uri_text, typed_as_path = "hf://" + text, text  # org/name[@revision][/path]
    else:
        raise ReshardError("no such file or folder", path=text)
    try:
        uri = parse_hf_uri(uri_text, endpoint=constants.ENDPOINT)
    except HfUriError as err:
        if uri_text is text:
            raise ReshardError(f"not a Hub repo: {str(err).splitlines()[0]}", path=text) from None
        raise ReshardError("no such file or folder, nor a Hub repo id (org/name[@revision])", path=text) from None
    if uri.type != "model":
        raise ReshardError(f"a {uri.type} repo: reshard reads checkpoints from model repos", path=text)
    return HubCheckpoint(uri.id, uri.revision, uri.path_in_repo.strip("/"), typed_as_path=typed_as_path)


# A checkpoint argument: a local path, or a Hub repo (what with_cache gives back is of the kind it was given).
Checkpoint = TypeVar("Checkpoint", Path, HubCheckpoint)


def with_cache(ckpt: Checkpoint, cache_dir: Path | None) -> Checkpoint:
    """``ckpt`` with ``cache_dir`` set when it is a Hub checkpoint (``--cache-dir``)."""
    if isinstance(ckpt, HubCheckpoint) and cache_dir is not None:
        return replace(ckpt, cache_dir=Path(cache_dir))
    return ckpt


def resolve(ckpt: HubCheckpoint) -> HubCheckpoint:
    """``ckpt`` with its revision resolved to a commit, online, or from the cache's ``refs/`` when offline.

    Raises:
        HubError: unknown repo or revision, no access, or (offline) a revision the cache does not know.
    """
    if ckpt.commit is not None:
        return ckpt
    from huggingface_hub import constants

    from reshard.hub.api import hub_api, hub_errors

    try:
        with hub_errors(ckpt):
            resolved = hub_api().resolve_revision(
                ckpt.repo_id,
                revision=ckpt.revision,
                cache_dir=ckpt.cache_dir,
                local_files_only=constants.is_offline_mode(),  # the cache's refs/, without a warning per call
            )
    except HubError as err:
        from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled, RevisionResolutionError

        unreachable = (LocalEntryNotFoundError, RevisionResolutionError, OfflineModeIsEnabled)
        if ckpt.typed_as_path is None or not isinstance(err.__cause__, unreachable) or "in time" in err.detail:
            raise  # a repo the Hub answered for (no such repo: "not a local path" already comes first), or a timeout
        raise _no_such_path(ckpt.typed_as_path, err) from err
    return replace(ckpt, commit=resolved.resolved)


def _no_such_path(text: str, err: HubError) -> ReshardError:
    """A path like ``runs/ckpt-tp2`` whose folder does not exist, offline or with the Hub out of reach: the missing
    path first, then why it is not a repo either (the Hub's hint is left out: the user most likely meant a path)."""
    why = err.detail
    first = text.split("/", 1)[0]
    return ReshardError(
        f"no such file or folder (there is no {first!r} here), and not a Hub repo either: {why}",
        path=text,
        hint=f"check the path; a Hub repo is read as hf://{text}",
    )


def hub_origin(path: Path) -> dict[str, str] | None:
    """``{"repo", "commit"[, "path_in_repo"]}`` when ``path`` lies in a Hugging Face cache snapshot, else None.

    The cache keeps ``models--{org}--{name}/snapshots/{commit}/{path in repo}`` (repo ids cannot hold ``--``),
    so a download's provenance is read from where it lies, however it got there.

    Example:
        >>> hub_origin(Path("/c/hub/models--acme--tiny/snapshots/" + "a" * 40 + "/tp2"))["repo"]
        'acme/tiny'
    """
    parts = Path(os.path.abspath(path)).parts  # not resolve(): a cached file is a symlink into blobs/
    for i in range(1, len(parts) - 1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--") and _COMMIT.match(parts[i + 1]):
            origin = {"repo": parts[i - 1][len("models--") :].replace("--", "/"), "commit": parts[i + 1]}
            inside = "/".join(parts[i + 2 :])
            return origin | ({"path_in_repo": inside} if inside else {})
    return None


def source_record(path: Path) -> dict[str, Any]:
    """The ``source`` of a manifest: the path read, plus the repo and commit when it is a Hub download."""
    return {"path": str(path), **(hub_origin(path) or {})}


def require_token(what: str) -> None:
    """Fail before any work when ``what`` needs a token and huggingface_hub finds none (``HF_TOKEN``, the login
    file)."""
    from huggingface_hub import get_token

    if get_token() is None:
        raise HubError(f"{what} needs a Hugging Face token", hint="set HF_TOKEN or run `hf auth login`")


__all__ = ["HubCheckpoint", "checkpoint_argument", "hub_origin", "resolve", "source_record", "with_cache"]
