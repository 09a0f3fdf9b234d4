"""Write endpoints of the local Hub: create repo, preupload, commit, branches, tags, pull requests.

Strict where the Hub is: a commit must be NDJSON with a summary; a file the Hub wants in LFS (.gitattributes,
size, binary) cannot be committed as a regular file; an ``lfsFile`` must point at an uploaded object of that
size; ``parentCommit`` must be the head; deleting a missing file is an ``EntryNotFound``; only branches and
``refs/pr/N`` take commits. Anyone who can read a repo may open a pull request on it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time

from .routes import access
from .store import COMMIT_SHA, Entry, HubError, Repo, check_path, git_blob_oid, lfs_entry, lfs_patterns, needs_lfs
from .wire import Call, Reply, json_reply, route

_NAME = re.compile(r"(?![.-])[A-Za-z0-9._-]{1,96}")
_BRANCH = re.compile(r"[A-Za-z0-9._/-]+")


@route("POST", "/api/repos/create")
def create_repo(call: Call) -> Reply:
    user = call.hub.user(call.headers)
    if user is None:
        raise HubError(401, "You must be authenticated to create a repo")
    body = call.json()
    if (body.get("type") or "model") != "model":
        raise HubError(400, "Only model repos are emulated by the local Hub")
    name, namespace = body.get("name") or "", body.get("organization") or user.name
    if not _NAME.fullmatch(name) or "--" in name or ".." in name or name.endswith((".", "-", ".git")):
        raise HubError(400, f"Invalid repo name: {name!r}")
    if not (user.member(namespace) and user.write):
        raise HubError(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
    private = body.get("visibility") == "private" or body.get("private") is True
    url = f"{call.hub.endpoint}/{namespace}/{name}"
    try:
        repo = call.hub.store.create(f"{namespace}/{name}", private=private, gated=False, author=user.name)
    except HubError as err:
        err.extra["url"] = url  # huggingface_hub reads it from the 409 under exist_ok=True
        raise
    return json_reply({"url": url, "name": repo.id, "id": repo.resolve("main")[:24]})


def _patterns(repo: Repo, files: dict[str, Entry]) -> list[str]:
    return lfs_patterns(repo.blob(files[".gitattributes"]).read_bytes()) if ".gitattributes" in files else []


@route("POST", "/api/models/{repo}/preupload/{rev}")
def preupload(call: Call) -> Reply:
    """Which files must go through LFS, and the oid each path has now (so unchanged files are skipped)."""
    repo, _ = access(call, write=not call.flag("create_pr"), auth=True)
    sha = repo.resolve(call.params["rev"])
    files = repo.files(sha)
    patterns = _patterns(repo, files)
    answers = []
    for item in call.json()["files"]:
        path, sample = check_path(item["path"]), base64.b64decode(item["sample"])
        mode = "lfs" if needs_lfs(path, item["size"], sample, patterns) else "regular"
        current = files.get(path)
        oid = None if current is None else current.lfs or current.oid
        answers.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
    return json_reply({"files": answers, "commitOid": sha})


def _target(repo: Repo, rev: str, user_name: str, may_write: bool) -> tuple[str, str]:
    """(kind, name) of the ref a commit moves: a branch or an open pull request, never a tag or a sha."""
    heads, prs = repo.meta["refs"]["heads"], repo.meta["refs"]["pr"]
    branch = rev.removeprefix("refs/heads/")
    if branch in heads:
        return "heads", branch
    if rev.startswith("refs/pr/") and rev[8:] in prs:
        pr = repo.meta["discussions"][rev[8:]]
        if pr["status"] not in ("draft", "open"):
            raise HubError(403, f"Pull request {rev} is {pr['status']}")
        if not (may_write or pr["author"] == user_name):
            raise HubError(403, f"Only the author of {rev} and the repo's writers may push to it")
        return "pr", rev[8:]
    repo.resolve(rev)  # 404 RevisionNotFound if it does not exist at all
    raise HubError(400, f"Invalid rev id: {rev}: commits go to a branch or a pull request")


def _apply(repo: Repo, files: dict[str, Entry], op: dict) -> None:
    key, value = op.get("key"), op.get("value") or {}
    path = check_path(str(value.get("path", "")).rstrip("/") if key == "deletedFolder" else value.get("path", ""))
    if key == "file":
        if value.get("encoding") != "base64":
            raise HubError(400, f"{path}: file content must be base64-encoded")
        try:
            content = base64.b64decode(value["content"], validate=True)
        except (KeyError, binascii.Error) as err:
            raise HubError(400, f"{path}: invalid base64 content") from err
        if needs_lfs(path, len(content), content[:512], _patterns(repo, files)):
            raise HubError(400, f"Your push was rejected because {path} must be stored with LFS (binary or large)")
        files[path] = Entry(git_blob_oid(content), len(content))
        repo.put_blob(files[path].key, content)
    elif key == "lfsFile":
        oid, size = value.get("oid", ""), value.get("size")
        stored = repo.lfs_size(oid)
        if value.get("algo") != "sha256" or stored is None or (size is not None and size != stored):
            raise HubError(
                400, f"Your push was rejected because an LFS pointer pointed to a file that does not exist: {path}"
            )
        files[path] = lfs_entry(oid, stored)
    elif key == "deletedFile":
        if files.pop(path, None) is None:
            raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
    elif key == "deletedFolder":
        inside = [p for p in files if p.startswith(path + "/")]
        if not inside:
            raise HubError(404, f"A folder with this name doesn't exist: {path}", code="EntryNotFound")
        for p in inside:
            del files[p]
    else:
        raise HubError(400, f"Unknown commit operation: {key!r}")


@route("POST", "/api/models/{repo}/commit/{rev}")
def commit(call: Call) -> Reply:
    if not call.headers.get("Content-Type", "").startswith("application/x-ndjson"):
        raise HubError(400, "A commit is sent as application/x-ndjson")
    rev, create_pr = call.params["rev"], call.flag("create_pr")
    repo, user = access(call, write=not (create_pr or rev.startswith("refs/pr/")), auth=True)
    try:
        lines = [json.loads(line) for line in call.body.splitlines() if line.strip()]
    except ValueError as err:
        raise HubError(400, f"Invalid NDJSON: {err}") from err
    header = lines[0].get("value", {}) if lines and lines[0].get("key") == "header" else None
    if not header or not isinstance(header.get("summary"), str) or not header["summary"].strip():
        raise HubError(400, "The first line must be the header, with a non-empty summary")
    may_write = user.member(repo.id.split("/")[0]) and user.write
    with call.hub.store.lock:
        kind, name = _target(repo, rev, user.name, may_write)
        if create_pr and kind != "heads":
            raise HubError(400, "A pull request is opened against a branch")
        parent = repo.meta["refs"][kind][name]
        if header.get("parentCommit") not in (None, parent):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = repo.files(parent)
        for op in lines[1:]:
            _apply(repo, files, op)
        sha = repo.commit(
            files, parent=parent, title=header["summary"], description=header.get("description", ""), author=user.name
        )
        pr_url = None
        if create_pr:
            number = _discussion(repo, header["summary"], user.name, pull_request=True, status="open")
            repo.meta["refs"]["pr"][number] = sha
            pr_url = f"{call.hub.endpoint}/{repo.id}/discussions/{number}"
        else:
            repo.meta["refs"][kind][name] = sha
            if kind == "pr":
                repo.meta["discussions"][name]["status"] = "open"
        repo.save()
    url = f"{call.hub.endpoint}/{repo.id}/commit/{sha}"
    return json_reply({"success": True, "commitOid": sha, "commitUrl": url, "pullRequestUrl": pr_url})


def _discussion(repo: Repo, title: str, author: str, *, pull_request: bool, status: str) -> str:
    number = str(len(repo.meta["discussions"]) + 1)
    created = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
    repo.meta["discussions"][number] = {
        "title": title,
        "author": author,
        "status": status,
        "isPullRequest": pull_request,
        "createdAt": created,
    }
    return number


@route("POST", "/api/models/{repo}/discussions")
def create_discussion(call: Call) -> Reply:
    """A discussion, or a draft pull request whose ``refs/pr/N`` starts at the head of main."""
    repo, user = access(call, auth=True)
    body = call.json()
    if not str(body.get("title", "")).strip():
        raise HubError(400, "A discussion needs a title")
    with call.hub.store.lock:
        pull_request = bool(body.get("pullRequest"))
        number = _discussion(
            repo, body["title"], user.name, pull_request=pull_request, status="draft" if pull_request else "open"
        )
        if pull_request:
            repo.meta["refs"]["pr"][number] = repo.resolve("main")
        repo.save()
    return json_reply({"num": int(number), "url": f"{call.hub.endpoint}/{repo.id}/discussions/{number}"})


@route("GET", "/api/models/{repo}/discussions/{num}")
def discussion(call: Call) -> Reply:
    repo, _ = access(call)
    item = repo.meta["discussions"].get(call.params["num"])
    if item is None:
        raise HubError(404, f"Discussion {call.params['num']} not found")
    details = {
        "num": int(call.params["num"]),
        "title": item["title"],
        "author": {"name": item["author"]},
        "createdAt": item["createdAt"],
        "status": item["status"],
        "repo": {"name": repo.id, "type": "model"},
        "isPullRequest": item["isPullRequest"],
        "events": [],
        "changes": {"base": "refs/heads/main"},
        "filesWithConflicts": [],
        "diff": "",
    }
    return json_reply(details)


@route("POST", "/api/models/{repo}/branch/{branch}")
def create_branch(call: Call) -> Reply:
    repo, _ = access(call, write=True)
    branch = call.params["branch"]
    if not _BRANCH.fullmatch(branch) or branch.startswith("refs/") or ".." in branch or COMMIT_SHA.fullmatch(branch):
        raise HubError(400, f"Invalid branch name: {branch!r}")
    start = (call.json() if call.body else {}).get("startingPoint") or "main"
    with call.hub.store.lock:
        if branch in repo.meta["refs"]["heads"]:
            raise HubError(409, f"Reference already exists: refs/heads/{branch}")
        repo.meta["refs"]["heads"][branch] = repo.resolve(start)
        repo.save()
    return json_reply({})


@route("POST", "/api/models/{repo}/tag/{rev}")
def create_tag(call: Call) -> Reply:
    repo, _ = access(call, write=True)
    tag = call.json().get("tag", "")
    if not _BRANCH.fullmatch(tag) or tag.startswith("refs/"):
        raise HubError(400, f"Invalid tag name: {tag!r}")
    with call.hub.store.lock:
        if tag in repo.meta["refs"]["tags"]:
            raise HubError(409, f"Reference already exists: refs/tags/{tag}")
        repo.meta["refs"]["tags"][tag] = repo.resolve(call.params["rev"])
        repo.save()
    return json_reply({})


@route("GET", "/api/models/{repo}/xet-read-token/{rev}")
@route("GET", "/api/models/{repo}/xet-write-token/{rev}")
def xet_token(call: Call) -> Reply:
    raise HubError(501, "Xet storage is not emulated by the local Hub: set HF_HUB_DISABLE_XET=1")
