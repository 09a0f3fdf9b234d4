"""``reshard verify``: damage real checkpoints on disk one way at a time and check each is found and named."""

from __future__ import annotations

import importlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from fixtures import SAMPLES, snapshot
from fixtures.hf import load_folder
from fixtures.models import tiny_llama
from safetensors.torch import load_file, save_file

from reshard import ConvertOptions, ReadOptions, convert
from reshard.commands.verify import VerifyOptions, verify
from reshard.engine.plan.open import OpenedCheckpoint
from reshard.engine.run.conversion import run_conversion

Q1 = "model.layers.1.self_attn.q_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama saved by transformers, and reshard's tp=1 and tp=2 conversions of it (read-only)."""
    root = tmp_path_factory.mktemp("verify")
    tiny_llama(root / "hf", vocab=1001)
    convert(root / "hf", root / "tp1", ConvertOptions(tp=1, progress=False))
    convert(root / "hf", root / "tp2", ConvertOptions(tp=2, progress=False))
    convert(root / "hf", root / "tp2-sharded", ConvertOptions(tp=2, max_shard_size=100_000, progress=False))
    return {"root": root, "hf": root / "hf", "tp1": root / "tp1", "tp2": root / "tp2", "sharded": root / "tp2-sharded"}


@pytest.fixture
def copy(checkpoints: dict[str, Path], tmp_path: Path):
    def make(name: str) -> Path:
        return Path(shutil.copytree(checkpoints[name], tmp_path / name))

    return make


def data_offset(path: Path, key: str) -> int:
    """Where ``key``'s bytes start in a safetensors file, from its header (independently of reshard)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    return 8 + length + header[key]["data_offsets"][0]


def flip_byte(path: Path, key: str, at: int = 5) -> None:
    raw = bytearray(path.read_bytes())
    raw[data_offset(path, key) + at] ^= 0x40
    path.write_bytes(bytes(raw))


def rewrite(path: Path, change) -> None:
    state = load_file(path)
    change(state)
    save_file(state, path, metadata={"format": "pt"})


def found(result_json: dict) -> set[tuple[str, str | None]]:
    return {(d["kind"], d["tensor"]) for check in result_json["checks"] for d in check["differences"]}


def test_clean_checkpoints_verify(cli, checkpoints: dict[str, Path]) -> None:
    expected = len(load_folder(checkpoints["hf"]))
    for name in ("tp1", "tp2", "sharded"):
        result = cli("verify", checkpoints[name], "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["ok"] and report["checks"][0]["check"] == "manifest"
        assert report["checks"][0]["tensors"] == expected
    text = cli("verify", checkpoints["tp2"]).stdout
    assert f"manifest against reshard.json: ok ({expected} tensors checked)" in text


def test_flipped_byte_in_a_sharded_tensor(cli, copy) -> None:
    ckpt = copy("tp2")
    before = load_file(ckpt / "rank_01" / "model.safetensors")[Q1].clone()
    flip_byte(ckpt / "rank_01" / "model.safetensors", Q1)
    after = load_file(ckpt / "rank_01" / "model.safetensors")[Q1]
    assert (before != after).sum() == 1  # the flip landed inside the tensor's data, not the header
    result = cli("verify", ckpt)
    assert result.exit_code == 1
    assert f"{Q1}  blake3" in result.stdout and "rank_01/model.safetensors" in result.stdout
    assert found(json.loads(cli("verify", ckpt, "--json").stdout)) == {("blake3", Q1)}


def as_sha256_manifest(ckpt: Path, original: Path) -> None:
    """Rewrite ``reshard.json`` as a version before BLAKE3 wrote it: each tensor's ``sha256`` (of the original's
    bytes, hashed here with hashlib) instead of its ``blake3``."""
    import hashlib

    tensors = load_folder(original)
    path = ckpt / "reshard.json"
    manifest = json.loads(path.read_text())
    for name, entry in manifest["tensors"].items():
        assert len(entry.pop("blake3")) == 64
        entry["sha256"] = hashlib.sha256(tensors[name].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    path.write_text(json.dumps(manifest))


def test_a_manifest_of_sha256_digests_is_checked_with_sha256(cli, checkpoints: dict[str, Path], copy) -> None:
    ckpt = copy("tp2")
    as_sha256_manifest(ckpt, checkpoints["hf"])
    assert cli("verify", ckpt).exit_code == 0
    flip_byte(ckpt / "rank_01" / "model.safetensors", Q1, at=11)
    result = cli("verify", ckpt, "--json")
    assert result.exit_code == 1
    assert found(json.loads(result.stdout)) == {("sha256", Q1)}


@pytest.mark.parametrize("at", [0, 1, 4095, 4096, -1])
def test_a_flipped_bit_anywhere_in_a_tensor_fails(cli, copy, at: int) -> None:
    ckpt = copy("tp1")
    path = ckpt / "model.safetensors"
    raw = bytearray(path.read_bytes())
    start = data_offset(path, Q1)
    size = load_file(path)[Q1].numel() * 2
    raw[start + (at % size)] ^= 0x01
    path.write_bytes(bytes(raw))
    assert found(json.loads(cli("verify", ckpt, "--json").stdout)) == {("blake3", Q1)}


def test_flipped_byte_in_a_replicated_tensor(cli, copy) -> None:
    ckpt = copy("tp2")
    flip_byte(ckpt / "rank_01" / "model.safetensors", NORM, at=2)
    result = cli("verify", ckpt, "--json")
    assert result.exit_code == 1
    assert found(json.loads(result.stdout)) == {("inconsistent", NORM)}
    result = cli("verify", ckpt, "--roundtrip", "4", "--json")
    assert result.exit_code == 1
    manifest, ranks, trip = json.loads(result.stdout)["checks"]
    assert found({"checks": [ranks]}) == {("inconsistent", NORM)}
    [diff] = trip["differences"]
    assert (diff["kind"], diff["tensor"]) == ("inconsistent", NORM) and "rank_00" in diff["file"]


def test_deleted_rank_file(cli, copy) -> None:
    ckpt = copy("tp2")
    (ckpt / "rank_01" / "model.safetensors").unlink()
    result = cli("verify", ckpt)
    assert result.exit_code == 1
    assert "missing-file" in result.stdout and "no weight files" in result.stdout
    assert str(ckpt / "rank_01") in result.stdout


def test_deleted_rank_file_with_roundtrip(cli, copy) -> None:
    ckpt = copy("tp2")
    (ckpt / "rank_00" / "model.safetensors").unlink()
    result = cli("verify", ckpt, "--roundtrip", "4", "--json")
    assert result.exit_code == 1
    manifest, trip = json.loads(result.stdout)["checks"]
    assert [d["kind"] for d in manifest["differences"]] == ["missing-file"]
    assert trip["tp"] == 4 and [d["kind"] for d in trip["differences"]] == ["not-run"]


def test_uneven_checkpoint_verifies(cli, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    options = ConvertOptions(tp=2, read=ReadOptions(uneven=True), progress=False)
    convert(checkpoints["hf"], tmp_path / "uneven", options)
    shapes = [
        load_file(tmp_path / "uneven" / r / "model.safetensors")["lm_head.weight"].shape[0]
        for r in ("rank_00", "rank_01")
    ]
    assert shapes == [501, 500]
    for args in ([], [checkpoints["hf"]], ["--roundtrip", "2,4"]):
        result = cli("verify", tmp_path / "uneven", *args)
        assert result.exit_code == 0, result.stdout


def test_compare_with_a_deleted_rank_file_is_unreadable(cli, copy, checkpoints: dict[str, Path]) -> None:
    other = copy("tp2")
    (other / "rank_01" / "model.safetensors").unlink()
    result = cli("verify", checkpoints["hf"], other)
    assert result.exit_code == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert str(other / "rank_01") in line and "no weight files" in line


def test_deleted_rank_folder(cli, copy) -> None:
    ckpt = copy("tp2")
    shutil.rmtree(ckpt / "rank_01")
    result = cli("verify", ckpt, "--json")
    assert result.exit_code == 1
    [diff] = json.loads(result.stdout)["checks"][0]["differences"]
    assert diff["kind"] == "missing-file" and diff["file"] == str(ckpt / "rank_01") and "tp=2" in diff["detail"]


def test_deleted_shard_named_by_the_index(cli, copy) -> None:
    ckpt = copy("sharded")
    index = json.loads((ckpt / "rank_00" / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(index.values()))[1]
    (ckpt / "rank_00" / victim).unlink()
    result = cli("verify", ckpt, "--json")
    assert result.exit_code == 1
    [diff] = json.loads(result.stdout)["checks"][0]["differences"]
    assert diff["kind"] == "missing-file" and diff["file"] == str(ckpt / "rank_00" / victim)
    assert index[diff["tensor"]] == victim


def test_tensor_in_two_files(cli, copy) -> None:
    ckpt = copy("sharded")
    files = sorted(p.name for p in (ckpt / "rank_01").glob("*.safetensors"))
    first = load_file(ckpt / "rank_01" / files[0])
    key = sorted(first)[0]
    rewrite(ckpt / "rank_01" / files[1], lambda s: s.__setitem__(key, first[key]))
    result = cli("verify", ckpt, "--json")
    assert result.exit_code == 1
    [diff] = json.loads(result.stdout)["checks"][0]["differences"]
    assert (diff["kind"], diff["tensor"]) == ("duplicate", key) and files[0] in diff["detail"]


def test_renamed_tensor(cli, copy) -> None:
    ckpt = copy("tp2")
    for rank in ("rank_00", "rank_01"):
        rewrite(
            ckpt / rank / "model.safetensors", lambda s: s.__setitem__("model.norm.scale", s.pop("model.norm.weight"))
        )
    result = cli("verify", ckpt, "--json")
    assert result.exit_code == 1
    assert found(json.loads(result.stdout)) == {("missing", "model.norm.weight"), ("extra", "model.norm.scale")}


def test_changed_dtype(cli, copy) -> None:
    ckpt = copy("tp1")
    rewrite(ckpt / "model.safetensors", lambda s: s.__setitem__(Q1, s[Q1].to(torch.float16)))
    result = cli("verify", ckpt, "--json")
    assert result.exit_code == 1
    [diff] = json.loads(result.stdout)["checks"][0]["differences"]
    assert (diff["kind"], diff["tensor"]) == ("dtype", Q1) and "float16" in diff["detail"]


def test_nan_where_the_manifest_says_finite(cli, copy) -> None:
    ckpt = copy("tp1")

    def poison(state: dict[str, torch.Tensor]) -> None:
        state[NORM] = state[NORM].clone()
        state[NORM][3] = float("nan")

    rewrite(ckpt / "model.safetensors", poison)
    result = cli("verify", ckpt, "--json")
    assert result.exit_code == 1
    assert found(json.loads(result.stdout)) == {("blake3", NORM), ("non-finite", NORM)}


def test_old_manifest_without_finite_still_verifies(cli, copy) -> None:
    ckpt = copy("tp2")
    manifest = json.loads((ckpt / "reshard.json").read_text())
    for entry in manifest["tensors"].values():
        del entry["finite"]
    (ckpt / "reshard.json").write_text(json.dumps(manifest))
    assert cli("verify", ckpt).exit_code == 0


def test_truncated_file_is_unreadable(cli, copy) -> None:
    ckpt = copy("tp2")
    path = ckpt / "rank_00" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    result = cli("verify", ckpt)
    assert result.exit_code == 2
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert str(path) in line and "truncated" in line and "Traceback" not in result.stderr


def test_no_manifest_is_bad_input(cli, checkpoints: dict[str, Path]) -> None:
    result = cli("verify", checkpoints["hf"])
    assert result.exit_code == 2
    assert "no reshard.json" in result.stderr and str(checkpoints["hf"]) in result.stderr


def test_compare_any_layouts_and_tp(cli, checkpoints: dict[str, Path]) -> None:
    for a, b in (("hf", "tp2"), ("tp2", "sharded"), ("tp1", "hf")):
        result = cli("verify", checkpoints[a], checkpoints[b], "--json")
        assert result.exit_code == 0, result.stdout
        assert json.loads(result.stdout)["checks"][0]["tensors"] == len(load_folder(checkpoints["hf"]))


def test_compare_reports_values_missing_extra_reshaped(cli, copy, checkpoints: dict[str, Path]) -> None:
    other = copy("tp1")
    original = load_file(checkpoints["tp1"] / "model.safetensors")

    def damage(state: dict[str, torch.Tensor]) -> None:
        state[Q1] = state[Q1] + 1e-3 * torch.arange(state[Q1].numel()).reshape(state[Q1].shape) / state[Q1].numel()
        state["extra.weight"] = state.pop(NORM)
        state["model.norm.weight"] = torch.cat([state["model.norm.weight"], state["model.norm.weight"][:1]])

    rewrite(other / "model.safetensors", damage)
    (other / "reshard.json").unlink()
    gap = float((load_file(other / "model.safetensors")[Q1].double() - original[Q1].double()).abs().max())
    result = cli("verify", checkpoints["tp2"], other, "--json")
    assert result.exit_code == 1
    diffs = {(d["kind"], d["tensor"]): d for d in json.loads(result.stdout)["checks"][0]["differences"]}
    assert set(diffs) == {
        ("values", Q1),
        ("missing", NORM),
        ("extra", "extra.weight"),
        ("reshaped", "model.norm.weight"),
    }
    assert diffs[("values", Q1)]["max_abs_diff"] == pytest.approx(gap, rel=1e-6)
    assert diffs[("reshaped", "model.norm.weight")]["detail"] == "[64] vs [65]"
    loose = cli("verify", checkpoints["tp2"], other, "--atol", "1e-2", "--json")
    assert found(json.loads(loose.stdout)) == {
        ("missing", NORM),
        ("extra", "extra.weight"),
        ("reshaped", "model.norm.weight"),
    }


def test_roundtrip_reports_an_infeasible_tp(cli, checkpoints: dict[str, Path]) -> None:
    result = cli("verify", checkpoints["hf"], "--roundtrip", "2,3", "--json")
    assert result.exit_code == 1
    checks = json.loads(result.stdout)["checks"]
    assert [(c["tp"], c["ok"]) for c in checks] == [(2, True), (3, False)]
    assert {d["kind"] for d in checks[1]["differences"]} == {"plan"}
    assert any(d["tensor"] == Q1 and "3 ways" in d["detail"] for d in checks[1]["differences"])


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_roundtrip_cleans_up_on_interrupt(checkpoints, tmp_path, monkeypatch, interrupt) -> None:
    import tempfile

    verify_module = importlib.import_module("reshard.commands.verify")

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    calls = []

    def convert_then_stop(opened: OpenedCheckpoint, out: Path, options: ConvertOptions):
        run_conversion(opened, out, options)
        calls.append(out)
        assert out.is_dir() and out.parent.parent == scratch
        raise interrupt("stop")

    monkeypatch.setattr(verify_module, "run_conversion", convert_then_stop)
    with pytest.raises(interrupt, match="stop"):
        verify(checkpoints["hf"], options=VerifyOptions(roundtrip=(2,)))
    assert calls and list(scratch.iterdir()) == []


def test_verify_never_modifies_its_inputs(cli, checkpoints: dict[str, Path]) -> None:
    before, siblings = [snapshot(checkpoints[n]) for n in ("hf", "tp2")], sorted(checkpoints["root"].iterdir())
    assert cli("verify", checkpoints["tp2"], "--roundtrip", "1,4").exit_code == 0
    assert cli("verify", checkpoints["hf"], checkpoints["tp2"]).exit_code == 0
    assert [snapshot(checkpoints[n]) for n in ("hf", "tp2")] == before
    assert sorted(checkpoints["root"].iterdir()) == siblings


@pytest.mark.parametrize("value", ["2,x", "0", ","])
def test_bad_roundtrip_list_is_a_usage_error(cli, checkpoints: dict[str, Path], value: str) -> None:
    result = cli("verify", checkpoints["tp2"], "--roundtrip", value)
    assert result.exit_code == 2
    assert "is not a list of tp sizes such as 2,4,8" in result.stderr


def test_sat_sample_verifies_and_roundtrips(cli) -> None:
    sample = SAMPLES / "tiny-cogagent-sat-tp8"
    recorded = json.loads((sample / "reshard.json").read_text())["tensors"]
    result = cli("verify", sample, "--roundtrip", "4", "--json")
    assert result.exit_code == 0, result.stdout
    checks = json.loads(result.stdout)["checks"]
    expected = [("manifest", len(recorded)), ("ranks", len(recorded)), ("roundtrip", len(recorded))]
    assert [(c["check"], c["tensors"]) for c in checks] == expected


def test_an_hf_folder_and_its_megatron_conversion_compare_through_the_name_mapping(cli, tmp_path):
    """Megatron names its tensors otherwise (fused QKV and gate/up): compared through the mapping convert applies,
    a correct conversion is OK both ways, and another model's conversion differs in values under the hf names."""
    tiny_llama(tmp_path / "hf", vocab=1001)
    tiny_llama(tmp_path / "other", vocab=1001, seed=1)
    for name in ("hf", "other"):
        args = ("convert", tmp_path / name, "--tp", 2, "--layout", "megatron", "-o", tmp_path / f"{name}-megatron")
        assert cli(*args, "-q").exit_code == 0
    expected = len(load_folder(tmp_path / "hf"))
    for a, b in (("hf", "hf-megatron"), ("hf-megatron", "hf")):
        result = cli("verify", tmp_path / a, tmp_path / b, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["checks"][0]["tensors"] == expected
    result = cli("verify", tmp_path / "hf", tmp_path / "other-megatron", "--json")
    assert result.exit_code == 1
    differences = json.loads(result.stdout)["checks"][0]["differences"]
    assert {d["kind"] for d in differences} == {"values"}
    assert "model.layers.0.self_attn.q_proj.weight" in {d["tensor"] for d in differences}
    assert not list(tmp_path.glob(".*"))  # nothing left beside
