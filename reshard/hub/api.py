"""The one place reshard holds huggingface_hub's client: an ``HfApi`` built at call time, its errors turned into
one-line :class:`~reshard.errors.HubError`\\ s, its progress bars, and a count of the bytes it received.

``HfApi()`` is built per call, never at import: huggingface_hub reads ``HF_ENDPOINT`` once, at its own import,
and its module-level ``HfApi`` keeps the endpoint it saw then. The token is whatever huggingface_hub resolves
(``HF_TOKEN``, then the ``hf auth login`` file).

No request waits without end: huggingface_hub's shared ``httpx2`` client has no timeout, and its API calls
pass ``timeout=None`` (a server that accepts and never answers would hang ``reshard inspect``). Every request
the client sends gets, where it has none, huggingface_hub's own limits: ``HF_HUB_ETAG_TIMEOUT`` seconds to
connect and ``HF_HUB_DOWNLOAD_TIMEOUT`` seconds of silence while reading or writing (10 s each by default).
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
    """An ``HfApi`` for the endpoint and token huggingface_hub sees now (its requests bounded in time)."""
    from huggingface_hub import HfApi

    bounded_session()
    return HfApi()


def _bounded(request: Any) -> None:
    """A request hook: the connect and read limits a request was sent without (an explicit one is kept)."""
    from huggingface_hub import constants

    given = request.extensions.get("timeout") or {}
    wait = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    limits = {"connect": float(constants.HF_HUB_ETAG_TIMEOUT), "read": wait, "write": wait, "pool": wait}
    timeout = {key: given.get(key) if given.get(key) is not None else limit for key, limit in limits.items()}
    request.extensions = {**request.extensions, "timeout": timeout}


def bounded_session() -> None:
    """Make every request of huggingface_hub's shared client (built anew after ``close_session``) bounded in time."""
    from huggingface_hub.utils import get_session

    hooks = get_session().event_hooks["request"]
    if _bounded not in hooks:
        hooks.append(_bounded)


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

    if _is_timeout(err):  # first: huggingface_hub wraps it (a revision it could not resolve, a file not cached)
        from huggingface_hub import constants

        return HubError(
            f"{endpoint()} did not answer in time",
            path=where,
            hint=f"try again later; HF_HUB_ETAG_TIMEOUT (connect, now {constants.HF_HUB_ETAG_TIMEOUT} s) and "
            f"HF_HUB_DOWNLOAD_TIMEOUT (read, now {constants.HF_HUB_DOWNLOAD_TIMEOUT} s) set the waits",
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


def _is_timeout(err: BaseException) -> bool:
    import httpx2

    seen: BaseException | None = err
    for _ in range(8):  # huggingface_hub wraps a transport error in its own
        if seen is None:
            return False
        if isinstance(seen, httpx2.TimeoutException):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
    bounded_session()
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


__all__ = ["Transfer", "bounded_session", "counting", "describe", "hub_api", "hub_errors", "progress_bars"]
