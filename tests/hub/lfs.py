"""LFS on the local Hub: the git-lfs batch API, single and multi-part uploads, verify, and the CDN downloads.

Upload URLs (PUT) and LFS downloads live on the CDN origin and are signed; like S3 they refuse a request that
also carries an ``Authorization`` header, so a client leaking its token there fails. A completed upload must
match the announced sha256 and size byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from urllib.parse import quote

from .routes import access
from .store import HubError
from .wire import Call, Reply, file_reply, json_reply, route

_LFS_JSON = "application/vnd.git-lfs+json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _no_token(call: Call) -> None:
    if "Authorization" in call.headers:
        raise HubError(
            400, "<Error><Code>InvalidArgument</Code><Message>Only one auth mechanism allowed</Message></Error>"
        )


@route("POST", "/{repo}.git/info/lfs/objects/batch")
def batch(call: Call) -> Reply:
    """Upload actions for the objects the repo lacks (none for those it has: the client then skips them)."""
    if _LFS_JSON not in call.headers.get("Accept", ""):
        raise HubError(406, f"The LFS batch API answers {_LFS_JSON} only")
    repo, _ = access(call, auth=True)  # anyone who may open a pull request may upload LFS objects
    body = call.json()
    transfers = body.get("transfers") or ["basic"]
    if body.get("operation") != "upload" or "basic" not in transfers or body.get("hash_algo", "sha256") != "sha256":
        raise HubError(422, "Only sha256 uploads with the basic transfer are served")
    hub, objects, multipart = call.hub, [], False
    for item in body.get("objects", []):
        oid, size = item.get("oid"), item.get("size")
        if not (isinstance(oid, str) and _SHA256.fullmatch(oid) and isinstance(size, int) and size >= 0):
            objects.append({"oid": str(oid), "size": -1, "error": {"code": 422, "message": "Invalid object"}})
            continue
        if repo.lfs_size(oid) == size:
            objects.append({"oid": oid, "size": size})
            continue
        target = f"/lfs-upload/{repo.id}/{oid}"
        if size >= hub.multipart_threshold and "multipart" in transfers:
            multipart, parts = True, math.ceil(size / hub.multipart_chunk)
            header = {"chunk_size": str(hub.multipart_chunk)}
            header |= {f"{n:05d}": hub.cdn + hub.sign(f"{target}/{n}", size=size) for n in range(1, parts + 1)}
            complete = hub.endpoint + hub.sign(f"/lfs-complete/{repo.id}/{oid}", size=size, parts=parts)
            upload = {"href": complete, "header": header}
        else:
            upload = {"href": hub.cdn + hub.sign(target, size=size)}
        verify = {"href": f"{hub.endpoint}/{repo.id}.git/info/lfs/objects/verify"}
        objects.append(
            {"oid": oid, "size": size, "authenticated": True, "actions": {"upload": upload, "verify": verify}}
        )
    answer = {"transfer": "multipart" if multipart else "basic", "objects": objects, "hash_algo": "sha256"}
    return Reply(200, {"Content-Type": _LFS_JSON}, json.dumps(answer).encode())


def _store(call: Call, oid: str, data: bytes, size: int) -> None:
    if len(data) != size or hashlib.sha256(data).hexdigest() != oid:
        raise HubError(
            400, "<Error><Code>BadDigest</Code><Message>The content does not match its oid</Message></Error>"
        )
    with call.hub.store.lock:  # uploads run in parallel: repo.json is rewritten by one of them at a time
        call.hub.store.get(call.params["repo"]).add_lfs(oid, size, data)


@route("PUT", "/lfs-upload/{repo}/{oid}", host="cdn")
def upload(call: Call) -> Reply:
    _no_token(call)
    params = call.hub.check_signature(call.path, call.query)
    _store(call, call.params["oid"], call.body, int(params["size"]))
    return Reply(200, {"ETag": f'"{hashlib.md5(call.body).hexdigest()}"'})


@route("PUT", "/lfs-upload/{repo}/{oid}/{part}", host="cdn")
def upload_part(call: Call) -> Reply:
    _no_token(call)
    call.hub.check_signature(call.path, call.query)
    parts = call.hub.store.get(call.params["repo"]).folder / "uploads" / call.params["oid"]
    parts.mkdir(parents=True, exist_ok=True)
    (parts / f"{int(call.params['part']):05d}").write_bytes(call.body)
    return Reply(200, {"ETag": f'"{hashlib.md5(call.body).hexdigest()}"'})


@route("POST", "/lfs-complete/{repo}/{oid}")
def complete(call: Call) -> Reply:
    """Assemble the parts in the order and with the ETags the client lists, as S3's CompleteMultipartUpload."""
    params = call.hub.check_signature(call.path, call.query)
    oid, body = call.params["oid"], call.json()
    folder = call.hub.store.get(call.params["repo"]).folder / "uploads" / oid
    listed = body.get("parts", [])
    if body.get("oid") != oid or [p.get("partNumber") for p in listed] != list(range(1, int(params["parts"]) + 1)):
        raise HubError(400, "<Error><Code>InvalidPart</Code><Message>Parts missing or out of order</Message></Error>")
    data = b""
    for part in listed:
        stored = folder / f"{part['partNumber']:05d}"
        chunk = stored.read_bytes() if stored.exists() else b""
        if not stored.exists() or part.get("etag") != f'"{hashlib.md5(chunk).hexdigest()}"':
            raise HubError(400, f"<Error><Code>InvalidPart</Code><Message>Part {part['partNumber']}</Message></Error>")
        data += chunk
    _store(call, oid, data, int(params["size"]))
    shutil.rmtree(folder)
    return json_reply({})


@route("POST", "/{repo}.git/info/lfs/objects/verify")
def verify(call: Call) -> Reply:
    repo, _ = access(call, auth=True)
    body = call.json()
    if repo.lfs_size(body.get("oid", "")) != body.get("size"):
        raise HubError(404, f"LFS object {body.get('oid')} of size {body.get('size')} not found")
    return json_reply({"success": True})


@route("HEAD", "/lfs/{repo}/{oid}", host="cdn")
@route("GET", "/lfs/{repo}/{oid}", host="cdn")
def download(call: Call) -> Reply:
    _no_token(call)
    params = call.hub.check_signature(call.path, call.query)
    repo = call.hub.store.get(call.params["repo"])
    size = repo.lfs_size(call.params["oid"]) if repo else None
    if size is None:
        raise HubError(404, "<Error><Code>NoSuchKey</Code></Error>")
    name = params.get("filename", call.params["oid"])
    headers = {
        "Content-Type": "application/octet-stream",
        "ETag": f'"{call.params["oid"]}"',
        "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\";",
    }
    return file_reply(repo.folder / "blobs" / call.params["oid"], size, call.headers.get("Range"), headers)
