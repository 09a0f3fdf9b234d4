"""reshard reading Hub repos through the real huggingface_hub client and the local Hub: inspect and check from
headers, convert / fix / verify from the cache, offline runs, and the one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fixtures.models import tiny_llama
from fixtures.trainer import write_rank_files
from safetensors.torch import load_file, save_file

from reshard.commands.inspect import inspect_checkpoint
from reshard.engine.plan.open import open_checkpoint
from reshard.errors import HubError
from reshard.hub.source import HubCheckpoint
from reshard.options import ReadOptions

from .builders import llama_9b

RESHARD = str(Path(sys.executable).with_name("reshard"))


def reshard(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The real console script in a subprocess (it inherits the hub fixture's HF_ENDPOINT, HF_HOME, HF_TOKEN)."""
    return subprocess.run(
        [RESHARD, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers (vocab 1001), and its tp=2 rank files with the vocab padded to 1024."""
    root = tmp_path_factory.mktemp("tiny")
    tiny_llama(root / "full")
    _write_ranks(root / "full", root / "tp2", 2, name="model-rank-{r}.safetensors")
    return root


def _publish_tp2(hub, tiny: Path, repo: str = "acme/tiny-tp2", **extra: bytes) -> str:
    """The tp=2 rank files, plus a tokenizer file, an ``original/`` copy and a stale .bin that must not be read."""
    files = {p.name: p.read_bytes() for p in (tiny / "tp2").iterdir()}
    files |= {"tokenizer_config.json": b'{"model_max_length": 64}', "original/consolidated.00.pth": b"x" * 4096}
    files |= {"model-rank-0.bin": b"not read", **extra}
    return hub.publish(repo, files)


def _lfs_gets(hub, start: int) -> list:
    return [r for r in hub.requests[start:] if r.host == "localhost" and r.method == "GET"]


def test_inspect_of_a_9b_repo_reads_headers_only_under_2mb_and_2s(hub, tmp_path, cli):
    """Issue 15's target: 4 range requests of 100 kB, the index and the config; the same report as on disk."""
    llama_9b(tmp_path / "9b")
    sha = hub.publish("acme/llama-9b", tmp_path / "9b", hash_lfs=False)
    start = len(hub.requests)

    began = time.perf_counter()
    done = reshard("inspect", "acme/llama-9b", "--json")
    wall = time.perf_counter() - began

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    sent = hub.sent(start)
    assert report["hub"] == {
        "repo": "acme/llama-9b",
        "revision": None,
        "commit": sha,
        "path_in_repo": "",
        "bytes_transferred": sent,  # what the client counted is what the server sent
        "requests": len(hub.requests) - start,
    }
    assert sent < 2_000_000
    assert [r.range for r in _lfs_gets(hub, start)] == ["bytes=0-100000"] * 4  # no weight byte beyond headers
    local = inspect_checkpoint(tmp_path / "9b").to_dict()
    for key in ("layout", "tp", "model_type", "plan", "vocab", "tensors", "notes", "extras", "problems"):
        assert report[key] == local[key], key
    assert report["files"] == [f"acme/llama-9b@{sha}/model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    began = time.perf_counter()
    inspect_checkpoint(HubCheckpoint("acme/llama-9b"))  # in process: without the interpreter's start-up
    answered = time.perf_counter() - began
    assert answered < 2.0
    print(f"inspect acme/llama-9b: {sent} bytes, {report['hub']['requests']} requests, {wall:.2f} s (CLI), "
          f"{answered:.2f} s (in process)")  # fmt: skip


def test_inspect_and_check_of_rank_files_read_their_headers_as_the_local_files_read(hub, tiny, tmp_path, cli):
    sha = _publish_tp2(hub, tiny)
    start = len(hub.requests)

    remote = cli("inspect", "acme/tiny-tp2", "--json")
    inspected = _lfs_gets(hub, start)
    checked = cli("check", "acme/tiny-tp2", "--tp", "4", "--json")

    assert remote.exit_code == 0, remote.stderr
    assert [r.range for r in inspected] == ["bytes=0-100000"] * 2  # the headers of the two rank files
    assert all(r.range for r in _lfs_gets(hub, start))
    report, local = json.loads(remote.stdout), json.loads(cli("inspect", tiny / "tp2", "--json").stdout)
    assert (report["layout"], report["tp"], report["vocab"]) == ("loose", 2, local["vocab"])
    assert report["tensors"] == local["tensors"]
    assert report["notes"] == local["notes"]
    assert report["config"] == f"acme/tiny-tp2@{sha}/config.json"
    local_check = json.loads(cli("check", tiny / "tp2", "--tp", "4", "--json").stdout)
    assert checked.exit_code == 0
    assert json.loads(checked.stdout) | {"source": ""} == local_check | {"source": ""}
    assert json.loads(checked.stdout)["source"] == f"acme/tiny-tp2@{sha}"


def test_a_header_only_checkpoint_refuses_to_read_bytes(hub, tiny):
    _publish_tp2(hub, tiny)
    opened = open_checkpoint(HubCheckpoint("acme/tiny-tp2"), ReadOptions())
    ref = opened.source.ranks[1]["lm_head.weight"]

    with pytest.raises(HubError, match="headers only") as refused:
        ref.read()
    assert refused.value.tensor == "lm_head.weight"
    assert str(ref.file).endswith("/model-rank-1.safetensors")
    with pytest.raises(HubError, match="headers only"):
        ref.read_into(torch.empty(ref.shape))


def test_a_torch_only_repo_cannot_be_inspected_header_only(hub, tiny, tmp_path, cli):
    _write_ranks(tiny / "full", tmp_path / "bin", 2)
    hub.publish("acme/bin-tp2", tmp_path / "bin")

    done = cli("inspect", "acme/bin-tp2")

    assert done.exit_code == 2
    assert "pytorch_model_rank0.bin is a torch file" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_convert_downloads_only_what_it_reads_pins_the_commit_and_records_it(hub, tiny, tmp_path, cli):
    sha = _publish_tp2(hub, tiny)
    hub.publish("acme/tiny-tp2", {"README.md": b"moved on"})  # main moves: the tag still names the first commit
    hub.store.get("acme/tiny-tp2").meta["refs"]["tags"]["v1"] = sha
    start = len(hub.requests)

    done = cli("convert", "acme/tiny-tp2@v1", "--tp", "1", "-o", tmp_path / "out", "--cache-dir", tmp_path / "cache")

    assert done.exit_code == 0, done.stderr
    assert done.stdout.startswith(f"acme/tiny-tp2@{sha} (loose, tp=2) -> {tmp_path / 'out'} (hf, tp=1)")
    snapshot = tmp_path / "cache" / "models--acme--tiny-tp2" / "snapshots" / sha
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()) == [
        "config.json",
        "model-rank-0.safetensors",
        "model-rank-1.safetensors",
        "tokenizer_config.json",
    ]
    weights = sum((tiny / "tp2" / f"model-rank-{r}.safetensors").stat().st_size for r in range(2))
    assert sum(r.sent for r in _lfs_gets(hub, start)) == weights  # neither the .bin copy nor original/*.pth
    assert all(sha in r.path for r in hub.requests[start:] if "/resolve/" in r.path)  # never "v1" or "main"
    local = cli("convert", tiny / "tp2", "--tp", "1", "-o", tmp_path / "local")
    assert local.exit_code == 0
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    source = json.loads((tmp_path / "out" / "reshard.json").read_text())["source"]
    assert (source["repo"], source["commit"], source["layout"], source["tp"]) == ("acme/tiny-tp2", sha, "loose", 2)
    assert Path(source["path"]).is_relative_to(tmp_path / "cache")


def test_fix_and_verify_read_from_the_cache_and_fix_writes_beside_the_working_folder(
    hub, tiny, tmp_path, cli, monkeypatch
):
    _publish_tp2(hub, tiny)
    monkeypatch.chdir(tmp_path)

    fixed = cli("fix", "acme/tiny-tp2", "--vocab", "1001", "-q")
    sha = hub.publish("acme/tiny-fixed", tmp_path / "tiny-tp2.fixed")
    verified = cli("verify", "acme/tiny-fixed", "--json")
    compared = cli("verify", "acme/tiny-fixed", tiny / "full")

    assert fixed.exit_code == 0, fixed.stderr
    assert (tmp_path / "tiny-tp2.fixed" / "model.safetensors").is_file()  # not in the cache beside the snapshot
    assert verified.exit_code == 0, verified.stdout
    assert json.loads(verified.stdout)["checkpoint"] == f"acme/tiny-fixed@{sha}"
    assert json.loads(verified.stdout)["checks"][0]["tensors"] == len(load_file(tiny / "full" / "model.safetensors"))
    assert compared.exit_code == 0, compared.stdout


def test_a_reshard_output_on_the_hub_is_read_with_its_manifest(hub, tiny, tmp_path, cli):
    assert cli("convert", tiny / "full", "--tp", "2", "--layout", "hf-ranks", "-o", tmp_path / "tp2").exit_code == 0
    hub.publish("acme/ranks", tmp_path / "tp2")

    remote = json.loads(cli("inspect", "acme/ranks", "--json").stdout)
    local = json.loads(cli("inspect", tmp_path / "tp2", "--json").stdout)
    config = cli("check", "hf://acme/ranks/config.json", "--tp", "4", "--json")

    assert (remote["layout"], remote["tp"], remote["vocab"]["origin"]) == ("hf-ranks", 2, "reshard.json")
    assert remote["tensors"] == local["tensors"] and len(remote["files"]) == 2
    assert config.exit_code == 0, config.stderr
    assert json.loads(config.stdout)["input"] == "config"


def _error(done) -> str:
    assert done.exit_code == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("ckpt", "token", "expected"),
    [
        ("acme/missing", True, "acme/missing: not a local path, and http://127.0.0.1"),
        ("acme/tiny-tp2@no-such-branch", True, "acme/tiny-tp2@no-such-branch: no such revision"),
        ("acme/private", False, "has no such repo (or it is private and no token was given)"),
        ("acme/gated", False, "acme/gated: a gated repo: no token was given"),
        ("hf://acme/tiny-tp2/nowhere", True, "no file or folder 'nowhere' at this revision"),
        ("acme/broken", True, "model.safetensors.index.json names model-00002-of-00002.safetensors, which is not"),
    ],
    ids=["unknown-repo", "unknown-revision", "private-no-token", "gated-no-token", "missing-folder", "missing-shard"],
)
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_hub_errors_are_one_line_exit_2_and_write_nothing(
    hub, tiny, tmp_path, cli, monkeypatch, ckpt, token, expected, command
):
    _publish_tp2(hub, tiny)
    hub.publish("acme/private", tiny / "full", private=True)
    hub.publish("acme/gated", tiny / "full", gated="manual")
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    hub.publish("acme/broken", {"model.safetensors.index.json": json.dumps(index).encode(), "config.json": b"{}"})
    if not token:
        monkeypatch.delenv("HF_TOKEN")
    args = ["-o", tmp_path / "out", "--tp", "1"] if command == "convert" else []

    line = re.sub(r"@[0-9a-f]{40}", "", _error(cli(command, ckpt, *args)))  # the commit read

    assert expected in line
    assert not (tmp_path / "out").exists()
    if not token and "private" in ckpt:
        assert "set HF_TOKEN or run `hf auth login`" in line


def test_offline_runs_from_the_cache_and_names_a_missing_file(hub, tiny, tmp_path):
    sha = _publish_tp2(hub, tiny)
    assert reshard("convert", "acme/tiny-tp2", "--tp", "1", "-o", str(tmp_path / "online"), "-q").returncode == 0
    before = len(hub.requests)

    again = reshard("convert", "acme/tiny-tp2", "--tp", "2", "-o", str(tmp_path / "offline"), HF_HUB_OFFLINE="1")
    inspected = reshard("inspect", "acme/tiny-tp2", "--json", HF_HUB_OFFLINE="1")
    snapshot = Path(os.environ["HF_HOME"]) / "hub" / "models--acme--tiny-tp2" / "snapshots" / sha
    (snapshot / "model-rank-1.safetensors").unlink()
    missing = reshard("fix", "acme/tiny-tp2", "-o", str(tmp_path / "fixed"), HF_HUB_OFFLINE="1")

    assert again.returncode == 0, again.stderr
    assert load_file(tmp_path / "offline" / "rank_01" / "model.safetensors").keys()
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["hub"]["commit"] == sha
    assert missing.returncode == 2
    assert "model-rank-1.safetensors" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "fixed").exists()
    assert len(hub.requests) == before  # nothing reached the server


def test_a_local_path_wins_over_a_repo_of_the_same_name(hub, tiny, tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny / "full", tmp_path / "acme" / "tiny-tp2")
    start = len(hub.requests)

    done = cli("inspect", "acme/tiny-tp2", "--json")

    assert done.exit_code == 0 and "hub" not in json.loads(done.stdout)
    assert len(hub.requests) == start


def test_a_missing_local_path_that_looks_like_a_repo_id_is_named_as_missing(hub, tiny, tmp_path, cli, monkeypatch):
    """``runs/ckpt-tp2`` beside a folder ``runs`` is a mistyped local path: said so, without asking the Hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    start = len(hub.requests)

    done = cli("inspect", "runs/ckpt-tp2")

    assert done.exit_code == 2
    error = done.stderr.strip().splitlines()[-1]  # click's usage error for a CKPT argument, as for any missing path
    assert "runs/ckpt-tp2: no such file or folder (not read as a Hub repo: 'runs' is a local folder)" in error
    assert "hf://runs/ckpt-tp2" in error
    assert len(hub.requests) == start


def test_a_missing_path_like_a_repo_id_offline_is_said_missing_first(tmp_path, cli, monkeypatch):
    """``runs/ckpt-tp2`` with no ``runs`` here, offline: no such folder first, then why it is no repo either, in one
    line, without the Hub's ``unset HF_HUB_OFFLINE`` hint."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    done = cli("inspect", "runs/ckpt-tp2")

    assert done.exit_code == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "Error: runs/ckpt-tp2: no such file or folder (there is no 'runs' here), and not a Hub repo either: "
        "not in the cache, and the Hub cannot be reached"
    )
    assert line.endswith("(check the path; a Hub repo is read as hf://runs/ckpt-tp2)")
    assert "HF_HUB_OFFLINE" not in line.split("(check the path")[1]


def test_a_missing_path_like_a_repo_id_with_the_hub_out_of_reach_is_said_missing_first(tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused

    done = cli("inspect", "runs/ckpt-tp2")

    assert done.exit_code == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "Error: runs/ckpt-tp2: no such file or folder (there is no 'runs' here), and not a Hub repo either: "
        "not in the cache, and the Hub cannot be reached"
    )
    assert line.endswith("(check the path; a Hub repo is read as hf://runs/ckpt-tp2)")


def test_an_hf_uri_keeps_the_hub_error(hub, tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)

    done = cli("inspect", "hf://runs/ckpt-tp2")

    assert done.exit_code == 2
    assert "has no such repo" in done.stderr and "no such file or folder" not in done.stderr


def test_single_file_and_subfolder_checkpoints(hub, tiny, tmp_path, cli):
    save_file(load_file(tiny / "full" / "model.safetensors"), tmp_path / "model.safetensors")
    files = {"run1/config.json": (tiny / "full" / "config.json").read_bytes()}
    files |= {"run1/model.safetensors": (tmp_path / "model.safetensors").read_bytes()}
    sha = hub.publish("acme/runs", files)

    folder = json.loads(cli("inspect", "hf://acme/runs/run1", "--json").stdout)
    single = json.loads(cli("inspect", "acme/runs@main/run1/model.safetensors", "--json").stdout)

    assert folder["path"] == f"acme/runs@{sha}/run1" and folder["hub"]["path_in_repo"] == "run1"
    assert folder["tensors"] == single["tensors"] and len(folder["tensors"]) == 21
    assert single["config"] == f"acme/runs@{sha}/run1/config.json"


def _write_ranks(model_dir: Path, out: Path, tp: int, *, name: str = "pytorch_model_rank{r}.bin", config=None) -> Path:
    """The saved model in ``model_dir`` as a TP trainer's padded rank files in ``out``."""
    config = config or json.loads((model_dir / "config.json").read_text())
    return write_rank_files(out, load_file(model_dir / "model.safetensors"), config, tp, name=name)


@pytest.fixture
def silent_hub() -> Iterator[str]:
    """An endpoint that accepts every connection and never answers (a hung proxy or server)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def test_a_hub_that_never_answers_ends_in_one_line_within_the_timeouts(silent_hub, tmp_path) -> None:
    env = {
        "HF_ENDPOINT": silent_hub,
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_ETAG_TIMEOUT": "1",
        "HF_HUB_DOWNLOAD_TIMEOUT": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
    }
    start = time.monotonic()
    done = subprocess.run(
        [RESHARD, "inspect", "acme/silent"], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert time.monotonic() - start < 60
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: acme/silent") and f"{silent_hub} did not answer in time" in lines[0], lines
    assert "HF_HUB_DOWNLOAD_TIMEOUT" in lines[0]


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_listing_naming_a_file_outside_the_repo_is_one_line(hub, tiny, tmp_path, cli, command) -> None:
    files = {
        f"rank_0{r}/model.safetensors": (tiny / "tp2" / f"model-rank-{r}.safetensors").read_bytes() for r in (0, 1)
    }
    files |= {"config.json": (tiny / "full" / "config.json").read_bytes(), "rank_00/../../escape.safetensors": b"x"}
    hub.publish("acme/escape", files)
    args = ["-o", tmp_path / "out", "--tp", "1"] if command == "convert" else []
    result = cli(command, "acme/escape", *args)
    line = _error(result)
    assert result.exit_code == 2 and "acme/escape" in line and "rank_00/../../escape.safetensors" in line, line
    assert "outside the repo" in line
    assert not (tmp_path / "out").exists() and not (tmp_path.parent / "escape.safetensors").exists()
