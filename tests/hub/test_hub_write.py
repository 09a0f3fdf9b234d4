"""huggingface_hub's real client writing to the local Hub: repos, uploads (regular, LFS, multipart), PRs, cards."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData, constants, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import get_session
from safetensors.torch import save_file


def _folder(tmp_path: Path, *, big: int = 0) -> Path:
    """config.json, a model card, a safetensors file, and optionally ``big`` bytes of binary data."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1001}))
    (folder / "README.md").write_text("---\nlibrary_name: transformers\ntags:\n- reshard\n---\n\n# A model\n")
    save_file({"w": torch.arange(5000, dtype=torch.float32)}, folder / "model.safetensors")
    if big:
        (folder / "extra.bin").write_bytes(
            torch.randint(0, 256, (big,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
            .numpy()
            .tobytes()
        )
    return folder


def test_create_repo_private_exist_ok_and_namespaces(hub):
    api = HfApi()

    url = api.create_repo("acme/secret", private=True)

    assert url.repo_id == "acme/secret"
    assert api.model_info("acme/secret").private
    assert [f.rfilename for f in api.model_info("acme/secret").siblings] == [".gitattributes"]  # "initial commit"
    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=False).model_info("acme/secret")
    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=hub.other_token).model_info("acme/secret")
    with pytest.raises(HfHubHTTPError) as exists:
        api.create_repo("acme/secret")
    assert exists.value.response.status_code == 409
    assert api.create_repo("acme/secret", exist_ok=True, private=False).repo_id == "acme/secret"
    assert api.model_info("acme/secret").private  # `private` is ignored for an existing repo
    with pytest.raises(HfHubHTTPError, match="rights to create a model under the namespace") as foreign:
        api.create_repo("someone-else/model")
    assert foreign.value.response.status_code == 403
    assert api.create_repo("mine").repo_id == "tester/mine"  # a bare name goes to the token's user
    assert api.whoami()["name"] == "tester"


def test_upload_folder_sends_regular_lfs_and_multipart_files(hub, tmp_path):
    hub.multipart_threshold = hub.multipart_chunk = 1024 * 1024
    folder = _folder(tmp_path, big=2 * 1024 * 1024 + 12345)  # three parts
    api = HfApi()
    api.create_repo("acme/up")

    info = api.upload_folder(repo_id="acme/up", folder_path=folder, commit_message="Upload from reshard")

    assert api.model_info("acme/up").sha == info.oid
    got = Path(snapshot_download("acme/up", local_dir=tmp_path / "got"))
    for name in ("config.json", "README.md", "model.safetensors", "extra.bin"):
        assert (got / name).read_bytes() == (folder / name).read_bytes(), name
    assert api.verify_repo_checksums("acme/up", local_dir=got).mismatches == []  # git-sha1 and sha256 oids agree
    tree = {item.path: item for item in api.list_repo_tree("acme/up")}
    lfs = {path: item.lfs is not None for path, item in tree.items()}
    assert lfs == {
        ".gitattributes": False,
        "README.md": False,
        "config.json": False,
        "model.safetensors": True,
        "extra.bin": True,
    }

    def lfs_oid(name: str) -> str:
        return tree[name].lfs.sha256

    puts = [r for r in hub.requests if r.method == "PUT"]
    assert len(puts) == 4 and all(r.host == "localhost" and not r.auth for r in puts)  # one basic, three parts
    assert (
        sum(r.received for r in puts)
        == (folder / "model.safetensors").stat().st_size + (folder / "extra.bin").stat().st_size
    )
    posts = [r.path.split("?")[0].replace("/acme/up", "") for r in hub.requests if r.method == "POST"]
    assert posts[:5] == [
        "/api/repos/create",
        "/api/validate-yaml",  # by upload_folder, then again by create_commit
        "/api/validate-yaml",
        "/api/models/preupload/main",
        ".git/info/lfs/objects/batch",
    ]
    lfs_steps = [
        "/lfs-complete/" + lfs_oid("extra.bin"),
        ".git/info/lfs/objects/verify",
        ".git/info/lfs/objects/verify",
    ]
    assert sorted(posts[5:-1]) == sorted(lfs_steps)  # uploaded in threads
    assert posts[-1] == "/api/models/commit/main"


def test_an_interrupted_upload_resumes_without_resending_lfs_objects(hub, tmp_path):
    folder = _folder(tmp_path, big=300_000)
    api = HfApi()
    api.create_repo("acme/up")
    initial = api.model_info("acme/up").sha
    hub.fail_next("POST", "/commit/")

    with pytest.raises(HfHubHTTPError):
        api.upload_folder(repo_id="acme/up", folder_path=folder)
    assert api.model_info("acme/up").sha == initial
    start = len(hub.requests)
    info = api.upload_folder(repo_id="acme/up", folder_path=folder)
    resumed = hub.requests[start:]
    again = api.upload_folder(repo_id="acme/up", folder_path=folder)

    assert not [r for r in resumed if r.method == "PUT"]  # the LFS objects were already on the server
    assert sum(r.received for r in resumed) < 20_000
    assert again.oid == info.oid  # nothing changed: no commit at all
    assert len([r for r in hub.requests if "/commit/" in r.path]) == 2


def test_pull_requests_branches_and_permissions(hub, tmp_path):
    folder = _folder(tmp_path)
    api = HfApi()
    main = hub.publish("acme/m", {"config.json": b"{}"})

    pr = api.upload_folder(repo_id="acme/m", folder_path=folder, create_pr=True)
    api.create_branch("acme/m", branch="dev")
    api.create_branch("acme/m", branch="dev", exist_ok=True)
    dev = api.upload_file(path_or_fileobj=b"{}\n", path_in_repo="dev.json", repo_id="acme/m", revision="dev")
    stranger = HfApi(token=hub.other_token).upload_file(
        path_or_fileobj=b"[]", path_in_repo="x.json", repo_id="acme/m", create_pr=True
    )

    assert (pr.pr_revision, stranger.pr_revision) == ("refs/pr/1", "refs/pr/2")
    assert api.model_info("acme/m").sha == main  # neither the PRs nor the branch moved main
    assert "model.safetensors" in api.list_repo_files("acme/m", revision=pr.pr_revision)
    refs = api.list_repo_refs("acme/m", include_pull_requests=True)
    assert {b.name: b.target_commit for b in refs.branches} == {"main": main, "dev": dev.oid}
    assert [p.ref for p in refs.pull_requests] == ["refs/pr/1", "refs/pr/2"]
    with pytest.raises(RevisionNotFoundError):
        api.upload_file(path_or_fileobj=b"{}", path_in_repo="a.json", repo_id="acme/m", revision="no-such-branch")
    hub.publish("acme/m", {"b.json": b"{}"})  # main moves on: ``main`` is no longer its head
    with pytest.raises(HfHubHTTPError, match="A commit has happened since") as stale:
        api.upload_file(
            path_or_fileobj=b"{}",
            path_in_repo="a.json",
            repo_id="acme/m",
            parent_commit=main,
        )
    assert stale.value.response.status_code == 412
    for token in (hub.other_token, hub.read_token):
        with pytest.raises(HfHubHTTPError) as denied:
            HfApi(token=token).upload_file(path_or_fileobj=b"{}", path_in_repo="a.json", repo_id="acme/m")
        assert denied.value.response.status_code == 403
    with pytest.raises(EntryNotFoundError, match="doesn't exist"):
        api.delete_file("no-such-file.json", repo_id="acme/m")


def test_the_xet_pipeline_commits_regular_files_and_says_when_it_would_need_xet(hub, tmp_path, monkeypatch):
    """With hf_xet on, upload_folder takes the streamed pipeline; the local Hub serves it for regular files only."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    folder = tmp_path / "card"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    api = HfApi()
    api.create_repo("acme/x")

    pr = api.upload_folder(repo_id="acme/x", folder_path=folder, create_pr=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 64)

    assert pr.pr_revision == "refs/pr/1"
    assert [r.path.split("?")[0] for r in hub.requests if "discussions" in r.path][
        0
    ] == "/api/models/acme/x/discussions"
    with pytest.raises(ConnectionError, match="501 Not Implemented"):
        api.upload_folder(repo_id="acme/x", folder_path=folder)


def test_model_card_metadata_is_validated_and_read_back(hub):
    api = HfApi()
    api.create_repo("acme/card")
    data = ModelCardData(
        base_model="acme/base", base_model_relation="finetune", library_name="transformers", tags=["reshard"]
    )
    card = f"---\n{data.to_yaml()}\n---\n\n# Padded vocab\n"

    api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id="acme/card")

    info = api.model_info("acme/card")
    assert (info.card_data.base_model, info.card_data.base_model_relation) == ("acme/base", "finetune")
    assert ModelCard.load("acme/card").data.tags == ["reshard"]
    bad = card.replace("finetune", "padded")
    with pytest.raises(ValueError, match="base_model_relation"):
        api.upload_file(path_or_fileobj=bad.encode(), path_in_repo="README.md", repo_id="acme/card")
    with pytest.raises(ValueError, match="Invalid YAML"):
        api.upload_file(path_or_fileobj=b"---\ntags: [a\n---\n", path_in_repo="README.md", repo_id="acme/card")


def _commit(hub, repo_id: str, *ops: dict, content_type: str = "application/x-ndjson"):
    lines = [{"key": "header", "value": {"summary": "raw", "description": ""}}, *ops]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    headers = {"Authorization": f"Bearer {hub.token}", "Content-Type": content_type}
    return get_session().post(f"{hub.endpoint}/api/models/{repo_id}/commit/main", content=body, headers=headers)


def test_the_server_refuses_what_the_hub_refuses(hub, tmp_path):
    hub.publish("acme/s", {"model.safetensors": b"\x01\x00" * 50})
    binary = {
        "key": "file",
        "value": {"path": "w.bin", "encoding": "base64", "content": base64.b64encode(b"\0\1").decode()},
    }
    text_as_lfs = {"key": "file", "value": {"path": "a.safetensors", "encoding": "base64", "content": "e30="}}
    unknown_lfs = {"key": "lfsFile", "value": {"path": "b.safetensors", "algo": "sha256", "oid": "0" * 64, "size": 3}}

    assert _commit(hub, "acme/s", binary).status_code == 400
    assert _commit(hub, "acme/s", text_as_lfs).status_code == 400  # .gitattributes puts *.safetensors in LFS
    assert "does not exist" in _commit(hub, "acme/s", unknown_lfs).json()["error"]
    assert _commit(hub, "acme/s", content_type="application/json").status_code == 400
    head = HfApi().get_hf_file_metadata(url=f"{hub.endpoint}/acme/s/resolve/main/model.safetensors")
    token = {"Authorization": f"Bearer {hub.token}"}
    assert get_session().get(head.location, headers=token).status_code == 400  # S3 refuses a second auth method
    assert get_session().get(head.location.replace("sig=", "sig=0")).status_code == 403
    assert get_session().get(head.location).content == b"\x01\x00" * 50
