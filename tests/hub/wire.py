"""The request/response vocabulary of the local Hub, and its route table.

A route is a function of a ``Call`` (parsed request) returning a ``Reply``; it raises ``HubError`` for an
error answer. ``file_reply`` serves a byte range the way S3, CloudFront and the Hub do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .store import HubError

if TYPE_CHECKING:
    from .server import LocalHub


@dataclass(frozen=True)
class User:
    """The owner of a token: a user name, the organisations it belongs to, and whether the token may write."""

    name: str
    orgs: tuple[str, ...] = ()
    write: bool = True

    def member(self, namespace: str) -> bool:
        return namespace == self.name or namespace in self.orgs


@dataclass(frozen=True)
class Request:
    """One logged request: ``path`` includes the query; ``sent``/``received`` count body bytes (not headers)."""

    method: str
    host: str
    path: str
    range: str | None
    status: int
    sent: int
    received: int
    auth: bool


@dataclass
class Call:
    """A parsed request as the routes see it."""

    hub: LocalHub
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Mapping[str, str]
    body: bytes
    params: dict[str, str]

    def json(self) -> dict:
        try:
            return json.loads(self.body)
        except ValueError as err:
            raise HubError(400, f"Invalid JSON body: {err}") from err

    def arg(self, name: str, default: str | None = None) -> str | None:
        return self.query.get(name, [default])[0]

    def flag(self, name: str) -> bool:
        return (self.arg(name) or "").lower() in ("1", "true")


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    file: tuple[Path, int, int] | None = None  # (path, offset, length) streamed instead of ``body``


def json_reply(obj: object, status: int = 200, headers: dict | None = None) -> Reply:
    return Reply(status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(obj).encode())


def file_reply(path: Path, size: int, range_header: str | None, headers: dict[str, str]) -> Reply:
    """The file, or the one byte range asked for (206), as S3, CloudFront and the Hub answer it."""
    headers = {"Accept-Ranges": "bytes", **headers}
    spec = (range_header or "").strip()
    if not spec.startswith("bytes=") or "," in spec:
        return Reply(200, headers, file=(path, 0, size))  # no Range, or several: the whole file
    first, _, last = spec[6:].partition("-")
    if not first.strip():
        start, end = max(size - int(last), 0), size - 1
        if not int(last):
            start = size  # "bytes=-0" cannot be satisfied
    else:
        start, end = int(first), min(int(last), size - 1) if last.strip() else size - 1
        if last.strip() and int(last) < start:
            return Reply(200, headers, file=(path, 0, size))  # invalid range: ignored
    if start >= size:
        raise HubError(416, "Requested Range Not Satisfiable", headers={"Content-Range": f"bytes */{size}"})
    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    return Reply(206, headers, file=(path, start, end - start + 1))


Handler = Callable[[Call], Reply]
_SLOTS = {"repo": "[^/]+/[^/]+?", "path": ".+"}
ROUTES: list[tuple[str, str, re.Pattern, Handler]] = []


def route(method: str, pattern: str, *, host: str = "api") -> Callable[[Handler], Handler]:
    """Register a handler for ``pattern`` (``{repo}`` is ``ns/name``, ``{path}`` any rest, ``{x}`` one segment)."""
    parts = re.split(r"\{(\w+)\}", pattern)
    regex = "".join(
        re.escape(part) if i % 2 == 0 else f"(?P<{part}>{_SLOTS.get(part, '[^/]+')})" for i, part in enumerate(parts)
    )

    def register(handler: Handler) -> Handler:
        ROUTES.append((method, host, re.compile(regex), handler))
        return handler

    return register


def match(method: str, host: str, path: str) -> tuple[Handler | None, dict[str, str]]:
    for route_method, route_host, regex, handler in ROUTES:
        found = regex.fullmatch(path)
        if found and route_method == method and route_host == host:
            return handler, found.groupdict()
    return None, {}
