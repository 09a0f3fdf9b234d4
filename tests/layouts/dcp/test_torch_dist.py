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


def nemo_checkpoint(ckpt: Path, out: Path, *, vocab_hint: bool = False) -> Path:
    """A NeMo 2 checkpoint of the model: Megatron-Core's files under ``weights/`` and the model's config in
    ``context/model.yaml`` as NeMo's ``io_dump`` writes it (Megatron-Core TransformerConfig names under ``config``)."""
    iteration = next(p for p in (ckpt / "torch_dist").iterdir() if p.is_dir())
    shutil.copytree(iteration, out / "weights")
    (out / "context").mkdir()
    (out / "context" / "model.yaml").write_text(
        """_target_: nemo.collections.llm.gpt.model.llama.LlamaModel
config:
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
tokenizer:
  _target_: nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer
  pretrained_model_name: meta-llama/Llama-3.1-8B
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
