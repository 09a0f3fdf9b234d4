"""huggingface_hub's real client reading from the local Hub: downloads, listings, revisions, headers, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import (
    HfApi,
    get_local_safetensors_metadata,
    get_safetensors_metadata,
    hf_hub_download,
    list_repo_files,
    parse_local_safetensors_file_metadata,
    parse_safetensors_file_metadata,
    snapshot_download,
)
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.torch import save_file

from .builders import llama_9b


def _files(tmp_path: Path) -> Path:
    """A small folder: a config, a safetensors file (LFS by .gitattributes) and a nested text file."""
    folder = tmp_path / "src"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1001}))
    save_file({"w": torch.arange(6000, dtype=torch.float32).reshape(60, 100)}, folder / "model.safetensors")
    (folder / "sub" / "notes.txt").write_text("tensor-parallel shards\n")
    return folder


def test_hf_hub_download_serves_regular_files_directly_and_lfs_files_from_the_cdn(hub, tmp_path):
    folder = _files(tmp_path)
    sha = hub.publish("acme/tiny", folder)

    config = hf_hub_download("acme/tiny", "config.json")
    weights = hf_hub_download("acme/tiny", "model.safetensors")

    assert Path(config).read_bytes() == (folder / "config.json").read_bytes()
    assert Path(weights).read_bytes() == (folder / "model.safetensors").read_bytes()
    assert Path(weights).parent.name == sha  # cached under the commit the server reported
    lfs = HfApi().get_paths_info("acme/tiny", ["model.safetensors"])[0].lfs
    assert Path(weights).resolve().name == lfs.sha256  # LFS blobs are named by their sha256 (X-Linked-Etag)
    head, cdn = [r for r in hub.requests if "model.safetensors" in r.path or "/lfs/" in r.path][:2]
    assert (head.method, head.status, cdn.host, cdn.auth) == ("HEAD", 302, "localhost", False)
    assert cdn.sent == (folder / "model.safetensors").stat().st_size


def test_a_download_cut_by_the_network_resumes_with_a_range_request(hub, tmp_path):
    chunk = 10 * 1024 * 1024  # the client writes (and so resumes from) whole 10 MiB chunks
    save_file({"w": torch.arange(3 * 1024 * 1024, dtype=torch.int32)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    hub.publish("acme/big", {"model.safetensors": data})
    hub.fail_next("GET", "/lfs/", cut_after=chunk + 5000)

    path = hf_hub_download("acme/big", "model.safetensors")

    assert Path(path).read_bytes() == data
    first, second = [r for r in hub.requests if r.host == "localhost"]
    assert (first.sent, second.range, second.status, second.sent) == (
        chunk + 5000,
        f"bytes={chunk}-",
        206,
        len(data) - chunk,
    )


def test_snapshot_download_fetches_only_the_allowed_patterns(hub, tmp_path):
    hub.publish("acme/tiny", _files(tmp_path))

    snapshot = Path(snapshot_download("acme/tiny", allow_patterns=["*.json", "sub/*"]))

    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()) == [
        "config.json",
        "sub/notes.txt",
    ]
    assert not [r for r in hub.requests if "safetensors" in r.path or r.host == "localhost"]


def test_model_info_and_listings_describe_the_commit(hub, tmp_path):
    folder = _files(tmp_path)
    sha = hub.publish("acme/tiny", folder)
    hub.page_size = 2  # the client must follow the Link pages
    api = HfApi()

    info = api.model_info("acme/tiny", files_metadata=True)
    tree = list(api.list_repo_tree("acme/tiny", recursive=True))
    top = {item.path for item in api.list_repo_tree("acme/tiny")}
    expanded = list(api.list_repo_tree("acme/tiny", "sub", expand=True))

    assert (info.id, info.sha, info.private) == ("acme/tiny", sha, False)
    sizes = {s.rfilename: (s.size, s.lfs.size if s.lfs else None) for s in info.siblings}
    weights_size = (folder / "model.safetensors").stat().st_size
    assert sizes["model.safetensors"] == (weights_size, weights_size)
    assert sizes["config.json"] == ((folder / "config.json").stat().st_size, None)
    assert sorted(list_repo_files("acme/tiny")) == [
        ".gitattributes",
        "config.json",
        "model.safetensors",
        "sub/notes.txt",
    ]
    assert {item.path for item in tree} == {
        ".gitattributes",
        "config.json",
        "model.safetensors",
        "sub",
        "sub/notes.txt",
    }
    assert top == {".gitattributes", "config.json", "model.safetensors", "sub"}
    assert expanded[0].path == "sub/notes.txt" and expanded[0].last_commit.oid == sha
    assert len([r for r in hub.requests if "/tree/" in r.path]) > 3  # pages of 2 entries


def test_revisions_branches_tags_commit_shas_and_pull_requests(hub, tmp_path):
    first = hub.publish("acme/tiny", {"config.json": b'{"v": 1}'})
    second = hub.publish("acme/tiny", {"config.json": b'{"v": 2}'})
    hub.store.get("acme/tiny").meta["refs"]["heads"]["dev"] = first
    api = HfApi()
    pr = api.upload_file(path_or_fileobj=b'{"v": 3}', path_in_repo="config.json", repo_id="acme/tiny", create_pr=True)
    api.create_tag("acme/tiny", tag="v1.0", revision=first)

    def read(revision: str | None) -> bytes:
        return Path(hf_hub_download("acme/tiny", "config.json", revision=revision)).read_bytes()

    assert [read(None), read("dev"), read(first), read("v1.0"), read(pr.pr_revision)] == [
        b'{"v": 2}',
        b'{"v": 1}',
        b'{"v": 1}',
        b'{"v": 1}',
        b'{"v": 3}',
    ]
    assert api.model_info("acme/tiny", revision="dev").sha == first
    assert api.model_info("acme/tiny").sha == second  # the pull request did not touch main
    assert api.resolve_revision("acme/tiny", revision=pr.pr_revision).resolved == pr.oid


def test_get_safetensors_metadata_of_a_9b_checkpoint_reads_only_headers(hub, tmp_path):
    """Issue 15's target: inspecting a 9B checkpoint over HTTP transfers under 2 MB."""
    header_lengths = llama_9b(tmp_path / "9b")
    hub.publish("acme/llama-9b", tmp_path / "9b", hash_lfs=False)
    index_size = (tmp_path / "9b" / "model.safetensors.index.json").stat().st_size
    start = len(hub.requests)

    meta = get_safetensors_metadata("acme/llama-9b")

    assert meta.sharded and len(meta.files_metadata) == 4 and len(meta.weight_map) == 363
    assert meta.files_metadata["model-00001-of-00004.safetensors"].tensors["model.embed_tokens.weight"].shape == [
        151936,
        4096,
    ]
    assert meta == get_local_safetensors_metadata(tmp_path / "9b")
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 12288 + 2 * 4096
    assert meta.parameter_count == {"BF16": 2 * 151936 * 4096 + 40 * layer + 4096}
    ranges = [r.range for r in hub.requests[start:] if r.host == "localhost"]
    assert ranges == ["bytes=0-100000"] * 4  # every header fits in the first 100 kB
    assert max(header_lengths.values()) < 100_000 - 8
    total = hub.sent(start)
    assert total == index_size + 4 * 100_001
    assert total < 2_000_000
    print(f"get_safetensors_metadata on a 9B 4-shard repo: {total} bytes in {len(hub.requests) - start} requests")


def test_a_header_over_100kb_takes_a_second_range_request(hub, tmp_path):
    tensors = {f"layers.{i}.weight": torch.arange(2, dtype=torch.float32) + i for i in range(3000)}
    save_file(tensors, tmp_path / "model.safetensors")
    header = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    hub.publish("acme/many", {"model.safetensors": (tmp_path / "model.safetensors").read_bytes()})
    start = len(hub.requests)

    meta = parse_safetensors_file_metadata("acme/many", "model.safetensors")

    assert len(meta.tensors) == 3000
    assert meta == parse_local_safetensors_file_metadata(tmp_path / "model.safetensors")
    assert [r.range for r in hub.requests[start:] if r.host == "localhost"] == [
        "bytes=0-100000",
        f"bytes=8-{header + 7}",
    ]
    assert hub.sent(start) == 100_001 + header


def test_errors_are_the_typed_ones(hub, tmp_path):
    hub.publish("acme/private", {"config.json": b"{}"}, private=True)
    hub.publish("acme/gated", {"config.json": b"{}"}, gated="manual")
    hub.publish("acme/tiny", {"config.json": b"{}"})
    api = HfApi()

    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/missing", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/missing")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("acme/tiny", "config.json", revision="no-such-branch")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("acme/tiny", "model.safetensors")
    assert not api.file_exists("acme/tiny", "model.safetensors")
    assert api.model_info("acme/private").private  # the token's user is a member of acme
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/private", "config.json", token=False)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/private", "config.json", token=hub.other_token)
    assert HfApi(token=False).model_info("acme/gated").gated == "manual"  # the card of a gated repo is public
    with pytest.raises(GatedRepoError, match="Please log in"):
        hf_hub_download("acme/gated", "config.json", token=False)
    with pytest.raises(GatedRepoError, match="not in the authorized list"):
        hf_hub_download("acme/gated", "config.json", token=hub.other_token)
    hub.grant("acme/gated", "stranger")
    assert Path(hf_hub_download("acme/gated", "config.json", token=hub.other_token)).read_bytes() == b"{}"
    with pytest.raises(HfHubHTTPError, match="Invalid credentials") as bad:
        api.model_info("acme/tiny", token="hf_not_a_token")
    assert bad.value.response.status_code == 401


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_offline_mode_serves_from_the_cache_in_a_subprocess(hub, tmp_path):
    hub.publish("acme/tiny", _files(tmp_path))
    snapshot_download("acme/tiny", allow_patterns=["*.json"])
    before = len(hub.requests)
    script = """
import json, sys
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError
out = {"config": open(hf_hub_download("acme/tiny", "config.json")).read()}
out["snapshot"] = snapshot_download("acme/tiny", allow_patterns=["*.json"])
try:
    snapshot_download("acme/tiny", allow_patterns=["*.safetensors"])
except IncompleteSnapshotError as err:
    out["missing"] = type(err).__name__
try:
    hf_hub_download("acme/tiny", "model.safetensors")
except LocalEntryNotFoundError as err:
    out["file"] = type(err).__name__
print(json.dumps(out))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["config"] == (tmp_path / "src" / "config.json").read_text()
    assert Path(out["snapshot"]).parent.parent.name == "models--acme--tiny"
    assert (out["missing"], out["file"]) == ("IncompleteSnapshotError", "LocalEntryNotFoundError")
    assert len(hub.requests) == before  # nothing reached the server


def test_hf_download_cli_then_from_pretrained_gives_the_same_logits(hub, tmp_path):
    from fixtures.models import logits, tiny_llama
    from transformers import LlamaForCausalLM

    model = tiny_llama(tmp_path / "tiny")
    hub.publish("acme/tiny-llama", tmp_path / "tiny")
    hf = Path(sys.executable).with_name("hf")

    done = _run(str(hf), "download", "acme/tiny-llama", "--local-dir", str(tmp_path / "got"))

    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "got").iterdir() if p.is_file()) == [
        ".gitattributes",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "got").eval()
    assert torch.equal(logits(loaded, 1001), logits(model, 1001))
