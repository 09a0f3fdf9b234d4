"""``reshard.layouts.dcp.nemo``: every field of NeMo 2's ``model.yaml`` config reaches the closed table of
Megatron's arguments under Megatron-LM's name, or is declared irrelevant (no checkpoint needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.errors import CorruptFileError
from reshard.layouts.dcp.nemo import nemo_args
from reshard.mappings.megatron_args import args_problems

BASE = """\
config:
  _target_: nemo.collections.llm.gpt.model.llama.Llama31Config
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 8
  gated_linear_unit: true
  activation_func: torch.nn.functional.silu
"""


def read(tmp_path: Path, lines: str = "") -> object:
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "model.yaml").write_text(BASE + lines)
    return nemo_args(tmp_path)


def test_renamed_and_translated(tmp_path: Path) -> None:
    args = read(tmp_path, "  num_moe_experts: 4\n  seq_len_interpolation_factor: 4\n  layernorm_epsilon: 1.0e-6\n")
    assert (args.num_experts, args.rotary_seq_len_interpolation_factor, args.norm_epsilon) == (4, 4, 1e-6)
    assert args.swiglu is True and args.untie_embeddings_and_output_weights is False
    assert not hasattr(args, "_target_") and args_problems(args) == []


def test_llama31_rope_scaling_is_carried(tmp_path: Path) -> None:
    lines = "  scale_factor: 8.0\n  low_freq_factor: 1.0\n  high_freq_factor: 4.0\n  old_context_len: 8192\n"
    args = read(tmp_path, lines)
    assert args.use_rope_scaling is True and args.rope_scaling_factor == 8.0 and args_problems(args) == []


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        ("  scale_factor: 32.0\n  old_context_len: 4096\n", "old_context_len=4096"),
        ("  moe_router_num_groups: 2\n  moe_router_group_topk: 1\n", "moe_router_num_groups=2"),
        ("  moe_router_topk_scaling_factor: 2.5\n", "moe_router_topk_scaling_factor=2.5"),
        ("  rope_scaling: true\n", "rope_scaling=True (an argument reshard does not know"),
        ("  window_size: [128, 0]\n", "window_size=[128, 0]"),
    ],
)
def test_refused_by_the_table(tmp_path: Path, lines: str, problem: str) -> None:
    assert any(p.startswith(problem) for p in args_problems(read(tmp_path, lines))), problem


def test_irrelevant_values_are_not_read_and_others_are_single(tmp_path: Path) -> None:
    bomb = "bomb: &b [[x, x], [x, x]]\n"
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "model.yaml").write_text(bomb + BASE + "  init_method: *b\n  hidden_dropout: *b\n")
    assert args_problems(nemo_args(tmp_path)) == []
    (tmp_path / "context" / "model.yaml").write_text(bomb + BASE + "  unknown_field: *b\n")
    with pytest.raises(CorruptFileError, match="not a single value") as err:
        nemo_args(tmp_path)
    assert "config.unknown_field" in str(err.value)
