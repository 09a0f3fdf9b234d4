"""SwissArmyTransformer (SAT) names: CogVLM, CogAgent and the LLaMA-style models SAT trains.

SAT cuts tensors with three layer types (``sat/mpu/layers.py``), and every size must divide exactly:

* ``VocabParallelEmbedding`` (``word_embeddings`` when ``vocab_size >= 1000``; a smaller vocab is a
  plain, replicated ``nn.Embedding``): dim 0. SAT never pads the vocab, so this is ``shard(0)``, not
  ``vocab(0)``. LLaMA's ``mixins.lm.lm_head`` is a ``ColumnParallelLinear``: ``shard(0)`` too.
* ``ColumnParallelLinear``: dim 0 of weight and bias. With a ``stride`` the rows are parts, each
  split on its own: ``attention.query_key_value`` is ``packed`` ``[q; k; v]`` (with
  ``num_multi_query_heads = g`` the parts are ``heads*hd, g*hd, g*hd``), ``cross_attention.key_value``
  is ``packed`` ``[k; v]``.
* ``RowParallelLinear``: dim 1 of the weight; its bias is replicated.

CogAgent's vision-expert lists (``mixins.rotary.vision_*``, ``mixins.mlp.vision_*``) follow their trunk
twins. The EVA tower (``mixins.eva.vit_model.*``) is a SAT model built with the same model parallel
size, split by the same rules with its own sizes (``eva_args`` in ``model_config.json``). Everything
else (norms, ``boi``/``eoi``, ``pos_embed``, the HF-style cross encoder ``mixins.encoder.*``, the GLU
``mixins.eva.linear_proj.*``) is replicated, and checked equal on every rank when gathered.

Part sizes come from ``model_config.json`` through :class:`SatSizes`, never from literals.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Packed, Partition, Replicate, Shard
from reshard.plans.base import Plan, Rule

# A name every SAT transformer has (also when LoRA wraps it as ``.original`` / ``.matrix_A.0``).
SIGNATURE = r"(^|\.)transformer\.layers\.\d+\.attention\.query_key_value\."
EVA_SCOPE = r"^mixins\.eva\.vit_model\."
# SAT uses a VocabParallelEmbedding only from this vocab size on (sat/model/transformer.py).
MIN_PARALLEL_VOCAB = 1000


@dataclass(frozen=True)
class SatSizes:
    """The sizes SAT's attention layers are built from (``SelfAttention`` / ``CrossAttention``)."""

    heads: int
    head_dim: int
    kv_heads: int
    vocab_size: int | None
    cross_head_dim: int
    cross_kv_heads: int

    @classmethod
    def from_args(cls, args: Mapping[str, Any], what: str) -> SatSizes:
        """Sizes from a SAT args mapping (``model_config.json`` or its ``eva_args``)."""
        hidden, heads = args.get("hidden_size"), args.get("num_attention_heads")
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1:
            raise AmbiguousPartitionError(f"{what} needs hidden_size and num_attention_heads to size its parts")
        head_dim = args.get("hidden_size_per_attention_head") or hidden // heads
        # CogAgent computes cross attention in a smaller space (cross_compute_hidden_size, same head count).
        cross_inner = args.get("cross_compute_hidden_size") or heads * head_dim
        return cls(
            heads=heads,
            head_dim=head_dim,
            kv_heads=args.get("num_multi_query_heads") or heads,
            vocab_size=args.get("vocab_size"),
            cross_head_dim=cross_inner // heads,
            cross_kv_heads=args.get("cross_num_multi_query_heads") or heads,
        )


def trunk_sizes(config: ModelConfig | None) -> SatSizes:
    if config is None:
        raise AmbiguousPartitionError("a SAT checkpoint needs its model_config.json to size packed tensors")
    return SatSizes.from_args(config.raw, "the SAT model_config.json")


def eva_sizes(config: ModelConfig | None) -> SatSizes:
    eva = config.raw.get("eva_args") if config is not None else None
    if not isinstance(eva, Mapping):
        raise AmbiguousPartitionError("the EVA tower needs eva_args in model_config.json to size its parts")
    return SatSizes.from_args(eva, "eva_args in model_config.json")


Sizes = Callable[[ModelConfig | None], SatSizes]


def _embedding(sizes: Sizes) -> Callable[[ModelConfig | None], Partition]:
    def partition(config: ModelConfig | None) -> Partition:
        vocab = sizes(config).vocab_size
        if vocab is None:
            raise AmbiguousPartitionError("vocab_size unknown (SAT splits word_embeddings only from 1000 on)")
        return Shard(0) if vocab >= MIN_PARALLEL_VOCAB else Replicate()

    return partition


def _qkv(sizes: Sizes) -> Callable[[ModelConfig | None], Partition]:
    def partition(config: ModelConfig | None) -> Partition:
        s = sizes(config)
        hd = s.head_dim
        return Packed(0, (s.heads * hd, s.kv_heads * hd, s.kv_heads * hd), (hd, hd, hd))

    return partition


def _cross_kv(sizes: Sizes) -> Callable[[ModelConfig | None], Partition]:
    def partition(config: ModelConfig | None) -> Partition:
        s = sizes(config)
        hd = s.cross_head_dim
        return Packed(0, (s.cross_kv_heads * hd, s.cross_kv_heads * hd), (hd, hd))

    return partition


def _heads(sizes: Sizes, dim: int, *, cross: bool = False) -> Callable[[ModelConfig | None], Partition]:
    def partition(config: ModelConfig | None) -> Partition:
        s = sizes(config)
        return Shard(dim, unit=s.cross_head_dim if cross else s.head_dim)

    return partition


_QKV = r"(attention\.query_key_value|vision_query_key_value_list\.\d+)"
_DENSE = r"(attention\.dense|vision_dense_list\.\d+)"
_COLUMN_MLP = r"(mlp\.dense_h_to_4h(_gate)?(_\d+)?|(vision_)?gate_proj\.\d+|vision_dense_h_to_4h_list\.\d+)"
_ROW_MLP = r"(mlp\.dense_4h_to_h(_\d+)?|vision_dense_4h_to_h_list\.\d+)"


def _rules(scope: str, sizes: Sizes) -> tuple[Rule, ...]:
    """The rules of one SAT transformer whose names match ``scope`` (a prefix regex, or any name)."""
    any_ = scope + r"(.*\.)?" if scope else r"(^|\.)"
    return (
        Rule(any_ + r"word_embeddings\.weight$", _embedding(sizes)),
        Rule(any_ + r"lm_head\.weight$", Shard(0)),
        Rule(any_ + _QKV + r"\.(weight|bias)$", _qkv(sizes)),
        Rule(any_ + _DENSE + r"\.weight$", _heads(sizes, 1)),
        Rule(any_ + r"cross_attention\.query\.(weight|bias)$", _heads(sizes, 0, cross=True)),
        Rule(any_ + r"cross_attention\.key_value\.(weight|bias)$", _cross_kv(sizes)),
        Rule(any_ + r"cross_attention\.dense\.weight$", _heads(sizes, 1, cross=True)),
        Rule(any_ + _COLUMN_MLP + r"\.(weight|bias)$", Shard(0)),
        Rule(any_ + _ROW_MLP + r"\.weight$", Shard(1)),
        Rule(any_ + r"(" + _DENSE + r"|cross_attention\.dense|" + _ROW_MLP + r")\.bias$", Replicate()),
    )


SAT_PLAN = Plan(
    "sat",
    _rules(EVA_SCOPE, eva_sizes) + _rules("", trunk_sizes) + (Rule(r".*", Replicate()),),  # the rest: replicated
)
MODEL_TYPES: tuple[str, ...] = ()  # SAT's model_config.json names a model_class, not a model_type
