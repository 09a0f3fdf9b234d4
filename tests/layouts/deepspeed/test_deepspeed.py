"""The ``deepspeed`` layout on ZeRO checkpoints DeepSpeed 0.19.8 itself wrote (``fixtures/deepspeed_writer``, world
3, two parameter groups, tied embeddings): reshard's fp32 master equals DeepSpeed's own ``zero_to_fp32`` bit for bit,
converts to a folder transformers loads, and on to other tps."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from fixtures.deepspeed import VARIANTS
from fixtures.deepspeed import expected as saved
from fixtures.hf import load_folder
from fixtures.models import logits
from safetensors.torch import load_file

from reshard.layouts import discover

TAG = "global_step2"


def expected(root, variant: str) -> dict[str, torch.Tensor]:
    """What DeepSpeed's ``zero_to_fp32`` script writes (``convert_zero_checkpoint_to_fp32_state_dict``: every float
    tensor as float32, so frozen 16-bit parameters too) from the state dict it rebuilds."""
    return {k: v.float() if v.is_floating_point() else v for k, v in saved(root, variant).items()}


def rebuilt(folder) -> dict[str, torch.Tensor]:
    source = discover(folder)
    assert source.layout == "deepspeed" and source.tp == 1
    return {name: ref.read() for name, ref in source.ranks[0].items()}


def assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_master_weights_equal_zero_to_fp32(ds_root, variant):
    want = expected(ds_root, variant)
    if variant.startswith("zero1"):  # ZeRO-1 records no frozen parameter: zero_to_fp32 drops it, reshard keeps it
        frozen = "model.norm.weight"
        assert frozen not in want
        want[frozen] = saved(ds_root, variant, "module")[frozen].float()
    assert_equal(rebuilt(ds_root / variant), want)
    assert_equal(rebuilt(ds_root / variant / TAG), want)  # the tag folder itself


@pytest.mark.parametrize("variant", ["zero2_fp16", "zero3_fp16"])
def test_fp16_checkpoints_carry_the_dynamic_loss_scaler(ds_root, variant):
    """The fp16 variants are real mixed-precision checkpoints: every optimizer file pickles DeepSpeed's
    ``DynamicLossScaler`` (read as a stand-in), their names have no ``bf16_`` prefix, and the loss scale let the
    steps through (the masters moved)."""
    files = sorted((ds_root / variant / TAG).glob("*_optim_states.pt"))
    assert len(files) == 3 and not any(f.name.startswith("bf16_") for f in files)
    for file in files:
        with zipfile.ZipFile(file) as archive:
            pickled = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            assert b"DynamicLossScaler" in archive.read(pickled), file.name
    initial, trained = load_folder(ds_root / "hf_source"), expected(ds_root, variant)
    assert not torch.equal(trained["model.layers.1.mlp.up_proj.weight"], initial["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("variant", ["zero2_bf16", "zero3_bf16"])
def test_converted_folder_loads_in_transformers_with_the_master_weights(ds_root, variant, tmp_path, cli):
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    result = cli("convert", ds_root / variant, "--tp", 1, "--layout", "hf", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    want = expected(ds_root, variant)
    assert_equal(load_folder(out), want)
    converted, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    reference = LlamaForCausalLM.from_pretrained(ds_root / "hf_source").eval()
    reference.load_state_dict(want)
    vocab = reference.config.vocab_size
    assert torch.equal(logits(converted.eval(), vocab), logits(reference, vocab))


def test_zero3_converts_on_to_hf_ranks(ds_root, tmp_path, cli):
    out = tmp_path / "ranks"
    result = cli("convert", ds_root / "zero3_bf16" / TAG, "--tp", 2, "--layout", "hf-ranks", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    want = expected(ds_root, "zero3_bf16")
    rank1 = load_file(out / "rank_01" / "model.safetensors")
    q = want["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(rank1["model.layers.1.self_attn.q_proj.weight"], q.chunk(2)[1])
    down = want["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(rank1["model.layers.0.mlp.down_proj.weight"], down.chunk(2, dim=1)[1])


def test_module_copy_on_request(ds_root, tmp_path, cli):
    out = tmp_path / "module"
    result = cli("convert", ds_root / "zero2_bf16", "--tp", 1, "--weights", "module", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    module, written = saved(ds_root, "zero2_bf16", "module"), load_folder(out)
    assert set(written) <= set(module) and set(module) - set(written) <= {"lm_head.weight"}  # tied: one copy
    assert all(tensor.dtype == torch.bfloat16 and torch.equal(tensor, module[n]) for n, tensor in written.items())
    refused = cli("convert", ds_root / "zero3_bf16", "--tp", 1, "--weights", "module", "-o", tmp_path / "z3", "-q")
    assert refused.exit_code == 2 and "ZeRO-3 keeps no module copy" in refused.output


def test_inspect_names_the_stage_and_the_skipped_moments(ds_root, cli):
    result = cli("inspect", ds_root / "zero3_bf16", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layout"] == "deepspeed" and report["tp"] == 1
    notes = " | ".join(report["notes"])
    assert "ZeRO-3 over 3 data-parallel ranks" in notes
    assert "optimizer state beside the weights: exp_avg, exp_avg_sq" in notes
    assert "lm_head.weight = model.embed_tokens.weight" in notes
    assert len(report["tensors"]) == 21  # the model, not ZeRO-3's zero-size placeholders
    assert all(0 not in shape for tensor in report["tensors"] for shape in tensor["rank_shapes"])


@pytest.mark.parametrize("variant", ["zero2_bf16", "zero2_fp32"])
def test_zero2_is_not_taken_for_sat(ds_root, variant):
    assert discover(ds_root / variant).layout == "deepspeed"
    assert discover(ds_root / variant / TAG).layout == "deepspeed"


@pytest.mark.parametrize("variant", ["zero2_bf16", "zero3_bf16"])
def test_universal_checkpoint_gives_the_same_master_weights(ds_root, ds_copy, variant, tmp_path, cli):
    want = expected(ds_root, variant)
    assert_equal(rebuilt(ds_root / variant / f"{TAG}_universal"), want)
    folder = ds_copy(variant)
    (folder / "latest").unlink()  # the root then names only the universal folder (latest_universal)
    result = cli("convert", folder, "--tp", 1, "--layout", "hf", "-o", tmp_path / "hf", "-q")
    assert result.exit_code == 0, result.output
    assert_equal(load_folder(tmp_path / "hf"), want)


@pytest.mark.parametrize("variant", ["zero2_bf16", "zero3_bf16"])
def test_a_parameter_says_where_its_first_piece_starts(ds_root, variant):
    """The engine puts a tensor's buffer on its first byte's 4 KB phase (read in place, no staging copy): that byte
    is the first of the fp32 master in an optimizer file."""
    source = discover(ds_root / variant)
    ref = source.ranks[0]["model.layers.0.mlp.down_proj.weight"]
    piece = ref.reader.pieces[ref.key][0]
    assert ref.position == piece.position and "optim_states" in piece.file.name
    with piece.file.open("rb") as file:
        file.seek(ref.position)
        first = torch.frombuffer(bytearray(file.read(4)), dtype=torch.float32)
    assert torch.equal(first, ref.read().reshape(-1)[:1])
