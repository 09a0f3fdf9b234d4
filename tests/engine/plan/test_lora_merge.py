"""``reshard.engine.plan.lora_merge``: ``--merge-lora`` folds each adapter into its base weight rank by rank, exactly,
for SAT's lora2 (one A/B pair per packed part, B divergent across ranks of a row-parallel layer) and for peft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.hf import load_folder, peft_llama_state, write_hf
from fixtures.megatron import TINY, full_model, megatron_importable, write_megatron
from fixtures.sat import RANK, full_tensors, layout, read_sat, sat_config, split_rank, tp_kind, write_sat
from fixtures.shapes import PEFT_LLAMA
from fixtures.tp import gather_pieces, small_ints

from reshard import ConvertOptions, ReadOptions, convert
from reshard.errors import DivergentReplicaError, PlanError

CFG = sat_config()  # hidden 32, 16 heads of 2 in 8 KV groups, one layer, tp 8


def merged_expected(cfg: dict, full: dict, ranks: list[dict], alpha: float = 1.0) -> dict[str, torch.Tensor]:
    """Per source rank W_r + alpha/r * cat_i(B_i A_i) in float32, cast back, then gathered by the base's rule."""
    kinds = layout(cfg)
    merged: dict[str, torch.Tensor] = {}
    for name, (_, kind) in kinds.items():
        if ".matrix_" in name:
            continue
        if ".original." not in name:
            merged[name] = full[name]
            continue
        layer, param = name.split(".original.")
        plain = f"{layer}.{param}"
        per_rank = []
        for sd in ranks:
            w = sd[name]
            if param == "weight":
                parts = 1 if kind[0] != "packed" else len(kind[1])
                pairs = [(sd[f"{layer}.matrix_B.{i}"], sd[f"{layer}.matrix_A.{i}"]) for i in range(parts)]
                delta = torch.cat([b.float() @ a.float() for b, a in pairs])
                w = (w.float() + alpha / RANK * delta).to(w.dtype)
            per_rank.append(w)
        merged[plain] = gather_pieces(per_rank, tp_kind(kind))
    return merged


def test_divergent_row_lora_b_is_refused_without_merge(tmp_path: Path, cli) -> None:
    write_sat(tmp_path / "src", CFG, full_tensors(CFG), 8, divergent_b=True)
    out = tmp_path / "out"
    result = cli("convert", tmp_path / "src", "--tp", 4, "--layout", "sat", "-o", out)
    assert result.exit_code == 2
    assert "--merge-lora" in result.stderr
    assert "transformer.layers.0.attention.dense.matrix_B.0" in result.stderr
    assert "mp_rank_01_model_states.pt" in result.stderr
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    with pytest.raises(PlanError) as err:
        convert(tmp_path / "src", out, ConvertOptions(tp=4, layout="sat", progress=False))
    assert all(isinstance(p, DivergentReplicaError) for p in err.value.problems)
    assert len(err.value.problems) == 3  # attention.dense, cross_attention.dense, EVA attention.dense


@pytest.mark.parametrize(
    ("tp", "dtype"), [(4, torch.float32), (1, torch.float32), (4, torch.bfloat16)], ids=["tp4", "tp1", "tp4-bf16"]
)
def test_merge_lora_is_exact(tmp_path: Path, cli, tp: int, dtype: torch.dtype) -> None:
    full = full_tensors(CFG, dtype)
    ranks = write_sat(tmp_path / "src", CFG, full, 8, divergent_b=True)
    out = tmp_path / "merged"
    result = cli("convert", tmp_path / "src", "--tp", tp, "--layout", "sat", "--merge-lora", "-o", out)
    assert result.exit_code == 0, result.output
    assert "merged 7 LoRA adapters" in result.stdout
    want = merged_expected(CFG, full, ranks)
    kinds = layout(CFG)
    _, files = read_sat(out)
    for rank, obj in enumerate(files):
        sd = obj["module"]
        assert not any(".original." in n or ".matrix_" in n for n in sd)
        assert set(sd) == set(want)
        for name, tensor in sd.items():
            source_name = (
                name
                if name in kinds
                else name.replace(".weight", ".original.weight").replace(".bias", ".original.bias")
            )
            kind = kinds[source_name][1]
            assert torch.equal(tensor, split_rank(want[name], kind, tp, rank)), (name, rank)


def test_lora_alpha_scales_the_merge(tmp_path: Path) -> None:
    full = full_tensors(CFG)
    ranks = write_sat(tmp_path / "src", CFG, full, 8)
    options = ConvertOptions(tp=1, layout="sat", read=ReadOptions(merge_lora=True, lora_alpha=4.0), progress=False)
    convert(tmp_path / "src", tmp_path / "m", options)
    _, files = read_sat(tmp_path / "m")
    want = merged_expected(CFG, full, ranks, alpha=4.0)
    for name in ("transformer.layers.0.cross_attention.query.weight", "transformer.layers.0.attention.dense.weight"):
        assert torch.equal(files[0]["module"][name], want[name])
        assert not torch.equal(want[name], merged_expected(CFG, full, ranks)[name])


def test_lora_alpha_needs_merge_lora(tmp_path: Path, cli) -> None:
    write_sat(tmp_path / "src", CFG, full_tensors(CFG), 8)
    result = cli("convert", tmp_path / "src", "--tp", 4, "--lora-alpha", 2, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "--merge-lora" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture
def peft_full(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A peft LoRA-wrapped Llama saved as one HF folder: the folder and its tensors."""
    state = peft_llama_state(PEFT_LLAMA)
    return write_hf(tmp_path / "full", PEFT_LLAMA, state), state


def test_peft_merge_writes_plain_weights(peft_full, tmp_path: Path) -> None:
    folder, full = peft_full
    convert(folder, tmp_path / "tp2", ConvertOptions(tp=2, layout="hf-ranks", progress=False))
    options = ConvertOptions(tp=1, layout="hf", read=ReadOptions(merge_lora=True, lora_alpha=8.0), progress=False)
    convert(tmp_path / "tp2", tmp_path / "merged", options)
    merged = load_folder(tmp_path / "merged")
    assert not any("lora_" in n or "base_layer" in n or n.startswith("base_model.") for n in merged)
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    a, b = full[p + "lora_A.default.weight"], full[p + "lora_B.default.weight"]
    want = full[p + "base_layer.weight"] + 8.0 / 4 * (b @ a)
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], want)  # PEFT's prefix gone


def test_merge_without_base_weight_is_refused(tmp_path: Path, cli) -> None:
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    adapter = {p + "lora_A.weight": small_ints((4, 32), 0), p + "lora_B.weight": small_ints((32, 4), 1)}
    folder = write_hf(tmp_path / "adapter", PEFT_LLAMA, adapter)
    result = cli("convert", folder, "--tp", 1, "--merge-lora", "--lora-alpha", 8, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "without its base weight" in result.stderr and p + "lora_" in result.stderr
    assert not (tmp_path / "out").exists()


def test_merge_with_unpaired_parts_is_refused(peft_full, tmp_path: Path, cli) -> None:
    folder, full = peft_full
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    state = {n: t for n, t in full.items() if n != p + "lora_B.default.weight"}
    broken = write_hf(tmp_path / "broken", PEFT_LLAMA, state)
    result = cli("convert", broken, "--tp", 2, "--merge-lora", "--lora-alpha", 8, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "1 A and 0 B tensors do not pair up" in result.stderr and p.rstrip(".") in result.stderr
    assert not (tmp_path / "out").exists()


def _megatron_with_peft_lora(root: Path) -> tuple[Path, Path]:
    """A Megatron checkpoint at tp 2 whose linear_qkv (column-parallel, fused and grouped) and linear_proj
    (row-parallel) carry peft LoRA as ``LoraParallelLinear`` places it (column: A whole, B the rank's rows; row:
    A the rank's columns, B whole), and the same checkpoint merged by hand on every rank (``W_r + B_r A_r * 16/4``)."""
    full = full_model(TINY, seed=0)
    lora, merged = write_megatron(root / "lora", full, 2), write_megatron(root / "merged", full, 2)
    files = sorted(lora.rglob("model_optim_rng.pt"))
    with megatron_importable():  # the args pickle Megatron's enums
        objs = [torch.load(f, weights_only=False) for f in files]
        hand = [torch.load(str(f).replace("/lora/", "/merged/"), weights_only=False) for f in files]
    for key in [k for k in objs[0]["model"] if k.endswith(("linear_qkv.weight", "linear_proj.weight"))]:
        column = "linear_qkv" in key
        rows, cols = objs[0]["model"][key].shape
        a_whole, b_whole = small_ints((4, cols), 1), small_ints((rows, 4), 2)
        for rank, (obj, plain) in enumerate(zip(objs, hand, strict=True)):
            w = obj["model"].pop(key)
            a = a_whole if column else small_ints((4, cols), 10 + rank)
            b = small_ints((rows, 4), 20 + rank) if column else b_whole
            stem = key.removesuffix(".weight")
            obj["model"] |= {stem + ".base_layer.weight": w, stem + ".lora_A.default.weight": a}
            obj["model"][stem + ".lora_B.default.weight"] = b
            plain["model"][key] = (w.float() + (b.float() @ a.float()) * (16 / 4)).to(w.dtype)
    with megatron_importable():
        for file, obj, plain in zip(files, objs, hand, strict=True):
            torch.save(obj, file)
            torch.save(plain, str(file).replace("/lora/", "/merged/"))
    return lora, merged


def test_megatron_peft_lora_merges_per_rank(tmp_path: Path, cli) -> None:
    lora, merged = _megatron_with_peft_lora(tmp_path)
    args = ("--tp", 1, "--layout", "hf", "--vocab", 50)
    result = cli("convert", lora, *args, "--merge-lora", "--lora-alpha", 16, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert cli("convert", merged, *args, "-o", tmp_path / "want").exit_code == 0
    got, want = load_folder(tmp_path / "out"), load_folder(tmp_path / "want")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # unmerged, the LoRA tensors reshard with their layers (A and B of the grouped QKV too): merged at tp 4, the
    # same model (small integers: every product exact, whatever the slices)
    assert cli("convert", lora, "--tp", 4, "-o", tmp_path / "tp4").exit_code == 0
    result = cli("convert", tmp_path / "tp4", *args, "--merge-lora", "--lora-alpha", 16, "-o", tmp_path / "out4")
    assert result.exit_code == 0, result.output
    got = load_folder(tmp_path / "out4")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_megatron_peft_lora_has_no_adapter_folder(tmp_path: Path, cli) -> None:
    lora, _ = _megatron_with_peft_lora(tmp_path)
    result = cli("convert", lora, "--tp", 1, "--layout", "peft", "--lora-alpha", 16, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "one A shared by q, k and v" in result.stderr and "--merge-lora" in result.stderr
    assert not (tmp_path / "out").exists()


def test_sat_lora_has_no_peft_folder_and_flags_are_checked(tmp_path: Path, cli) -> None:
    write_sat(tmp_path / "src", CFG, full_tensors(CFG), 8)
    out = tmp_path / "out"
    result = cli("convert", tmp_path / "src", "--tp", 1, "--layout", "peft", "-o", out)
    assert result.exit_code == 2 and "holds no peft LoRA adapter" in result.stderr and "--merge-lora" in result.stderr
    for flags, said in (
        (["--layout", "peft", "--merge-lora"], "--layout peft writes the adapter alone"),
        (["--base-model", "org/base"], "--base-model only applies with --layout peft"),
        (["--adapter", "default"], "--adapter only applies with --merge-lora or --layout peft"),
        (["--adapter", "default", "--merge-lora"], "--adapter 'default', but it holds no peft LoRA adapter"),
    ):
        result = cli("convert", tmp_path / "src", "--tp", 1, *flags, "-o", out)
        assert result.exit_code == 2 and said in result.stderr, (flags, result.stderr)
    assert not out.exists()
