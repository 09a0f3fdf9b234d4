"""``reshard.layouts.dcp.nemo``: every field of NeMo 2's ``model.yaml`` config reaches the closed table of
Megatron's arguments under Megatron-LM's name, or is declared irrelevant (no checkpoint needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.errors import CorruptFileError, ReshardError
from reshard.layouts.dcp.nemo import LISTS, SINGLE, nemo_args
from reshard.megatron.args import CARRIED, args_problems

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
        ("  mrope_section: [16, 24, 24]\n", "mrope_section=[16, 24, 24]"),
    ],
)
def test_refused_by_the_table(tmp_path: Path, lines: str, problem: str) -> None:
    assert any(p.startswith(problem) for p in args_problems(read(tmp_path, lines))), problem


def test_structured_values(tmp_path: Path) -> None:
    """A small structure passes to the table (ignored when irrelevant, printed when refused); a field read as one
    value holding a structure, or a structure no config holds (an alias bomb), is refused by name."""
    bomb = "optim:\n  l0: &l0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10)
    )
    model_yaml = tmp_path / "context" / "model.yaml"
    model_yaml.parent.mkdir()
    model_yaml.write_text(BASE + "  init_method: {_target_: torch.nn.init.normal_, _partial_: true, std: 0.02}\n")
    assert args_problems(nemo_args(tmp_path)) == []
    model_yaml.write_text(BASE + "  rope_parameters: {factor: 2}\n")
    (problem,) = args_problems(nemo_args(tmp_path))
    assert problem.startswith("rope_parameters={'factor': 2} (an argument reshard does not know")
    for text, field, message in [
        (BASE + "  hidden_size: [64]\n", "hidden_size", "not a single value"),
        (bomb + BASE + "  unknown_field: *l9\n", "unknown_field", "larger or deeper"),
        (bomb + BASE + "  init_method: *l9\n", "init_method", "larger or deeper"),
    ]:
        model_yaml.write_text(text)
        with pytest.raises(CorruptFileError, match=message) as err:
            nemo_args(tmp_path)
        assert f"config.{field}" in str(err.value) and len(str(err.value)) < 400


def test_every_carried_argument_is_read_as_one_value() -> None:
    """nemo.SINGLE follows the table: a carried argument is a number, a flag or a name (moe_layer_freq a list)."""
    assert set(CARRIED) - LISTS <= SINGLE


TOP = """\
_target_: nemo.collections.llm.gpt.model.llama.LlamaModel
tokenizer:
  _target_: nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer
optim:
  _target_: nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule
model_transform: null
model_context_managers: []
"""
LORA = """\
model_transform:
  _target_: nemo.collections.llm.peft.lora.LoRA
  dim: 32
"""


def top_level(tmp_path: Path, lines: str) -> object:
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "model.yaml").write_text(lines + BASE)
    return nemo_args(tmp_path)


def test_top_level_keys_of_the_model_are_known(tmp_path: Path) -> None:
    """The model class's other constructor arguments: the optimizer and tokenizer pass, an unset transform too."""
    assert top_level(tmp_path, TOP).hidden_size == 64


@pytest.mark.parametrize(
    ("lines", "named"),
    [
        (TOP.replace("model_transform: null\n", LORA), "model_transform='nemo.collections.llm.peft.lora.LoRA'"),
        (TOP.replace("[]", "[torch.no_grad]"), "model_context_managers=['torch.no_grad']"),
        (TOP + "adapter_config: {dim: 8}\n", "unknown top-level key 'adapter_config'"),
    ],
    ids=["peft", "context-managers", "unknown"],
)
def test_top_level_keys_that_change_the_model_are_refused(tmp_path: Path, lines: str, named: str) -> None:
    with pytest.raises(ReshardError) as refused:
        top_level(tmp_path, lines)
    assert named in str(refused.value) and "model.yaml" in str(refused.value)


def test_a_peft_adapter_checkpoint_is_refused(cli, tmp_path: Path) -> None:
    """NeMo's PEFT checkpoint IO saves the adapters alone, with ``adapter_metadata.json`` naming the base model."""
    weights = tmp_path / "ckpt" / "weights"
    weights.mkdir(parents=True)
    (weights / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (weights / ".metadata").write_bytes(b"")
    (weights / "adapter_metadata.json").write_text('{"model_ckpt_path": "/base/weights"}')
    result = cli("convert", tmp_path / "ckpt", "--tp", 1, "--layout", "hf", "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "a NeMo PEFT checkpoint (adapter_metadata.json)" in result.output and not (tmp_path / "out").exists()
