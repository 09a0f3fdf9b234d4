"""The one place reshard holds huggingface_hub's client: an ``HfApi`` built at call time, its errors turned into
one-line :class:`~reshard.errors.HubError`\\ s, its progress bars, and a count of the bytes it received.

``HfApi()`` is built per call, never at import: huggingface_hub reads ``HF_ENDPOINT`` once, at its own import,
and its module-level ``HfApi`` keeps the endpoint it saw then. The token is whatever huggingface_hub resolves
(``HF_TOKEN``, then the ``hf auth login`` file).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlsplit

from reshard.errors import HubError, ReshardError

if TYPE_CHECKING:
    from huggingface_hub import HfApi


class RepoPlace(Protocol):
    """Where a Hub call happens, as its errors name it (a :class:`reshard.hub.source.HubCheckpoint`): printed
    with ``str``, with its repo's id. Typed structurally, because ``hub/source.py`` calls this module."""

    @property
    def repo_id(self) -> str: ...


def hub_api() -> HfApi:
    """An ``HfApi`` for the endpoint and token huggingface_hub sees now."""
    from huggingface_hub import HfApi

    return HfApi()


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _entry(err: Any) -> str:
    """The file a 404 ``EntryNotFound`` was about, from its URL (``.../resolve/{revision}/{path}``)."""
    try:
        path = unquote(urlsplit(str(err.response.request.url)).path)
    except AttributeError:
        return "a file"
    return path.split("/resolve/", 1)[-1].split("/", 1)[-1] if "/resolve/" in path else "a file"


def describe(err: BaseException, where: str, repo: str | None = None) -> HubError:
    """One line for a huggingface_hub failure about ``where`` (``repo@revision/path``, or a push target)."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        NotASafetensorsRepoError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
        SafetensorsParsingError,
    )

    login = "set HF_TOKEN or run `hf auth login`"
    token = get_token() is not None
    if isinstance(err, GatedRepoError):
        why = "your token has not been granted access" if token else "no token was given"
        hint = f"ask for access at {endpoint()}/{repo or where}; {login}"
        return HubError(f"a gated repo: {why}", path=where, hint=hint)
    if isinstance(err, RepositoryNotFoundError):
        who = "the token's user cannot see it" if token else "no token was given"
        return HubError(
            f"not a local path, and {endpoint()} has no such repo (or it is private and {who})",
            path=where,
            hint=f"check the name; for a private repo {login}",
        )
    if isinstance(err, RevisionNotFoundError):
        return HubError("no such revision (branch, tag or commit) in the repo", path=where)
    if isinstance(err, RemoteEntryNotFoundError):
        return HubError(f"{_entry(err)} does not exist at this revision", path=where)
    if isinstance(err, (LocalEntryNotFoundError, RevisionResolutionError, OfflineModeIsEnabled)):
        return HubError(
            f"not in the cache, and the Hub cannot be reached: {_first_line(err)}",
            path=where,
            hint="run it once online (or unset HF_HUB_OFFLINE)",
        )
    if isinstance(err, (NotASafetensorsRepoError, SafetensorsParsingError)):
        return HubError(f"unreadable safetensors header: {_first_line(err)}", path=where)
    if isinstance(err, HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        if status == 401:
            return HubError(f"{endpoint()} refused the token (401)", path=where, hint=login)
        if status == 403:
            return HubError(f"not allowed (403): {_first_line(err)}", path=where, hint="a token with write access")
        return HubError(f"the Hub answered {status}: {_first_line(err)}", path=where)
    return HubError(f"cannot reach {endpoint()}: {_first_line(err)}", path=where)


@contextlib.contextmanager
def hub_errors(where: RepoPlace | str) -> Iterator[None]:
    """Turn huggingface_hub's exceptions (and connection failures) inside the block into one-line HubErrors."""
    import httpx2
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        NotASafetensorsRepoError,
        OfflineModeIsEnabled,
        RevisionResolutionError,
        SafetensorsParsingError,
    )

    hub_failures = (
        HfHubHTTPError,
        EntryNotFoundError,
        RevisionResolutionError,
        OfflineModeIsEnabled,
        NotASafetensorsRepoError,
        SafetensorsParsingError,
        httpx2.TransportError,
    )
    try:
        yield
    except ReshardError:
        raise
    except hub_failures as err:
        raise describe(err, str(where), getattr(where, "repo_id", None)) from err


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """huggingface_hub's progress bars on stderr for the block, or none of them."""
    if enabled:
        yield
        return
    from huggingface_hub.utils import disable_progress_bars

    with disable_progress_bars():
        yield


@dataclass
class Transfer:
    """Bytes the client received (response bodies, as read from the network) in how many responses."""

    _responses: list[Any] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _add(self, response: Any) -> None:
        with self._lock:
            self._responses.append(response)

    @property
    def bytes(self) -> int:
        return sum(r.num_bytes_downloaded for r in self._responses)

    @property
    def requests(self) -> int:
        return len(self._responses)


@contextlib.contextmanager
def counting() -> Iterator[Transfer]:
    """Count what huggingface_hub's shared HTTP client receives inside the block (every thread of it)."""
    from huggingface_hub.utils import get_session

    transfer = Transfer()
    hooks = get_session().event_hooks["response"]
    hooks.append(transfer._add)
    try:
        yield transfer
    finally:
        hooks.remove(transfer._add)


__all__ = ["Transfer", "counting", "describe", "hub_api", "hub_errors", "progress_bars"]
