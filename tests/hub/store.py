"""Git-less model repos on disk: each commit an immutable snapshot, refs in one small JSON per repo.

``<root>/<ns>/<name>/repo.json`` holds the refs (branches, tags, ``refs/pr/N``), the discussions and every commit
as a full ``path -> (oid, size, lfs sha256)`` table; ``blobs/`` holds the contents, keyed by git blob oid for
regular files and by sha256 for LFS files (uploaded LFS objects land there before any commit refers to them).
The oids are the ones the real Hub reports, so ``verify_repo_checksums`` agrees with them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# The .gitattributes the Hub writes in the "initial commit" of every new model repo.
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z *.arrow *.bin *.bz2 *.ckpt *.ftz *.gz *.h5 *.joblib *.lfs.* *.lz4 *.mlmodel *.model *.msgpack *.npy"
        " *.npz *.onnx *.ot *.parquet *.pb *.pickle *.pkl *.pt *.pth *.rar *.safetensors saved_model/**/* *.tar.*"
        " *.tar *.tflite *.tgz *.wasm *.xz *.zip *.zst *tfevents*"
    ).split()
)
# Above this size a file must go through LFS (huggingface_hub assumes regular files are at most 5 MB).
REGULAR_MAX_SIZE = 5 * 1024 * 1024
COMMIT_SHA = re.compile(r"[0-9a-f]{40}")


class HubError(Exception):
    """An HTTP error answer: status, message, and the ``X-Error-Code`` huggingface_hub maps to a typed error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        headers: dict | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.headers, self.extra = (
            status,
            message,
            code,
            headers or {},
            extra or {},
        )


@dataclass(frozen=True)
class Entry:
    """One file of a snapshot. ``oid`` is the git blob oid (of the LFS pointer for LFS files)."""

    oid: str
    size: int
    lfs: str | None = None

    @property
    def key(self) -> str:
        """Name of the blob holding the content."""
        return self.lfs or self.oid

    @property
    def pointer_size(self) -> int:
        return len(lfs_pointer(self.lfs, self.size)) if self.lfs else 0


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def lfs_entry(sha256: str, size: int) -> Entry:
    return Entry(git_blob_oid(lfs_pointer(sha256, size)), size, sha256)


def lfs_patterns(gitattributes: bytes) -> list[str]:
    lines = (line.split() for line in gitattributes.decode(errors="replace").splitlines())
    return [words[0] for words in lines if len(words) > 1 and not words[0].startswith("#") and "filter=lfs" in words]


def needs_lfs(path: str, size: int, sample: bytes, patterns: list[str]) -> bool:
    """The Hub's rule: LFS-tracked by .gitattributes, larger than a regular file may be, or binary."""
    name = path.rsplit("/", 1)[-1]
    if any(fnmatch.fnmatchcase(path if "/" in p else name, p) for p in patterns) or size > REGULAR_MAX_SIZE:
        return True
    if b"\0" in sample:
        return True
    try:
        sample.decode()
    except UnicodeDecodeError as err:  # a multi-byte character cut by the 512-byte sample is still text
        return err.reason != "unexpected end of data"
    return False


def check_path(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..", ".git") for p in parts):
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


class Repo:
    """One repo: ``meta`` mirrors repo.json; every change goes through ``save``."""

    def __init__(self, folder: Path, repo_id: str, meta: dict):
        self.folder, self.id, self.meta = folder, repo_id, meta
        (folder / "blobs").mkdir(parents=True, exist_ok=True)

    @property
    def private(self) -> bool:
        return self.meta["private"]

    @property
    def gated(self) -> str | bool:
        return self.meta["gated"]

    def save(self) -> None:
        tmp = self.folder / "repo.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1))
        os.replace(tmp, self.folder / "repo.json")

    def resolve(self, rev: str) -> str:
        """A branch, tag, ``refs/heads|tags/X``, ``refs/pr/N`` or full commit sha -> the commit sha."""
        refs = self.meta["refs"]
        for kind, prefix in (("heads", ""), ("tags", ""), ("heads", "refs/heads/"), ("tags", "refs/tags/")):
            if rev.startswith(prefix) and rev[len(prefix) :] in refs[kind]:
                return refs[kind][rev[len(prefix) :]]
        if rev.startswith("refs/pr/") and rev[8:] in refs["pr"]:
            return refs["pr"][rev[8:]]
        if COMMIT_SHA.fullmatch(rev) and rev in self.meta["commits"]:
            return rev
        raise HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")

    def files(self, sha: str) -> dict[str, Entry]:
        return {path: Entry(*value) for path, value in self.meta["commits"][sha]["files"].items()}

    def commit_info(self, sha: str) -> dict:
        return self.meta["commits"][sha]

    def blob(self, entry: Entry) -> Path:
        return self.folder / "blobs" / entry.key

    def lfs_size(self, sha256: str) -> int | None:
        return self.meta["lfs"].get(sha256)

    def put_blob(self, key: str, source: bytes | Path) -> None:
        """Store content under ``key``; a file is hard-linked when it can be (sparse test files stay sparse)."""
        target = self.folder / "blobs" / key
        if target.exists():
            return
        tmp = target.with_name(f"{key}.{threading.get_ident()}.tmp")
        if isinstance(source, bytes):
            tmp.write_bytes(source)
        else:
            try:
                os.link(source, tmp)
            except OSError:
                shutil.copyfile(source, tmp)
        os.replace(tmp, target)

    def add_lfs(self, sha256: str, size: int, source: bytes | Path) -> None:
        self.put_blob(sha256, source)
        self.meta["lfs"][sha256] = size
        self.save()

    def commit(self, files: dict[str, Entry], *, parent: str | None, title: str, description: str, author: str) -> str:
        """Record a snapshot (refs are moved by the caller) and return its sha."""
        record = {
            "parents": [parent] if parent else [],
            "title": title,
            "description": description,
            "author": author,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
            "files": {path: [e.oid, e.size, e.lfs] for path, e in sorted(files.items())},
        }
        salt = f"{len(self.meta['commits'])}:{time.time_ns()}"
        sha = hashlib.sha1((json.dumps(record, sort_keys=True) + salt).encode()).hexdigest()
        self.meta["commits"][sha] = record
        return sha

    def last_commit(self, sha: str, path: str) -> dict:
        """The newest commit (first-parent history) that changed ``path`` (a file, or anything under a folder)."""

        def view(commit_sha: str | None) -> dict:
            if commit_sha is None:
                return {}
            files = self.meta["commits"][commit_sha]["files"]
            return {p: v for p, v in files.items() if p == path or p.startswith(path + "/")}

        while True:
            info = self.meta["commits"][sha]
            parent = info["parents"][0] if info["parents"] else None
            if parent is None or view(sha) != view(parent):
                return {"id": sha, "title": info["title"], "date": info["date"]}
            sha = parent


class Store:
    """All repos under ``root``, loaded from disk at start; one lock serialises every change."""

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.RLock()
        self.repos: dict[str, Repo] = {}
        for meta_file in sorted(root.glob("*/*/repo.json")):
            repo_id = f"{meta_file.parent.parent.name}/{meta_file.parent.name}"
            self.repos[repo_id] = Repo(meta_file.parent, repo_id, json.loads(meta_file.read_text()))

    def get(self, repo_id: str) -> Repo | None:
        return self.repos.get(repo_id)

    def create(self, repo_id: str, *, private: bool, gated: str | bool, author: str) -> Repo:
        """A new repo whose ``main`` holds the Hub's "initial commit" (a default .gitattributes)."""
        with self.lock:
            if repo_id in self.repos:
                raise HubError(409, "You already created this model repo")
            meta = {
                "private": private,
                "gated": gated,
                "granted": [],
                "created": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
                "refs": {"heads": {}, "tags": {}, "pr": {}},
                "discussions": {},
                "commits": {},
                "lfs": {},
            }
            repo = Repo(self.root / repo_id, repo_id, meta)
            attributes = DEFAULT_GITATTRIBUTES.encode()
            entry = Entry(git_blob_oid(attributes), len(attributes))
            repo.put_blob(entry.key, attributes)
            sha = repo.commit(
                {".gitattributes": entry}, parent=None, title="initial commit", description="", author=author
            )
            meta["refs"]["heads"]["main"] = sha
            repo.save()
            self.repos[repo_id] = repo
            return repo
