"""``reshard.layouts.dcp.torch_dist``: Megatron-Core's ``dist_checkpointing`` files (and NeMo 2's ``weights/``) read
as per-layer tensors, checked against the same model's legacy files, which Megatron-Core wrote from the same
weights, and against the logits Megatron-Core computed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from oracles.variants import Spec

pytestmark = pytest.mark.oracle

LLAMA, MOE = Spec("llama", tp=2), Spec("moe-shared-gate", tp=2)


@pytest.mark.parametrize("spec", [LLAMA, MOE], ids=["llama", "moe"])
def test_the_same_tensors_as_the_legacy_files(cli, mcore_oracle, tmp_path: Path, spec: Spec) -> None:
    """Every layer (and expert) of the stacked global tensors is the tensor the legacy ranks gather into."""
    (ckpt,) = mcore_oracle.checkpoints(spec)
    result = cli("verify", ckpt.torch, ckpt.torch_dist, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(cli("inspect", ckpt.torch_dist, "--json").stdout)
    names = {t["name"]: t for t in report["tensors"]}
    layers = ckpt.variant.layers
    assert report["layout"] == "torch_dist" and report["tp"] == 1
    assert json.loads(result.stdout)["checks"][0]["tensors"] == len(names)
    qkv = names[f"decoder.layers.{layers - 1}.self_attention.linear_qkv.weight"]
    assert qkv["stored"].startswith(f"decoder.layers.self_attention.linear_qkv.weight[{layers - 1}] of [{layers}, ")
    assert qkv["partition"] == {"kind": "grouped", "dim": 0, "groups": 2}
    assert report["vocab"]["original"] == 1000 and report["vocab"]["padded_in_source"] == 1024
    assert any("skipped, not model weights" in n and "_extra_state" in n for n in report["notes"])
    if spec == MOE:
        expert = names["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
        assert expert["stored"].startswith("decoder.layers.mlp.experts.experts.linear_fc1.weight[1, 3] of [2, 4, ")


def test_re_sliced_to_hf_ranks_and_megatron(cli, mcore_oracle, tmp_path: Path) -> None:
    (ckpt,) = mcore_oracle.checkpoints(LLAMA)
    ranks = tmp_path / "ranks"
    assert (
        cli("convert", ckpt.torch_dist, "--tp", 4, "--layout", "hf-ranks", "--keep-names", "-o", ranks).exit_code == 0
    )
    result = cli("verify", ckpt.torch, ranks)
    assert result.exit_code == 0, result.output


NEMO_LLAMA = """\
  _target_: nemo.collections.llm.gpt.model.llama.LlamaConfig
  num_layers: 4
  hidden_size: 64
  ffn_hidden_size: 96
  num_attention_heads: 8
  num_query_groups: 2
  kv_channels: 8
  normalization: RMSNorm
  gated_linear_unit: true
  activation_func:
    _call_: false
    _target_: torch.nn.functional.silu
  add_bias_linear: false
  share_embeddings_and_output_weights: false
  position_embedding_type: rope
  rotary_base: 10000
  rotary_percent: 1.0
  seq_length: 64
  layernorm_epsilon: 1.0e-05
  make_vocab_size_divisible_by: 128
"""
# MOE above (Qwen2-MoE-like) as NeMo's Qwen2 / Mixtral configs write it: Megatron-Core's MoE field names.
NEMO_MOE = (
    NEMO_LLAMA.replace("LlamaConfig", "Qwen2Config").replace("num_layers: 4", "num_layers: 2")
    + """\
  add_qkv_bias: true
  num_moe_experts: 4
  moe_router_topk: 2
  moe_ffn_hidden_size: 32
  moe_shared_expert_intermediate_size: 48
  moe_shared_expert_gate: true
"""
)
# NeMo fields that do not change what the model computes: training, precision, kernels, parallelism, NeMo's own.
NEMO_IRRELEVANT = """\
  init_method_std: 0.02
  attention_dropout: 0.1
  hidden_dropout: 0.1
  bf16: true
  params_dtype:
    _call_: false
    _target_: torch.bfloat16
  fp16_lm_cross_entropy: false
  tensor_model_parallel_size: 2
  sequence_parallel: true
  tp_comm_overlap_cfg: null
  forward_step_fn:
    _call_: false
    _target_: nemo.collections.llm.gpt.model.base.gpt_forward_step
  transformer_layer_spec:
    _call_: false
    _target_: nemo.collections.llm.gpt.model.base.default_layer_spec
  generation_config: null
  use_transformer_engine_full_layer_spec: false
  moe_aux_loss_coeff: 0.01
"""


def nemo_checkpoint(ckpt: Path, out: Path, config: str = NEMO_LLAMA) -> Path:
    """A NeMo 2 checkpoint of the model: Megatron-Core's files under ``weights/`` and the model's config in
    ``context/model.yaml`` as NeMo's ``io_dump`` writes it (Megatron-Core TransformerConfig names under ``config``:
    the ``config`` lines given)."""
    iteration = next(p for p in (ckpt / "torch_dist").iterdir() if p.is_dir())
    shutil.copytree(iteration, out / "weights")
    (out / "context").mkdir()
    (out / "context" / "model.yaml").write_text(
        "_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\nconfig:\n"
        + config
        + """\
tokenizer:
  _target_: nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer
  pretrained_model_name: meta-llama/Llama-3.1-8B
optim:
  _target_: nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule
"""
    )
    (out / "weights" / "common.pt").unlink()  # the config comes from the context, not Megatron-LM's args
    return out


def test_nemo_2_to_transformers(cli, mcore_oracle, tmp_path: Path) -> None:
    """NeMo keeps the tokenizer, not the vocab size: --vocab says it; the logits are Megatron-Core's."""
    from transformers import AutoModelForCausalLM

    (ckpt,) = mcore_oracle.checkpoints(LLAMA)
    nemo = nemo_checkpoint(ckpt.root, tmp_path / "nemo")
    out = tmp_path / "hf"
    refused = cli("convert", nemo, "--tp", 1, "--layout", "hf", "-o", out)
    assert refused.exit_code == 2 and "pass --vocab N" in refused.output and not out.exists()
    result = cli("convert", nemo, "--tp", 1, "--layout", "hf", "--vocab", 1000, "-o", out)
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(ckpt.input_ids).logits
    torch.testing.assert_close(logits, ckpt.logits, rtol=0, atol=1e-5)


def test_another_sharded_backend_is_refused(cli, mcore_oracle, tmp_path: Path) -> None:
    (ckpt,) = mcore_oracle.checkpoints(LLAMA)
    copy = tmp_path / "zarr"
    shutil.copytree(ckpt.torch_dist, copy)
    (config,) = copy.glob("iter_*/metadata.json")
    config.write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    result = cli("inspect", copy)
    assert result.exit_code == 2 and "sharded backend 'zarr': only torch_dist is read" in result.output


def converted(cli, nemo: Path, out: Path):
    return cli("convert", nemo, "--tp", 1, "--layout", "hf", "--vocab", 1000, "-o", out)


def test_nemo_irrelevant_fields_convert_as_before(cli, mcore_oracle, tmp_path: Path) -> None:
    """NeMo's training, precision, parallelism and bookkeeping fields pass the table: the same bytes are written."""
    (ckpt,) = mcore_oracle.checkpoints(LLAMA)
    plain, busy = tmp_path / "plain", tmp_path / "busy"
    assert converted(cli, nemo_checkpoint(ckpt.root, tmp_path / "a"), plain).exit_code == 0
    result = converted(cli, nemo_checkpoint(ckpt.root, tmp_path / "b", NEMO_LLAMA + NEMO_IRRELEVANT), busy)
    assert result.exit_code == 0, result.output
    for name in ("config.json", "model.safetensors"):
        assert (busy / name).read_bytes() == (plain / name).read_bytes(), name


def test_nemo_moe_to_transformers_and_scaled_top_k_refused(cli, mcore_oracle, tmp_path: Path) -> None:
    """NeMo's MoE names reach the table: the MoE converts to Megatron-Core's logits; a top-k scaling factor,
    which transformers' Qwen2-MoE does not compute, is refused by name and value before anything is written."""
    from transformers import AutoModelForCausalLM

    (ckpt,) = mcore_oracle.checkpoints(MOE)
    out = tmp_path / "hf"
    result = converted(cli, nemo_checkpoint(ckpt.root, tmp_path / "moe", NEMO_MOE), out)
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        torch.testing.assert_close(model(ckpt.input_ids).logits, ckpt.logits, rtol=0, atol=1e-5)
    scaled = nemo_checkpoint(ckpt.root, tmp_path / "scaled", NEMO_MOE + "  moe_router_topk_scaling_factor: 2.5\n")
    refused = converted(cli, scaled, tmp_path / "refused")
    assert refused.exit_code == 2, refused.output
    assert "moe_router_topk_scaling_factor=2.5" in refused.output and not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("  attention_logit_softcapping: 30.0\n", "attention_logit_softcapping=30.0"),  # unknown: Gemma 2's
        ("  seq_len_interpolation_factor: 4\n", None),  # carried (linear RoPE): converts
        ("  transformer_layer_spec: my.own.spec\n", "spec='my.own.spec'"),
        ("  scale_factor: 8.0\n  low_freq_factor: 2.0\n", "low_freq_factor=2.0"),
    ],
    ids=["unknown", "interpolation", "custom-spec", "llama3-rope-other"],
)
def test_nemo_fields_meet_the_table(cli, mcore_oracle, tmp_path: Path, line: str, named: str | None) -> None:
    (ckpt,) = mcore_oracle.checkpoints(LLAMA)
    out = tmp_path / "hf"
    result = converted(cli, nemo_checkpoint(ckpt.root, tmp_path / "nemo", NEMO_LLAMA + line), out)
    if named is None:
        assert result.exit_code == 0, result.output
        rope = json.loads((out / "config.json").read_text())["rope_parameters"]
        assert rope["rope_type"] == "linear" and rope["factor"] == 4.0
        return
    assert result.exit_code == 2, result.output
    assert named in result.output and len(result.output.strip().splitlines()) <= 2 and not out.exists()
