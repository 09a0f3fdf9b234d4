"""A torchtitan Llama 3's model arguments, and the ``config.json`` transformers builds the same model from.

torchtitan stores no model arguments in its checkpoints. The sizes are in the tensor shapes (``dim``, vocab,
layers, FFN size, and the rows of ``wq`` / ``wk``); the head counts, the RoPE theta and scaling are not, and a
wrong head count silently breaks the RoPE permutation. So they come from ``--config``:

* a transformers ``config.json`` (``model_type: llama``, e.g. from torchtitan's ``hf_assets_path``): taken as the
  target's config;
* a torchtitan job TOML (``[model] name = "llama3"``, ``flavor = "8B"``): the flavor's arguments
  (:mod:`reshard.mappings.torchtitan_flavors`); keys of ``TransformerModelArgs`` in ``[model]`` (``n_heads``,
  ``n_kv_heads``, ``rope_theta``, ``norm_eps``, ``enable_weight_tying``, ``max_seq_len``) and ``rope_scaling``
  (``"llama"`` or ``"none"``) override it or, without a flavor, describe the model (``n_heads``, ``rope_theta``
  and ``rope_scaling`` required). Checkpoints of torchtitan before 9874e84d (2025-08-19) also hold ``freqs_cis``,
  whose width gives the head size and which says the RoPE was not scaled (scaling came later).

Whatever is given is checked against the shapes; anything that does not add up, or is not known, is refused
with what was found.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping as MappingType
from dataclasses import dataclass
from typing import Any

from reshard.config import ModelConfig
from reshard.errors import MappingError, shown
from reshard.mappings.torchtitan_flavors import FLAVORS, MAX_SEQ_LEN, NORM_EPS, ROPE_THETA, flavor
from reshard.megatron.config import GPTShape, hf_config

Shape = tuple[int, ...]
_LAYER = re.compile(r"^layers\.(\d+)\.")
_SCALINGS = ("llama", "none")


def _positive(value: Any) -> bool:
    """A positive number, and finite: ``inf`` (TOML allows it) would be written to config.json as ``Infinity``,
    which is not JSON."""
    if isinstance(value, float):
        return math.isfinite(value) and value > 0
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# The [model] keys read, and what a valid value is.
_KEYS = {
    "n_heads": lambda v: _positive(v) and isinstance(v, int),
    "n_kv_heads": lambda v: _positive(v) and isinstance(v, int),
    "max_seq_len": lambda v: _positive(v) and isinstance(v, int),
    "rope_theta": _positive,
    "norm_eps": _positive,
    "enable_weight_tying": lambda v: isinstance(v, bool),
}


@dataclass(frozen=True)
class FoundShapes:
    """What a torchtitan checkpoint's tensor shapes say about its model."""

    dim: int | None
    vocab: int | None
    n_layers: int
    hidden: int | None
    q_rows: int | None  # wq (or the fused wqkv's query part, unknown until the heads are)
    kv_rows: int | None
    qkv_rows: int | None  # the fused wqkv
    rope_head_dim: int | None  # from freqs_cis
    has_output: bool

    def describe(self) -> str:
        parts = [f"dim {self.dim}", f"{self.n_layers} layers", f"vocab {self.vocab}", f"FFN {self.hidden}"]
        if self.qkv_rows is not None:
            parts.append(f"fused wqkv {self.qkv_rows} rows")
        else:
            parts += [f"wq {self.q_rows} rows", f"wk {self.kv_rows} rows"]
        if self.rope_head_dim is not None:
            parts.append(f"freqs_cis of head size {self.rope_head_dim}")
        return ", ".join(parts)


def found_shapes(shapes: MappingType[str, Shape]) -> FoundShapes:
    """The sizes the shapes of layer 0, the embedding and ``freqs_cis`` give."""

    def rows(*names: str) -> int | None:
        return next((shapes[n][0] for n in names if n in shapes), None)

    embed = shapes.get("tok_embeddings.weight")
    freqs = shapes.get("freqs_cis")
    layer = "layers.0.attention."
    return FoundShapes(
        dim=embed[1] if embed and len(embed) == 2 else None,
        vocab=embed[0] if embed else None,
        n_layers=len({m.group(1) for name in shapes if (m := _LAYER.match(name))}),
        hidden=rows("layers.0.feed_forward.w1.weight"),
        q_rows=rows(layer + "qkv_linear.wq.weight", layer + "wq.weight"),
        kv_rows=rows(layer + "qkv_linear.wk.weight", layer + "wk.weight"),
        qkv_rows=rows(layer + "qkv_linear.wqkv.weight"),
        rope_head_dim=2 * freqs[-1] if freqs else None,
        has_output="lm_head.weight" in shapes or "output.weight" in shapes,
    )


@dataclass(frozen=True)
class TitanModel:
    """A torchtitan Llama 3, complete: what the mapping and the target's ``config.json`` need."""

    dim: int
    n_layers: int
    hidden_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: bool
    norm_eps: float = NORM_EPS
    max_seq_len: int = MAX_SEQ_LEN
    tied: bool = False


def titan_model(config: ModelConfig | None, shapes: MappingType[str, Shape], *, path: Any = None) -> TitanModel:
    """The model of a torchtitan checkpoint with these shapes, as ``config`` (``--config``) describes it.

    Raises:
        MappingError: the heads or the RoPE cannot be known, or what is given does not fit the shapes.
    """
    found = found_shapes(shapes)
    if config is not None and config.model_type == "llama":
        model = _from_hf(config, found)
    elif config is not None and isinstance(config.raw.get("model"), dict):
        model = _from_job(config.raw["model"], found, where=config.path or "the job config")
    else:
        raise MappingError(
            f"a torchtitan checkpoint ({found.describe()}) does not store its head counts nor its RoPE settings",
            path=path,
            hint=_config_hint(found),
        )
    problems = _misfits(model, found)
    if problems:
        differences = "; ".join(problems)
        raise MappingError(
            f"the model config does not fit the checkpoint (config vs checkpoint): {differences}", path=path
        )
    return model


def llama_config(model: TitanModel, *, vocab_size: int | None, dtype: str) -> dict[str, Any]:
    """transformers' ``config.json`` (``LlamaForCausalLM``) of ``model``."""
    shape = GPTShape(
        num_layers=model.n_layers,
        hidden_size=model.dim,
        ffn_hidden_size=model.hidden_dim,
        num_attention_heads=model.n_heads,
        num_query_groups=model.n_kv_heads,
        kv_channels=model.head_dim,
        max_position_embeddings=model.max_seq_len,
        norm_epsilon=model.norm_eps,
        rotary_base=model.rope_theta,
        rope_scaling_factor=8.0 if model.rope_scaling else None,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not model.tied,
    )
    return hf_config(shape, vocab_size=vocab_size, dtype=dtype, family="llama")


def _from_hf(config: ModelConfig, found: FoundShapes) -> TitanModel:
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
    missing = [key for key in keys if not isinstance(config.get(key), int)]
    if missing:
        raise MappingError(f"the transformers config has no {', '.join(missing)}", path=config.path)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0)) if isinstance(rope, dict) else None
    if theta is None or not _positive(theta):
        raise MappingError(f"rope_theta is {shown(theta)}, not a finite positive number", path=config.path)
    return TitanModel(
        dim=_known(config.hidden_size, "hidden_size", where=config.path),
        n_layers=config.get("num_hidden_layers"),
        hidden_dim=config.get("intermediate_size"),
        n_heads=_known(config.num_attention_heads, "num_attention_heads", where=config.path),
        n_kv_heads=_known(config.num_key_value_heads, "num_key_value_heads", where=config.path),
        head_dim=_known(config.head_dim, "head_dim", where=config.path),
        rope_theta=float(theta),
        rope_scaling=rope.get("rope_type", rope.get("type")) == "llama3",
        norm_eps=config.get("rms_norm_eps", NORM_EPS),
        max_seq_len=config.get("max_position_embeddings", MAX_SEQ_LEN),
        tied=config.tie_word_embeddings,
    )


def _from_job(section: dict[str, Any], found: FoundShapes, *, where: Any) -> TitanModel:
    """``[model]`` of a job TOML: the flavor, then its keys; heads and RoPE never guessed."""
    name = section.get("name", "llama3")
    if name != "llama3":
        raise MappingError(f"torchtitan model {name!r}: reshard maps llama3 only", path=where)
    wrong = [
        f"{key} = {shown(section[key])}" for key, valid in _KEYS.items() if key in section and not valid(section[key])
    ]
    if wrong:
        raise MappingError(
            f"[model] has {', '.join(wrong)}",
            path=where,
            hint="counts are positive integers, the others finite numbers",
        )
    base = None
    if "flavor" in section:
        base = flavor(str(section["flavor"]))
        if base is None:
            raise MappingError(f"no torchtitan llama3 flavor {section['flavor']!r}", path=where, hint=_flavors())
    scaling = section.get("rope_scaling")
    if scaling is not None and scaling not in _SCALINGS:
        raise MappingError(f"rope_scaling {scaling!r} is not one of {_SCALINGS}", path=where)
    if found.rope_head_dim is not None and scaling == "llama":
        raise MappingError(
            "freqs_cis is saved only by torchtitan before 9874e84d, whose RoPE was not scaled", path=where
        )
    n_heads = section.get("n_heads", base.n_heads if base else _heads_from_rope(found))
    if scaling is None:
        scaling = "none" if found.rope_head_dim is not None else ("llama" if base else None)
    theta = section.get("rope_theta", ROPE_THETA if base else None)
    if n_heads is None or theta is None or scaling is None:
        missing = [k for k, v in (("n_heads", n_heads), ("rope_theta", theta), ("rope_scaling", scaling)) if v is None]
        raise MappingError(f"[model] has no flavor and no {', '.join(missing)}", path=where, hint=_flavors())
    head_dim = base.dim // n_heads if base else _head_dim(found, n_heads)
    n_kv = section.get("n_kv_heads", base.n_kv_heads if base else _kv_heads(found, n_heads, head_dim))
    return TitanModel(
        dim=base.dim if base else _known(found.dim, "dim", where=where),
        n_layers=base.n_layers if base else found.n_layers,
        hidden_dim=base.hidden_dim if base else _known(found.hidden, "FFN size", where=where),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=float(theta),
        rope_scaling=scaling == "llama",
        norm_eps=float(section.get("norm_eps", NORM_EPS)),
        max_seq_len=int(section.get("max_seq_len", MAX_SEQ_LEN)),
        tied=bool(section.get("enable_weight_tying", base.tied if base else not found.has_output)),
    )


def _known(size: int | None, what: str, *, where: Any) -> int:
    """A size the model needs, which the config or the checkpoint's shapes gave."""
    if size is None:
        raise MappingError(f"the model's {what} is given by neither the config nor the checkpoint", path=where)
    return size


def _heads_from_rope(found: FoundShapes) -> int | None:
    if found.rope_head_dim and found.q_rows and found.q_rows % found.rope_head_dim == 0:
        return found.q_rows // found.rope_head_dim
    return None


def _head_dim(found: FoundShapes, n_heads: int) -> int:
    """``wq`` rows per head (torchtitan's llama3 has ``head_dim = dim // n_heads``, which the fused form needs)."""
    if found.q_rows is not None and found.q_rows % n_heads == 0:
        return found.q_rows // n_heads
    return (found.dim or 0) // n_heads


def _kv_heads(found: FoundShapes, n_heads: int, head_dim: int) -> int:
    if found.kv_rows is not None:
        return found.kv_rows // head_dim if head_dim else 0
    if found.qkv_rows is not None and head_dim:
        return (found.qkv_rows // head_dim - n_heads) // 2
    return n_heads


def _misfits(model: TitanModel, found: FoundShapes) -> list[str]:
    """Where the model and the shapes disagree, each as ``what: config vs checkpoint``."""
    pairs = [
        ("dim", model.dim, found.dim),
        ("layers", model.n_layers, found.n_layers),
        ("FFN size", model.hidden_dim, found.hidden),
        ("wq rows (n_heads * head_dim)", model.n_heads * model.head_dim, found.q_rows),
        ("wk rows (n_kv_heads * head_dim)", model.n_kv_heads * model.head_dim, found.kv_rows),
        ("wqkv rows", (model.n_heads + 2 * model.n_kv_heads) * model.head_dim, found.qkv_rows),
        ("head size of freqs_cis", model.head_dim, found.rope_head_dim),
    ]
    problems = [f"{what} {want} vs {got}" for what, want, got in pairs if got is not None and want != got]
    if model.n_kv_heads <= 0 or model.n_heads % model.n_kv_heads:
        problems.append(f"{model.n_heads} heads do not share {model.n_kv_heads} KV heads evenly")
    if model.head_dim % 2:
        problems.append(f"head size {model.head_dim} is odd (RoPE rotates pairs)")
    if model.tied is False and not found.has_output:
        problems.append("no output layer (lm_head or output) and the embeddings are not tied")
    return problems


def _flavors() -> str:
    return f"give [model] flavor (one of {', '.join(FLAVORS)}) or n_heads, rope_theta and rope_scaling"


def _config_hint(found: FoundShapes) -> str:
    matches = [
        name
        for name, f in FLAVORS.items()
        if (f.dim, f.n_layers, f.hidden_dim) == (found.dim, found.n_layers, found.hidden)
    ]
    which = f'[model] name = "llama3", flavor = "{matches[0]}"' if len(matches) == 1 else "[model] name, flavor"
    return f"pass --config with a torchtitan job TOML ({which}) or the model's transformers config.json" + (
        f"; the shapes are those of the {matches[0]} flavor" if len(matches) == 1 else ""
    )
