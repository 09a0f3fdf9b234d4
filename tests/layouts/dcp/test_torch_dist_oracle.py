"""``--layout torch_dist`` proven against Megatron-Core 0.16.1: what reshard writes is the checkpoint Megatron-Core
writes for the same model, and Megatron-Core loads it at other tp/pp with the logits of the model that wrote the
source (legacy Megatron checkpoints) or of the transformers model (a Llama from ``save_pretrained``).

The oracle runs in subprocesses (``tests/oracles``); every load of this module is one ``load_many`` (one torchrun per
process count). Nothing here imports Megatron.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fixtures.dcp_read import read_dcp
from fixtures.models import tiny_llama
from oracles.variants import Spec

from reshard.cli import main

pytestmark = pytest.mark.oracle

# Legacy checkpoints Megatron-Core writes at TP=2 (PP=2 for one), converted as a whole with --tp 2.
SOURCES = {
    "llama": Spec("llama", tp=2),
    "llama-tied": Spec("llama-tied", tp=2),
    "moe": Spec("moe", tp=2),
    "moe-shared-gate": Spec("moe-shared-gate", tp=2),
    "qk-norm": Spec("qk-norm", tp=2),
    "llama-pp2": Spec("llama", pp=2),
}
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2)]  # (tp, pp) of the model that loads the output
# tiny_llama with 2 query groups, as the oracle's llama variant sizes it otherwise.
HF_VARIANT = (("ffn", "128"), ("layers", "2"), ("norm_eps", "1e-06"), ("vocab", "1001"))
HF_LAYOUTS = [(2, 1), (1, 2)]


@pytest.fixture(scope="module")
def saved(mcore_oracle) -> dict:
    return dict(zip(SOURCES, mcore_oracle.checkpoints(*SOURCES.values()), strict=True))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama (GQA, norms made random so that a misplaced one shows), saved with ``save_pretrained``."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    model = tiny_llama(path, num_key_value_heads=2, vocab=1001, seed=3)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(torch.rand_like(param) + 0.5)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def converted(saved, hf_llama, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("torch_dist")
    sources = {name: ckpt.torch for name, ckpt in saved.items()} | {"hf-llama": hf_llama[0]}
    out = {}
    for name, source in sources.items():
        out[name] = base / name
        args = ["convert", str(source), "--tp", "2", "--layout", "torch_dist", "-o", str(out[name]), "-q"]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
    return out


def _loads() -> list[tuple[str, Spec]]:
    loads = [(name, Spec(spec.variant, tp, pp)) for name, spec in SOURCES.items() for tp, pp in LAYOUTS]
    return loads + [("hf-llama", Spec("llama", tp, pp, HF_VARIANT)) for tp, pp in HF_LAYOUTS]


def _id(load: tuple[str, Spec]) -> str:
    name, spec = load
    return f"{name}-as-tp{spec.tp}-pp{spec.pp}"


@pytest.fixture(scope="module")
def loaded(mcore_oracle, converted) -> dict[str, dict]:
    requests = [(converted[name], "torch_dist", spec, "assume_ok_unexpected") for name, spec in _loads()]
    return dict(zip(map(_id, _loads()), mcore_oracle.load_many(requests), strict=True))


@pytest.mark.parametrize("load", [load for load in _loads() if load[0] != "hf-llama"], ids=_id)
def test_megatron_core_loads_it_at_any_layout_with_the_writer_s_logits(load, saved, loaded) -> None:
    name, spec = load
    ckpt, out = saved[name], loaded[_id(load)]
    assert torch.equal(out["input_ids"], ckpt.input_ids)
    torch.testing.assert_close(out["logits"][..., : ckpt.variant.vocab], ckpt.logits, rtol=0, atol=1e-5)
    assert (out["iteration"], out["checkpoint_version"]) == (10, 3.0)
    args = out["args"]
    assert (args["ckpt_format"], args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (
        "torch_dist",
        2,
        1,
    )


@pytest.mark.parametrize("load", [load for load in _loads() if load[0] == "hf-llama"], ids=_id)
def test_a_transformers_llama_loads_in_megatron_core_with_its_logits(load, hf_llama, loaded) -> None:
    _, model = hf_llama
    out = loaded[_id(load)]
    with torch.inference_mode():
        expected = model(out["input_ids"]).logits
    assert out["logits"].shape[-1] == 1024  # 1001 padded to 128 * 2 by the writer, and by the loader's own rule
    torch.testing.assert_close(out["logits"][..., :1001], expected, rtol=0, atol=1e-5)
    assert out["iteration"] == 0 and out["args"]["transformer_impl"] == "transformer_engine"


def _te_norm_name(name: str) -> str:
    """The name Megatron-Core stores a local-spec norm under (Transformer Engine's fused one; a MoE layer has no
    ``linear_fc1`` to fuse its pre-MLP norm into)."""
    name = re.sub(r"\.input_layernorm\.", ".self_attention.linear_qkv.layer_norm_", name)
    return re.sub(r"\.pre_mlp_layernorm\.", ".mlp.linear_fc1.layer_norm_", name)


def _stacked_key(name: str) -> str:
    """Megatron-Core's key for a layer's (an expert's) tensor: layers and experts stacked."""
    name = re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", name)
    return re.sub(r"\.experts\.local_experts\.\d+\.", ".experts.experts.", name)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_it_is_the_checkpoint_megatron_core_writes(name: str, saved, converted) -> None:
    """Megatron-Core's own torch_dist of the same model: the same keys, global shapes, dtypes and objects, the
    same values but for the vocab's pad rows (Megatron's are trained rows, reshard's zeros). Only the rng state,
    which a conversion does not carry, is Megatron's alone."""
    ckpt = saved[name]
    theirs = read_dcp(ckpt.torch_dist / "iter_0000010", skip=("rng_state/",))
    ours = read_dcp(converted[name] / "iter_0000010")
    assert sorted(ours) == sorted(theirs)
    # reshard.json names every tensor as reshard reads the output back (the torch format's names, one per layer
    # and expert): the output verifies against it, equals the legacy checkpoint it came from, and goes to tp 2
    # and back bit for bit.
    manifest = json.loads((converted[name] / "reshard.json").read_text())["tensors"]
    stored = {k for k in ours if isinstance(ours[k], torch.Tensor)}
    assert {_stacked_key(_te_norm_name(n)) for n in manifest} == stored
    for compared in ((converted[name],), (ckpt.torch, converted[name]), (converted[name], "--roundtrip", "2")):
        result = CliRunner().invoke(main, ["verify", *map(str, compared), "-q"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    vocab = ckpt.variant.vocab
    for key, want in theirs.items():
        got = ours[key]
        if not isinstance(want, torch.Tensor):
            assert got == want == [None], key  # the local spec's _extra_state
            continue
        assert (got.shape, got.dtype) == (want.shape, want.dtype), key
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            got, want = got[:vocab], want[:vocab]
        assert torch.equal(got, want), key
