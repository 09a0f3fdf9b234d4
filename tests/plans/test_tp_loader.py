"""reshard's rank files against what transformers' own TP loader puts on each rank.

One ``torchrun --nproc-per-node 4`` (gloo, CPU) loads every family's tiny model with
``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` and writes each rank's tensors
(``tests/oracles/tp_loader_worker.py``). Then, per family:

* the built-in plan's rank slices equal the loader's, except where transformers splits a layer otherwise; each
  such difference is listed in ``DIFFERENCES`` (and in docs/plans.md) with what transformers holds, and the test
  checks the loader holds exactly that (an entry that no longer differs fails too);
* ``--plan transformers --uneven`` gives the loader's rank slices exactly, for every tensor;
* a checkpoint in transformers 5's in-memory form (fused ``experts.gate_up_proj`` / ``down_proj``) splits to the
  loader's fused local tensors;
* 14 query heads (a Qwen2, a Phi, an MLA model): tp 4 cuts a head and is refused by ``--plan transformers``,
  ``--uneven`` gives the loader's rank slices; at tp 2 (a second ``torchrun``, 2 ranks) the plain conversion
  gives them;
* checkpoint names transformers renames on load (GPT-NeoX's ``embed_out``, A.X-K2's ``q_b_proj``, HY-V4's sinks
  and gate) and per-head tensors beside the query (output gates, their bias, a per-head scalar gate, attention
  sinks, a layer with heads of its own) split as the loader holds them under ``--plan transformers``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.families import PLAN_NAMES, SPECS, UNEVEN_HEADS, build
from fixtures.hf import load_folder
from safetensors.torch import load_file, save_file

TP = 4
WORKER = Path(__file__).resolve().parents[1] / "oracles" / "tp_loader_worker.py"
MOE = ("deepseek_v2", "deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe")
VISION_SPLIT = r"visual\.blocks\.\d+\.(attn\.(qkv|proj)\.|mlp\.(gate_proj|up_proj|down_proj|linear_fc1|linear_fc2)\.)"

# family -> (tensor pattern, what transformers' rank holds: "whole" or "rows", a contiguous chunk of dim 0, and why)
DIFFERENCES: dict[str, list[tuple[str, str, str]]] = {
    "deepseek_v3": [
        (r"self_attn\.(q_b_proj|kv_b_proj|o_proj)\.weight$", "whole", "its deepseek_v3 plan leaves attention whole"),
    ],
    "qwen2_moe": [(r"mlp\.shared_expert\.(gate|up|down)_proj\.", "whole", "its plan does not name the shared expert")],
    "phi3": [
        (r"(qkv_proj|gate_up_proj)\.weight$", "rows", "colwise_gather_output: storage rows, output gathered"),
    ],
    "glm4": [(r"gate_up_proj\.weight$", "rows", "colwise_gather_output: storage rows, output gathered")],
    "qwen2_5_vl": [(VISION_SPLIT, "whole", "the vision tower is in no plan")],
    "qwen3_5": [
        (r"linear_attn\.(in_proj_qkv|out_proj)\.weight$", "rows", "colwise_gather_output: storage rows"),
        (r"linear_attn\.(conv1d\.weight|A_log|dt_bias)$", "whole", "computed whole after the gather"),
        (VISION_SPLIT, "whole", "the vision tower is in no plan"),
    ],
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Every family saved as save_pretrained writes it (and the MoE ones also in the in-memory form), loaded
    by transformers' TP loader on 4 ranks."""
    import transformers

    root = tmp_path_factory.mktemp("tp_loader")
    specs = []
    for family, (_, _, model_class) in (SPECS | UNEVEN_HEADS | PLAN_NAMES).items():
        model = build(family, root / family)
        specs.append(f"{root / family}={model_class}")
        if family in MOE:
            memory = root / f"{family}-memory"
            memory.mkdir()
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, memory / "model.safetensors")
            (memory / "config.json").write_text((root / family / "config.json").read_text())
    _run_loader(TP, root / "loaded", specs)
    assert transformers.__version__  # the loader under test is the installed one
    return root


def _run_loader(tp: int, out: Path, specs: list[str]) -> None:
    env = os.environ | {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", str(WORKER)]
    done = subprocess.run([*command, str(out), *specs], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def loaded_tp2(loaded):
    """The models of 14 query heads loaded by transformers' TP loader on 2 ranks (under ``loaded2``)."""
    _run_loader(
        2, loaded / "loaded2", [f"{loaded / f}={model_class}" for f, (_, _, model_class) in UNEVEN_HEADS.items()]
    )
    return loaded


def _convert(cli, source: Path, out: Path, *extra, tp: int = TP) -> list[dict[str, torch.Tensor]]:
    result = cli("convert", source, "--tp", tp, "-o", out, "-q", *extra)
    assert result.exit_code == 0, result.output
    return [load_file(out / f"rank_{r:02d}" / "model.safetensors") for r in range(tp)]


def _loader_ranks(loaded: Path, family: str, prefix: str = "", tp: int = TP) -> list[dict[str, torch.Tensor]]:
    folder = loaded / ("loaded" if tp == TP else f"loaded{tp}") / family
    return [load_file(folder / f"{prefix}rank_{r:02d}.safetensors") for r in range(tp)]


def _without_tied_head(theirs: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loader's state dict holds a tied ``lm_head`` that save_pretrained does not write: it is the embedding."""
    extra = set(theirs) - set(mine)
    assert extra <= {"lm_head.weight"}, extra
    if extra:
        embedding = next(k for k in theirs if k.endswith("embed_tokens.weight"))
        assert torch.equal(theirs["lm_head.weight"], theirs[embedding])
    return {k: v for k, v in theirs.items() if k in mine}


@pytest.mark.parametrize("family", sorted(SPECS))
def test_builtin_plan_equals_the_loader_but_for_documented_differences(loaded, cli, tmp_path, family):
    full = load_folder(loaded / family)
    mine = _convert(cli, loaded / family, tmp_path / "builtin")
    theirs = _loader_ranks(loaded, family)
    used = set()
    for rank in range(TP):
        theirs_rank = _without_tied_head(theirs[rank], mine[rank])
        assert theirs_rank.keys() == mine[rank].keys()
        for name, tensor in mine[rank].items():
            if torch.equal(tensor, theirs_rank[name]):
                continue
            documented = [(p, form) for p, form, _ in DIFFERENCES.get(family, []) if re.search(p, name)]
            assert documented, f"{name} rank {rank}: reshard and transformers' loader differ, undocumented"
            pattern, form = documented[0]
            used.add(pattern)
            expected = full[name] if form == "whole" else full[name].chunk(TP, 0)[rank]
            assert torch.equal(theirs_rank[name], expected), f"{name}: the loader does not hold it {form}"
    assert used == {p for p, _, _ in DIFFERENCES.get(family, [])}, "a documented difference no longer differs"


@pytest.mark.parametrize("family", sorted(SPECS))
def test_plan_transformers_equals_the_loader_exactly(loaded, cli, tmp_path, family):
    mine = _convert(cli, loaded / family, tmp_path / "hf-plan", "--plan", "transformers", "--uneven")
    for rank, theirs in enumerate(_loader_ranks(loaded, family)):
        theirs = _without_tied_head(theirs, mine[rank])
        assert theirs.keys() == mine[rank].keys()
        assert [n for n in mine[rank] if not torch.equal(mine[rank][n], theirs[n])] == [], rank


@pytest.mark.parametrize("family", MOE)
def test_fused_in_memory_experts_split_as_the_loader_holds_them(loaded, cli, tmp_path, family):
    mine = _convert(cli, loaded / f"{family}-memory", tmp_path / "memory")
    assert any(name.endswith("experts.gate_up_proj") for name in mine[0])
    for rank, theirs in enumerate(_loader_ranks(loaded, family, "memory_")):
        for name in (n for n in mine[rank] if ".experts." in n or n.endswith(".gate.weight")):
            assert torch.equal(mine[rank][name], theirs[name]), (name, rank)


def _equal_to_the_loader(mine: list[dict[str, torch.Tensor]], theirs: list[dict[str, torch.Tensor]]) -> None:
    for rank, (own, held) in enumerate(zip(mine, theirs, strict=True)):
        assert held.keys() == own.keys()
        assert [n for n in own if not torch.equal(own[n], held[n])] == [], rank


@pytest.mark.parametrize("family", sorted(UNEVEN_HEADS))
def test_query_heads_that_tp_does_not_divide_are_refused_and_uneven_gives_the_loaders_rows(
    loaded, cli, tmp_path, family
):
    """14 heads at tp 4 (3.5 a rank): before, q/o (and MLA's q_b_proj, kv_b_proj) were cut in rows with exit 0."""
    refused = cli("convert", loaded / family, "--tp", TP, "--plan", "transformers", "-o", tmp_path / "o")
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip()
    assert "\n" not in line and "num_attention_heads=14" in line and "tp sizes that work: 1, 2" in line
    cut = r"self_attn\.(q_proj|o_proj|dense|q_b_proj|kv_b_proj)\.weight: heads\(dim=-[12], heads=14\)"
    assert re.search(cut + r".* holds 14 heads, which tp=4 does not divide: a head would be cut", line), line
    assert not (tmp_path / "o").exists()
    mine = _convert(cli, loaded / family, tmp_path / "uneven", "--plan", "transformers", "--uneven")
    _equal_to_the_loader(mine, _loader_ranks(loaded, family))


@pytest.mark.parametrize("family", sorted(UNEVEN_HEADS))
def test_query_heads_split_whole_at_a_tp_that_divides_them_as_the_loader_holds_them(loaded_tp2, cli, tmp_path, family):
    """At tp 2, 7 whole heads a rank, whatever their width: MLA's o_proj holds 6 columns a head, not head_dim's."""
    mine = _convert(cli, loaded_tp2 / family, tmp_path / "tp2", "--plan", "transformers", tp=2)
    _equal_to_the_loader(mine, _loader_ranks(loaded_tp2, family, tp=2))
    output = "model.layers.0.self_attn." + ("dense" if family.startswith("phi") else "o_proj") + ".weight"
    recorded = json.loads((tmp_path / "tp2" / "reshard.json").read_text())["tensors"][output]
    assert recorded["partition"] == {"kind": "shard", "dim": -1, "unit": 6 if "glm4" in family else 8}


@pytest.mark.parametrize("family", sorted(PLAN_NAMES))
def test_plan_transformers_matches_the_names_tensors_load_as_and_per_head_tensors(loaded, cli, tmp_path, family):
    """Before: GPT-NeoX's ``embed_out`` and A.X-K2's ``q_b_proj`` were kept whole where the loader splits the
    ``lm_head`` / ``q_gate_proj`` they load as; Beam's ``gate_bias`` and Granite-SWA's ``sinks`` were refused; HY-V4's
    ``learnable_sink_param`` and ``linear_gate`` (its ``sinks`` and ``gate_proj``) were kept whole. dots3's ``g_proj``
    was cut in rows, as the loader; now in heads, its sliding-window layer's in its own 4 (the config says 8)."""
    mine = _convert(cli, loaded / family, tmp_path / "plan", "--plan", "transformers")
    _equal_to_the_loader(mine, _loader_ranks(loaded, family))
    assert all(name in load_folder(loaded / family) for name in mine[0])  # the checkpoint's own names
