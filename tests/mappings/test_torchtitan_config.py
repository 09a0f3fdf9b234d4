"""A torchtitan checkpoint's model: sizes from its shapes, heads and RoPE from ``--config`` (a torchtitan job TOML or
a transformers config.json) or ``freqs_cis``, and never guessed."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.config import ModelConfig, load_config
from reshard.errors import CorruptFileError, MappingError
from reshard.mappings.torchtitan_config import TitanModel, llama_config, titan_model
from reshard.mappings.torchtitan_flavors import FLAVORS, flavor


def titan_shapes(
    dim: int, layers: int, heads: int, kv: int, hidden: int, vocab: int, *, fused: bool = False, freqs: bool = False
) -> dict[str, tuple[int, ...]]:
    """The shapes torchtitan saves for a Llama 3 (HEAD names, or the fused ``wqkv``; ``freqs_cis`` of v0.1)."""
    hd = dim // heads
    shapes = {"tok_embeddings.weight": (vocab, dim), "norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        if fused:
            shapes[p + "attention.qkv_linear.wqkv.weight"] = ((heads + 2 * kv) * hd, dim)
        else:
            shapes |= {p + "attention.qkv_linear.wq.weight": (heads * hd, dim)}
            shapes |= {p + f"attention.qkv_linear.{w}.weight": (kv * hd, dim) for w in ("wk", "wv")}
        shapes |= {p + "attention.wo.weight": (dim, heads * hd), p + "feed_forward.w2.weight": (dim, hidden)}
        shapes |= {p + f"feed_forward.{w}.weight": (hidden, dim) for w in ("w1", "w3")}
        shapes |= {p + "attention_norm.weight": (dim,), p + "ffn_norm.weight": (dim,)}
    if freqs:
        shapes["freqs_cis"] = (2 * 64, hd // 2)
    return shapes


TINY = titan_shapes(64, 2, 4, 2, 192, 1001)
DEBUG = titan_shapes(256, 6, 16, 16, 768, 2000)  # debugmodel, with v0.1's tokenizer-sized vocab


def job(**model: object) -> ModelConfig:
    return ModelConfig({"job": {"dump_folder": "./outputs"}, "model": {"name": "llama3", **model}})


@pytest.mark.parametrize(
    "name, hidden, heads, kv, tied",
    [
        ("debugmodel", 768, 16, 16, False),
        ("1B", 8192, 32, 8, True),  # Llama-3.2-1B's config.json: intermediate_size 8192, tied
        ("3B", 8192, 24, 8, True),
        ("8B", 14336, 32, 8, False),  # Llama-3.1-8B: 14336
        ("70B", 28672, 64, 8, False),  # Llama-3.1-70B: 28672
        ("405B", 53248, 128, 8, False),  # Llama-3.1-405B: 53248
    ],
)
def test_flavor_sizes_are_the_published_models(name: str, hidden: int, heads: int, kv: int, tied: bool) -> None:
    f = FLAVORS[name]
    assert (f.hidden_dim, f.n_heads, f.n_kv_heads, f.tied) == (hidden, heads, kv, tied)


def test_older_flavor_names_are_the_same_models() -> None:
    assert flavor("8B_flex") is FLAVORS["8B"] and flavor("debugmodel_varlen_attn") is FLAVORS["debugmodel"]
    assert flavor("7B") is None


def test_an_8b_flavor_becomes_llama_3_1_8b_s_config() -> None:
    shapes = titan_shapes(4096, 32, 32, 8, 14336, 128256)
    model = titan_model(job(flavor="8B"), shapes)
    config = llama_config(model, vocab_size=128256, dtype="bfloat16")
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim")} == {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "head_dim": 128,
    }
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (32, 8, 128256)
    assert config["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config["rms_norm_eps"] == 1e-5 and config["tie_word_embeddings"] is False
    assert config["attention_bias"] is False and config["mlp_bias"] is False
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]


def test_without_a_config_the_heads_are_refused_with_what_was_found() -> None:
    with pytest.raises(MappingError) as caught:
        titan_model(None, TINY, path="ckpt")
    line = caught.value.one_line()
    assert "dim 64, 2 layers, vocab 1001, FFN 192, wq 64 rows, wk 32 rows" in line
    assert "does not store its head counts nor its RoPE settings" in line and "--config" in line
    with pytest.raises(MappingError, match='flavor = "debugmodel"'):
        titan_model(None, DEBUG)


def test_a_flavor_that_does_not_fit_is_refused_naming_each_difference() -> None:
    with pytest.raises(MappingError) as caught:
        titan_model(job(flavor="debugmodel"), TINY)
    line = caught.value.one_line()
    for part in ("dim 256 vs 64", "layers 6 vs 2", "FFN size 768 vs 192", "wq rows (n_heads * head_dim) 256 vs 64"):
        assert part in line


def test_without_a_flavor_the_job_states_heads_and_rope_and_the_kv_heads_come_from_shapes() -> None:
    model = titan_model(job(n_heads=4, rope_theta=500000, rope_scaling="none"), TINY)
    assert model == TitanModel(64, 2, 192, 4, 2, 16, 500000.0, False)
    fused = titan_model(
        job(n_heads=4, rope_theta=10000.0, rope_scaling="llama"), titan_shapes(64, 2, 4, 2, 192, 9, fused=True)
    )
    assert (fused.n_kv_heads, fused.head_dim, fused.rope_scaling) == (2, 16, True)
    with pytest.raises(MappingError, match="no flavor and no rope_theta, rope_scaling"):
        titan_model(job(n_heads=4), TINY)
    with pytest.raises(MappingError, match=r"wk rows \(n_kv_heads \* head_dim\) 64 vs 32"):
        titan_model(job(n_heads=4, n_kv_heads=4, rope_theta=1e4, rope_scaling="none"), TINY)


def test_freqs_cis_gives_the_head_size_and_says_the_rope_was_not_scaled() -> None:
    shapes = titan_shapes(64, 2, 4, 2, 192, 1001, freqs=True)
    model = titan_model(job(rope_theta=500000), shapes)
    assert (model.n_heads, model.n_kv_heads, model.head_dim, model.rope_scaling) == (4, 2, 16, False)
    assert (
        titan_model(job(flavor="debugmodel"), titan_shapes(256, 6, 16, 16, 768, 2000, freqs=True)).rope_scaling
        is False
    )
    with pytest.raises(MappingError, match="before 9874e84d, whose RoPE was not scaled"):
        titan_model(job(rope_theta=500000, rope_scaling="llama"), shapes)
    with pytest.raises(MappingError, match="head size of freqs_cis 32 vs 16"):
        titan_model(job(n_heads=2, rope_theta=500000), shapes)


def test_a_transformers_config_gives_the_heads_and_is_checked() -> None:
    hf = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 192}
    model = titan_model(ModelConfig(hf | {"num_attention_heads": 4, "num_key_value_heads": 2}), TINY)
    assert (model.n_heads, model.n_kv_heads, model.head_dim) == (4, 2, 16)
    with pytest.raises(MappingError, match=r"wk rows \(n_kv_heads \* head_dim\) 64 vs 32"):
        titan_model(ModelConfig(hf | {"num_attention_heads": 4, "num_key_value_heads": 4}), TINY)
    with pytest.raises(MappingError, match="has no intermediate_size"):
        titan_model(ModelConfig({k: v for k, v in hf.items() if k != "intermediate_size"}), TINY)


def test_other_models_flavors_and_scalings_are_refused() -> None:
    with pytest.raises(MappingError, match="torchtitan model 'deepseek_v3': reshard maps llama3 only"):
        titan_model(job(name="deepseek_v3"), TINY)
    with pytest.raises(MappingError, match="no torchtitan llama3 flavor '7B'.*one of debugmodel, 1B"):
        titan_model(job(flavor="7B"), TINY)
    with pytest.raises(MappingError, match="rope_scaling 'yarn' is not one of"):
        titan_model(job(flavor="debugmodel", rope_scaling="yarn"), DEBUG)
    with pytest.raises(MappingError, match=r"\[model\] has n_heads = '4', rope_theta = 0"):
        titan_model(job(n_heads="4", rope_theta=0, rope_scaling="none"), TINY)


def test_no_output_layer_means_tied_and_a_tied_flavor_keeps_its_tie() -> None:
    shapes = {n: s for n, s in TINY.items() if n != "lm_head.weight"}
    assert titan_model(job(n_heads=4, rope_theta=5e5, rope_scaling="llama"), shapes).tied is True
    with pytest.raises(MappingError, match="no output layer"):
        titan_model(job(n_heads=4, rope_theta=5e5, rope_scaling="llama", enable_weight_tying=False), shapes)
    one_b = titan_shapes(2048, 16, 32, 8, 8192, 128256)
    assert titan_model(job(flavor="1B"), one_b).tied is True


def test_load_config_reads_a_job_toml(tmp_path: Path) -> None:
    path = tmp_path / "llama3_8b.toml"
    path.write_text('[job]\ndump_folder = "./outputs"\n\n[model]\nname = "llama3"\nflavor = "8B"\n')
    config = load_config(path)
    assert config.raw["model"] == {"name": "llama3", "flavor": "8B"} and config.model_type is None
    path.write_text("[model\nname = 1\n")
    with pytest.raises(CorruptFileError, match="cannot read the config"):
        load_config(path)


def test_a_rope_theta_of_infinity_in_a_transformers_config_is_refused() -> None:
    hf = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 192}
    hf |= {"num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(MappingError, match="rope_theta is inf, not a finite positive number"):
        titan_model(ModelConfig(hf | {"rope_theta": float("inf")}), TINY)
