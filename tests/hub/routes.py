"""Read endpoints of the local Hub: repo info, tree, paths-info, resolve, refs, whoami, validate-yaml.

Access follows the Hub: a private repo is "not found" to non-members (401 without a token, 404 with one, both
``X-Error-Code: RepoNotFound``); a gated repo shows its info and tree to anyone but its files only to members
and granted users (``GatedRepo``: 401 without a token, 403 with one); an unknown token is refused outright.
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import parse_qs, quote, urlencode

import yaml

from .store import Entry, HubError, Repo
from .wire import Call, Reply, User, file_reply, json_reply, route

# huggingface_hub's own pattern for the YAML block of a card (repocard.py)
_YAML_BLOCK = re.compile(r"^(\s*---[\r\n]+)([\S\s]*?)([\r\n]+---(\r\n|\n|$))")
_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_RELATIONS = ("adapter", "merge", "quantized", "finetune")


def access(call: Call, *, files: bool = False, write: bool = False, auth: bool = False) -> tuple[Repo, User | None]:
    """The repo of the URL if this caller may read it (its files, with ``files``) or write to it."""
    hub = call.hub
    user = hub.user(call.headers)
    repo = hub.store.get(call.params["repo"])
    member = user is not None and user.member(call.params["repo"].split("/")[0])
    if repo is None or (repo.private and not member):
        raise HubError(401 if user is None else 404, "Repository not found", code="RepoNotFound")
    if (write or auth) and user is None:
        raise HubError(401, "You must be authenticated to do this")
    if write and not (member and user.write):
        raise HubError(403, f"You don't have the rights to write to {repo.id}")
    if files and repo.gated and not member and (user is None or user.name not in repo.meta["granted"]):
        if user is None:
            message = "You must have access to it and be authenticated to access it. Please log in."
            raise HubError(401, f"Access to model {repo.id} is restricted. {message}", code="GatedRepo")
        message = f"you are not in the authorized list. Visit {hub.endpoint}/{repo.id} to ask for access."
        raise HubError(403, f"Access to model {repo.id} is restricted and {message}", code="GatedRepo")
    return repo, user


def card_problems(content: str) -> tuple[dict | None, list[str], list[str]]:
    """The card's metadata, its errors and its warnings, checked like the Hub checks the keys reshard writes."""
    block = _YAML_BLOCK.match(content)
    if block is None:
        return None, [], ["Empty or missing yaml metadata in repo card"]
    try:
        data = yaml.safe_load(block.group(2))
    except yaml.YAMLError as err:
        return None, [f"Invalid YAML in the metadata: {err}"], []
    if data is None:
        return None, [], ["Empty or missing yaml metadata in repo card"]
    if not isinstance(data, dict):
        return None, ["The metadata must be a YAML mapping"], []
    errors = []
    for key in ("tags", "base_model"):
        values = [data[key]] if isinstance(data.get(key), str) else data.get(key, [])
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            errors.append(f'"{key}" must be a string or a list of strings')
        elif key == "base_model" and not all(_REPO_ID.fullmatch(v) for v in values):
            errors.append(f'"base_model" must be Hub repo ids, got {values}')
    if "base_model_relation" in data and data["base_model_relation"] not in _RELATIONS:
        errors.append(f'"base_model_relation" must be one of {", ".join(_RELATIONS)}')
    errors += [f'"{k}" must be a string' for k in ("library_name", "license") if not isinstance(data.get(k, ""), str)]
    return data, errors, []


@route("POST", "/api/validate-yaml")
def validate_yaml(call: Call) -> Reply:
    _, errors, warnings = card_problems(call.json().get("content", ""))
    messages = {"errors": [{"message": e} for e in errors], "warnings": [{"message": w} for w in warnings]}
    return json_reply(messages, 400 if errors else 200)


@route("GET", "/api/whoami-v2")
def whoami(call: Call) -> Reply:
    user = call.hub.user(call.headers)
    if user is None:
        raise HubError(401, "Invalid credentials in Authorization header")
    role = "write" if user.write else "read"
    orgs = [{"type": "org", "name": org, "fullname": org, "roleInOrg": role} for org in user.orgs]
    token = {"displayName": "local-hub", "role": role}
    return json_reply(
        {
            "type": "user",
            "name": user.name,
            "fullname": user.name,
            "orgs": orgs,
            "auth": {"type": "access_token", "accessToken": token},
        }
    )


@route("GET", "/api/agent-harnesses")
def agent_harnesses(call: Call) -> Reply:
    return json_reply({"standardEnvVars": [], "harnesses": {}})


@route("GET", "/api/models/{repo}")
@route("GET", "/api/models/{repo}/revision/{rev}")
def repo_info(call: Call) -> Reply:
    repo, _ = access(call)
    sha = repo.resolve(call.params.get("rev", "main"))
    files = repo.files(sha)
    card = None
    if "README.md" in files:
        card, _, _ = card_problems(repo.blob(files["README.md"]).read_text(errors="replace"))
    siblings = [{"rfilename": path, **(_blob_info(e) if call.flag("blobs") else {})} for path, e in files.items()]
    info = {
        "_id": sha[:24],
        "id": repo.id,
        "author": repo.id.split("/")[0],
        "sha": sha,
        "lastModified": repo.commit_info(sha)["date"],
        "createdAt": repo.meta["created"],
        "private": repo.private,
        "gated": repo.gated,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "library_name": (card or {}).get("library_name"),
        "tags": list((card or {}).get("tags") or []),
        "cardData": card,
        "siblings": siblings,
        "usedStorage": sum(e.size for e in files.values()),
    }
    if expand := call.query.get("expand"):
        info = {k: v for k, v in info.items() if k in {"_id", "id", *expand}}
    return json_reply(info)


def _blob_info(entry: Entry) -> dict:
    lfs = {"lfs": {"sha256": entry.lfs, "size": entry.size, "pointerSize": entry.pointer_size}} if entry.lfs else {}
    return {"size": entry.size, "blobId": entry.oid, **lfs}


def _file_entry(repo: Repo, sha: str, path: str, entry: Entry, expand: bool) -> dict:
    item = {"type": "file", "oid": entry.oid, "size": entry.size, "path": path}
    if entry.lfs:
        item["lfs"] = {"oid": entry.lfs, "size": entry.size, "pointerSize": entry.pointer_size}
    if expand:
        item["lastCommit"] = repo.last_commit(sha, path)
        item["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False}, "pickleImportScan": None}
    return item


def _folder_entry(repo: Repo, sha: str, path: str, files: dict[str, Entry], expand: bool) -> dict:
    under = sorted(f"{p} {e.oid}" for p, e in files.items() if p.startswith(path + "/"))
    item = {"type": "directory", "oid": hashlib.sha1("\n".join(under).encode()).hexdigest(), "size": 0, "path": path}
    if expand:
        item["lastCommit"] = repo.last_commit(sha, path)
    return item


def _listing(repo: Repo, sha: str, prefix: str, *, recursive: bool, expand: bool) -> list[dict]:
    files = repo.files(sha)
    under = [p for p in files if not prefix or p.startswith(prefix + "/")]
    if prefix and not under:
        raise HubError(404, f"Entry not found: {prefix} is not a folder of {sha}", code="EntryNotFound")
    folders, items = set(), []
    for path in under:
        parts = path[len(prefix) + 1 if prefix else 0 :].split("/")
        for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
            folders.add("/".join([prefix, *parts[:depth]] if prefix else parts[:depth]))
        if recursive or len(parts) == 1:
            items.append(_file_entry(repo, sha, path, files[path], expand))
    items += [_folder_entry(repo, sha, folder, files, expand) for folder in folders]
    return sorted(items, key=lambda item: item["path"])


@route("GET", "/api/models/{repo}/tree/{rev}")
@route("GET", "/api/models/{repo}/tree/{rev}/{path}")
def tree(call: Call) -> Reply:
    """A tree listing, paginated like the Hub (``Link: <...>; rel="next"``, 50 entries a page with expand)."""
    repo, _ = access(call)
    sha = repo.resolve(call.params["rev"])
    expand, recursive = call.flag("expand"), call.flag("recursive")
    items = _listing(repo, sha, call.params.get("path", "").strip("/"), recursive=recursive, expand=expand)
    size = min(call.hub.page_size, 50) if expand else call.hub.page_size
    start = int(call.arg("cursor") or 0)
    headers = {}
    if start + size < len(items):
        query = urlencode({"recursive": recursive, "expand": expand, "cursor": start + size})
        headers["Link"] = f'<{call.hub.endpoint}{call.path}?{query}>; rel="next"'
    return json_reply(items[start : start + size], headers=headers)


@route("POST", "/api/models/{repo}/paths-info/{rev}")
def paths_info(call: Call) -> Reply:
    """The entries of the paths that exist (missing ones are left out, as the Hub does)."""
    repo, _ = access(call)
    sha = repo.resolve(call.params["rev"])
    form = parse_qs(call.body.decode())
    expand = form.get("expand", ["false"])[0].lower() == "true"
    files = repo.files(sha)
    items = []
    for path in form.get("paths", []):
        path = path.strip("/")
        if path in files:
            items.append(_file_entry(repo, sha, path, files[path], expand))
        elif any(p.startswith(path + "/") for p in files):
            items.append(_folder_entry(repo, sha, path, files, expand))
    return json_reply(items)


@route("GET", "/api/models/{repo}/refs")
def refs(call: Call) -> Reply:
    repo, _ = access(call)
    heads, tags, prs = (repo.meta["refs"][kind] for kind in ("heads", "tags", "pr"))
    info = {
        "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": sha} for n, sha in heads.items()],
        "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": sha} for n, sha in tags.items()],
        "converts": [],
    }
    if call.flag("include_prs"):
        info["pullRequests"] = [{"name": n, "ref": f"refs/pr/{n}", "targetCommit": sha} for n, sha in prs.items()]
    return json_reply(info)


@route("HEAD", "/{repo}/resolve/{rev}/{path}")
@route("GET", "/{repo}/resolve/{rev}/{path}")
def resolve(call: Call) -> Reply:
    """A regular file is served here; an LFS file is a 302 to a signed CDN URL carrying ``X-Linked-*``."""
    repo, _ = access(call, files=True)
    sha = repo.resolve(call.params["rev"])
    path = call.params["path"]
    entry = repo.files(sha).get(path)
    if entry is None:
        raise HubError(404, "Entry not found", code="EntryNotFound", headers={"X-Repo-Commit": sha})
    name = path.rsplit("/", 1)[-1]
    headers = {"X-Repo-Commit": sha, "ETag": f'"{entry.oid}"'}
    if entry.lfs:
        location = call.hub.cdn + call.hub.sign(f"/lfs/{repo.id}/{entry.lfs}", filename=name)
        linked = {"X-Linked-Etag": f'"{entry.lfs}"', "X-Linked-Size": str(entry.size)}
        return Reply(302, {**headers, **linked, "Location": location})
    kind = "application/json" if name.endswith(".json") else "text/plain; charset=utf-8"
    disposition = f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\";"
    headers |= {"Content-Type": kind, "Content-Disposition": disposition}
    return file_reply(repo.blob(entry), entry.size, call.headers.get("Range"), headers)
