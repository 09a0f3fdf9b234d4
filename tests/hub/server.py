"""The local Hub: a threaded stdlib HTTP/1.1 server on 127.0.0.1 that huggingface_hub's real client talks to.

API calls go to ``endpoint`` (``http://127.0.0.1:PORT``). LFS contents are served, and LFS uploads received, at
signed URLs on ``cdn`` (``http://localhost:PORT``): another origin, as the Hub's CDN and S3 are, so the client
stops at the ``/resolve`` redirect to read ``X-Linked-*`` and must drop its token before following it. Every
request is logged (method, host, path, Range, status, body bytes sent and received) so tests can bound what a
command transferred. Xet storage is not emulated (the tests set ``HF_HUB_DISABLE_XET=1`` for uploads of LFS files).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

from . import lfs, routes, writes  # noqa: F401 - importing them registers their routes
from .store import Entry, HubError, Repo, Store, git_blob_oid, lfs_entry, lfs_patterns, needs_lfs
from .wire import Call, Reply, Request, User, json_reply, match


class LocalHub:
    """A local Hub serving the repos under ``root``; ``tokens`` maps each accepted token to its ``User``."""

    def __init__(self, root: Path, tokens: dict[str, User] | None = None):
        self.store = Store(root)
        self.tokens = tokens if tokens is not None else {}
        self.page_size = 1000  # tree entries per page (the Hub's; 50 with expand)
        self.multipart_threshold = 20 * 1024 * 1024  # LFS objects from this size are uploaded in parts...
        self.multipart_chunk = 8 * 1024 * 1024  # ...of this size
        self.url_ttl = 3600  # seconds a signed CDN / upload URL stays valid
        self.token = self.read_token = self.other_token = None  # set by the fixture: tokens of ``tokens``
        self.home: Path | None = None  # set by the fixture: the HF_HOME of the test
        self.requests: list[Request] = []
        self.errors: list[str] = []  # tracebacks of server bugs (500s not injected on purpose)
        self.unhandled: list[str] = []  # requests no route serves: the client needs something not emulated
        self._failures: list[tuple[str, str, int, int | None]] = []
        self._secret = secrets.token_bytes(16)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self  # type: ignore[attr-defined]
        port = self._httpd.server_address[1]
        self.endpoint, self.cdn = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="local-hub", daemon=True)

    def start(self) -> LocalHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers for tests -------------------------------------------------------------------------------------
    def sent(self, since: int = 0, *, where: Callable[[Request], bool] = lambda r: True) -> int:
        """Body bytes the server sent for the requests logged from index ``since`` on."""
        return sum(r.sent for r in self.requests[since:] if where(r))

    def fail_next(self, method: str, path_contains: str, status: int = 500, *, cut_after: int | None = None) -> None:
        """Answer the next matching request with ``status`` (e.g. to interrupt an upload at its commit), or with
        ``cut_after``, serve it but drop the connection after that many body bytes (a network failure)."""
        self._failures.append((method, path_contains, status, cut_after))

    def create_repo(self, repo_id: str, *, private: bool = False, gated: str | bool = False) -> Repo:
        namespace = repo_id.split("/")[0]
        return self.store.create(repo_id, private=private, gated=gated, author=namespace)

    def grant(self, repo_id: str, user: str) -> None:
        """Accept ``user``'s request to access a gated repo."""
        with self.store.lock:
            repo = self.store.repos[repo_id]
            repo.meta["granted"].append(user)
            repo.save()

    def publish(
        self,
        repo_id: str,
        source: Path | Mapping[str, bytes],
        *,
        branch: str = "main",
        message: str = "Upload folder",
        private: bool = False,
        gated: str | bool = False,
        hash_lfs: bool = True,
    ) -> str:
        """Commit a folder (or ``{path: bytes}``) to ``branch`` server-side, creating the repo; returns the sha.

        ``hash_lfs=False`` gives LFS files a placeholder oid instead of reading them whole: for sparse
        multi-GB test files of which only headers are ever read (their oid then is not their sha256).
        """
        with self.store.lock:
            repo = self.store.get(repo_id) or self.create_repo(repo_id, private=private, gated=gated)
            parent = repo.resolve(branch)
            files = repo.files(parent)
            items = _source_items(source)
            if ".gitattributes" in items:
                files[".gitattributes"] = self._store_regular(repo, items[".gitattributes"])
            patterns = lfs_patterns(repo.blob(files[".gitattributes"]).read_bytes())
            for path, data in sorted(items.items()):
                size = len(data) if isinstance(data, bytes) else data.stat().st_size
                sample = data[:512] if isinstance(data, bytes) else _head(data)
                if not needs_lfs(path, size, sample, patterns):
                    files[path] = self._store_regular(repo, data)
                    continue
                placeholder = b"unhashed|%s|%d|" % (path.encode(), size) + sample
                sha256 = _sha256(data) if hash_lfs else hashlib.sha256(placeholder).hexdigest()
                repo.add_lfs(sha256, size, data)
                files[path] = lfs_entry(sha256, size)
            sha = repo.commit(files, parent=parent, title=message, description="", author=repo_id.split("/")[0])
            repo.meta["refs"]["heads"][branch] = sha
            repo.save()
            return sha

    @staticmethod
    def _store_regular(repo: Repo, data: bytes | Path) -> Entry:
        content = data if isinstance(data, bytes) else data.read_bytes()
        entry = Entry(git_blob_oid(content), len(content))
        repo.put_blob(entry.key, content)
        return entry

    # -- signed URLs (the CDN and S3 stand-ins) --------------------------------------------------------------------
    def sign(self, path: str, **params: str | int) -> str:
        """``path`` with its ``params``, an expiry and an HMAC of them all as query arguments."""
        params["expires"] = int(time.time()) + self.url_ttl
        params["sig"] = self._mac(path, {k: str(v) for k, v in params.items()})
        return f"{path}?{urlencode(params)}"

    def check_signature(self, path: str, query: dict[str, list[str]]) -> dict[str, str]:
        """The signed params of a URL; an unsigned, tampered or expired one gets the 403 S3 gives."""
        params = {k: v[0] for k, v in query.items()}
        if not hmac.compare_digest(self._mac(path, params), params.get("sig", "")):
            raise HubError(403, "<Error><Code>SignatureDoesNotMatch</Code></Error>")
        if int(params["expires"]) < time.time():
            raise HubError(403, "<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>")
        return params

    def _mac(self, path: str, params: dict[str, str]) -> str:
        text = path + "?" + "&".join(f"{k}={params[k]}" for k in sorted(params) if k != "sig")
        return hmac.new(self._secret, text.encode(), "sha256").hexdigest()

    def user(self, headers: Mapping[str, str]) -> User | None:
        """The token's user; a token the Hub does not know is refused, as the Hub does."""
        auth = headers.get("Authorization")
        if auth is None:
            return None
        user = self.tokens.get(auth[7:]) if auth.startswith("Bearer ") else None
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return user


def _source_items(source: Path | Mapping[str, bytes]) -> dict[str, bytes | Path]:
    if isinstance(source, Mapping):
        return dict(source)
    return {
        p.relative_to(source).as_posix(): p
        for p in source.rglob("*")
        if p.is_file() and not {".git", ".cache"} & set(p.relative_to(source).parts)
    }


def _head(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(512)


def _sha256(data: bytes | Path) -> str:
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()
    digest = hashlib.sha256()
    with data.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    timeout = 60

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet: the hub keeps its own log
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def _dispatch(self) -> None:
        hub: LocalHub = self.server.hub  # type: ignore[attr-defined]
        body = self._read_body()
        url = urlsplit(self.path)
        host = (self.headers.get("Host") or "").split(":")[0]
        cut = None
        try:
            failure = next((f for f in hub._failures if f[0] == self.command and f[1] in url.path), None)
            if failure is not None:
                hub._failures.remove(failure)
                if failure[3] is None:
                    raise HubError(failure[2], "Injected failure")
                cut = failure[3]
            handler, params = match(self.command, "cdn" if host == "localhost" else "api", url.path)
            if handler is None:
                hub.unhandled.append(f"{self.command} {host} {self.path}")
                raise HubError(404, f"Not emulated by the local Hub: {self.command} {url.path}")
            query = parse_qs(url.query, keep_blank_values=True)
            params = {k: unquote(v) for k, v in params.items()}
            reply = handler(Call(hub, self.command, url.path, query, self.headers, body, params))
        except HubError as err:
            reply = json_reply(
                {"error": err.message, **err.extra}, err.status, {"X-Error-Message": err.message, **err.headers}
            )
            if err.code:
                reply.headers["X-Error-Code"] = err.code
        except Exception:  # a bug of the server: answer 500 and keep it for the fixture to report
            hub.errors.append(traceback.format_exc())
            reply = json_reply({"error": "Internal error of the local Hub"}, 500)
        # Log before answering: once the client has its answer, the test reading the log must find it there.
        length = reply.file[2] if reply.file else len(reply.body)
        sent = 0 if self.command == "HEAD" else length if cut is None else min(cut, length)
        auth = "Authorization" in self.headers
        hub.requests.append(
            Request(self.command, host, self.path, self.headers.get("Range"), reply.status, sent, len(body), auth)
        )
        self._send(reply, sent)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, reply: Reply, sent: int) -> None:
        """Headers announcing the whole body, then ``sent`` bytes of it (fewer to simulate a network failure)."""
        length = reply.file[2] if reply.file else len(reply.body)
        self.send_response(reply.status)
        for name, value in {"X-Request-Id": secrets.token_hex(8), **reply.headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.close_connection = self.close_connection or sent < length and self.command != "HEAD"
        if reply.file is None:
            self.wfile.write(reply.body[:sent])
            return
        path, offset, _ = reply.file
        with path.open("rb") as f:
            f.seek(offset)
            while sent:
                chunk = f.read(min(sent, 1 << 20))
                self.wfile.write(chunk)
                sent -= len(chunk)
