"""``convert --dtype``: FP8 checkpoints written by transformers' own quantizer (and in compressed-tensors' storage)
dequantized on the way, checked against transformers' own dequantization, its loader (no missing or unexpected
keys, equal logits) and, at tp 2, its TP loader's rank slices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.fp8 import block_fp8_llama, compressed_fp8_llama, quantize_blocks
from fixtures.hf import load_folder, load_rank
from fixtures.trainer import rank_states
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

WORKER = Path(__file__).resolve().parents[1] / "oracles" / "tp_loader_worker.py"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
IDS = torch.arange(24).reshape(2, 12)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> Path:
    """A tiny Llama quantized by transformers' FineGrainedFP8 quantizer (128x128 blocks of distinct magnitudes)."""
    return block_fp8_llama(tmp_path_factory.mktemp("fp8"))


def _load(folder: Path, dtype: torch.dtype | None = None):
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    return model.eval()


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_block_fp8_dequantizes_as_transformers_loads_it(fp8, cli, tmp_path):
    result = cli("convert", fp8, "--tp", 1, "--dtype", "bfloat16", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "dequantized 14 FP8 weight(s) to bfloat16; dropped 14 scale tensor(s)" in result.output
    theirs = _load(fp8, torch.bfloat16)  # transformers dequantizes an FP8 checkpoint to bf16 when it loads it on CPU
    mine = _load(tmp_path / "out")
    expected = theirs.state_dict()
    written = load_folder(tmp_path / "out")
    assert sorted(written) == sorted(expected)  # the scales are gone, nothing else
    assert all(_bitwise(written[name], expected[name]) for name in expected)
    with torch.no_grad():
        assert torch.equal(mine(IDS).logits, theirs(IDS).logits)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    manifest = json.loads((tmp_path / "out" / "reshard.json").read_text())
    assert {entry["dtype"] for entry in manifest["tensors"].values()} == {"bfloat16"}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_block_fp8_to_other_floats_is_transformers_dequantize_in_that_dtype(fp8, cli, tmp_path, dtype):
    """transformers loads an FP8 checkpoint on CPU in bf16 whatever dtype it is asked; its ``Fp8Dequantize`` op,
    given the output dtype, is the reference here."""
    assert cli("convert", fp8, "--tp", 1, "--dtype", dtype, "-o", tmp_path / "out").exit_code == 0
    stored, written = load_file(fp8 / "model.safetensors"), load_folder(tmp_path / "out")
    assert sorted(written) == sorted(n for n in stored if not n.endswith("_scale_inv"))
    dequantize = Fp8Dequantize(None)._dequantize_one
    for name, tensor in written.items():
        if stored[name].dtype == torch.float8_e4m3fn:
            want = dequantize(stored[name], stored[name + "_scale_inv"], output_dtype=DTYPES[dtype])
        else:
            want = stored[name].to(DTYPES[dtype])
        assert _bitwise(tensor, want), name
    assert _load(tmp_path / "out").dtype == DTYPES[dtype]


def test_at_tp_2_each_rank_holds_what_transformers_tp_loader_holds(fp8, cli, tmp_path):
    """Rank slices are cut after dequantization: the 128-row k_proj splits in 64 rows per rank, half a scale block.
    (transformers' own TP loader, given the FP8 checkpoint, cuts first and fails on that very split: its rank 1
    gets an empty scale grid.)"""
    assert (
        cli("convert", fp8, "--tp", 2, "--layout", "hf-ranks", "--dtype", "bfloat16", "-o", tmp_path / "tp2").exit_code
        == 0
    )
    assert cli("convert", fp8, "--tp", 1, "--dtype", "bfloat16", "-o", tmp_path / "full").exit_code == 0
    full = _load(fp8, torch.bfloat16).state_dict()
    expected = rank_states(full, 2, pad_multiple=1, junk_seed=None)
    env = os.environ | {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        str(WORKER),
        str(tmp_path / "loader"),
    ]
    done = subprocess.run([*command, f"{tmp_path / 'full'}=LlamaForCausalLM"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        mine = load_rank(tmp_path / "tp2", rank)
        loader = load_file(tmp_path / "loader" / "full" / f"rank_{rank:02d}.safetensors")  # loaded as float32
        assert sorted(mine) == sorted(expected[rank]) == sorted(loader)
        for name, tensor in mine.items():
            assert _bitwise(tensor, expected[rank][name]), (name, rank)
            assert torch.equal(tensor.float(), loader[name]), (name, rank)
    assert cli("convert", tmp_path / "tp2", "--tp", 1, "-o", tmp_path / "back").exit_code == 0
    with torch.no_grad():
        assert torch.equal(_load(tmp_path / "back")(IDS).logits, _load(fp8, torch.bfloat16)(IDS).logits)


def test_a_ragged_last_block_as_deepseek_stores_it(fp8, cli, tmp_path):
    """transformers' quantizer leaves a weight whose sizes are not multiples of 128 unquantized; DeepSeek-V3 stores
    kv_a_proj_with_mqa (576 rows) with a short last block. Here a 200 x 136 weight, quantized with that arithmetic."""
    source = tmp_path / "ragged"
    source.mkdir()
    (source / "config.json").write_text((fp8 / "config.json").read_text())
    weight = (
        torch.randn(200, 136, generator=torch.Generator().manual_seed(5))
        * torch.tensor([1.0, 16.0]).repeat_interleave(100)[:, None]
    )
    quantized, scale_inv = quantize_blocks(weight)
    save_file({"proj.weight": quantized, "proj.weight_scale_inv": scale_inv}, source / "model.safetensors")
    assert cli("convert", source, "--tp", 1, "--dtype", "float32", "-o", tmp_path / "out").exit_code == 0
    (written,) = load_folder(tmp_path / "out").values()
    full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :136]
    assert torch.equal(written, quantized.float() * full)


@pytest.mark.parametrize(("strategy", "static"), [("channel", True), ("tensor", False)])
def test_compressed_tensors_fp8_drops_scales_and_input_scales(cli, tmp_path, strategy, static):
    """compressed-tensors' storage (llm-compressor's arithmetic, see fixtures.fp8): ``x.to(scale.dtype) * scale``."""
    source = compressed_fp8_llama(tmp_path, strategy=strategy, static_input=static)
    result = cli("convert", source, "--tp", 2, "--layout", "hf-ranks", "--dtype", "bfloat16", "-o", tmp_path / "tp2")
    assert result.exit_code == 0, result.output
    assert cli("convert", tmp_path / "tp2", "--tp", 1, "-o", tmp_path / "full").exit_code == 0
    stored = load_folder(source)
    written = load_folder(tmp_path / "full")
    assert not any(name.endswith(("_scale", "input_scale")) for name in written)
    for name, tensor in written.items():
        if stored[name].dtype == torch.float8_e4m3fn:
            scale = stored[name.removesuffix("weight") + "weight_scale"]
            assert _bitwise(tensor, stored[name].to(scale.dtype) * scale), name
        else:
            assert _bitwise(tensor, stored[name]), name
    _load(tmp_path / "full")


def test_dequantized_weights_are_written_straight_from_the_memory_they_are_made_in(fp8, cli, tmp_path, monkeypatch):
    """Each weight is dequantized into memory on the 4 KB phase of its offset in the output file, so its whole
    blocks go to the disk without a staging copy; only the tensors written as they were read (their memory is on
    their source file's phase) are copied into staging."""
    from reshard.io import direct as direct_io

    if not direct_io.DirectFile(tmp_path / "probe", 0)._direct:
        pytest.skip("this file system has no O_DIRECT")
    staged: list[int] = []
    real = direct_io.DirectFile._write_block

    def write_block(self, views: list[memoryview], position: int) -> None:
        if not (len(views) == 1 and direct_io.in_phase(views[0], position)):
            staged.append(sum(len(view) for view in views))
        real(self, views, position)

    monkeypatch.setattr(direct_io.DirectFile, "_write_block", write_block)
    assert cli("convert", fp8, "--tp", 1, "--dtype", "bfloat16", "-o", tmp_path / "out").exit_code == 0
    stored = load_file(fp8 / "model.safetensors")
    kept = sum(t.nbytes for n, t in stored.items() if t.dtype == torch.bfloat16)
    dequantized = sum(t.numel() * 2 for t in stored.values() if t.dtype == torch.float8_e4m3fn)
    assert dequantized > kept  # so the dequantized weights cannot all hide in the bound below
    assert sum(staged) <= kept


def test_a_weight_its_scales_bound_is_recorded_finite_without_a_look_at_its_values(fp8, cli, tmp_path, monkeypatch):
    """The manifest's ``finite`` of a dequantized weight comes from its inputs when they bound it (no NaN byte, the
    largest scale times 448 finite in bf16): the engine looks at the values of the other tensors only. A weight
    with a NaN byte is looked at, and recorded not finite."""
    from reshard.engine.move import gathered

    looked: list[tuple[int, ...]] = []
    real = gathered.all_finite_in_blocks
    monkeypatch.setattr(gathered, "all_finite_in_blocks", lambda t: looked.append(tuple(t.shape)) or real(t))
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text((fp8 / "config.json").read_text())
    stored = load_file(fp8 / "model.safetensors")
    nan_weight = "model.layers.1.mlp.up_proj.weight"
    stored[nan_weight] = stored[nan_weight].clone()
    stored[nan_weight].view(torch.uint8)[2, 3] = 0x7F
    save_file(stored, source / "model.safetensors", metadata={"format": "pt"})
    assert cli("convert", source, "--tp", 1, "--dtype", "bfloat16", "-o", tmp_path / "out").exit_code == 0
    manifest = json.loads((tmp_path / "out" / "reshard.json").read_text())["tensors"]
    fp8_names = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    assert {n: manifest[n]["finite"] for n in fp8_names} == {n: n != nan_weight for n in fp8_names}
    plain = [n for n, t in stored.items() if t.dtype == torch.bfloat16]
    assert all(manifest[n]["finite"] for n in plain)
    assert sorted(looked) == sorted([tuple(stored[n].shape) for n in [*plain, nan_weight]])


def test_dtype_alone_casts_a_plain_checkpoint(fp8, cli, tmp_path):
    plain = fp8.parent / "bf16-source"
    assert cli("convert", plain, "--tp", 1, "--dtype", "float32", "-o", tmp_path / "f32").exit_code == 0
    before, after = load_folder(plain), load_folder(tmp_path / "f32")
    assert all(_bitwise(after[name], tensor.float()) for name, tensor in before.items())
    assert _load(tmp_path / "f32").dtype == torch.float32


@pytest.mark.parametrize(
    ("quant", "said"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "dequantizing gptq 4-bit, group 128 is not"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "dequantizing awq 4-bit, group 128 is not supported"),
    ],
)
def test_a_quantization_not_dequantized_is_refused_and_nothing_is_written(fp8, cli, tmp_path, quant, said):
    source = tmp_path / "src"
    source.mkdir()
    config = json.loads((fp8 / "config.json").read_text()) | {"quantization_config": quant}
    (source / "config.json").write_text(json.dumps(config))
    (source / "model.safetensors").symlink_to(fp8 / "model.safetensors")
    result = cli("convert", source, "--tp", 1, "--dtype", "bfloat16", "-o", tmp_path / "out")
    assert result.exit_code == 2 and said in result.output
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]
