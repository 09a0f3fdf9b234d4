"""LoRA tensors take the partition implied by their base layer's partition.

Names recognised (``X`` is the wrapped layer, ``X.weight`` is what a plan knows):

* SAT ``lora2``: ``X.original.weight`` / ``X.original.bias`` (the base), ``X.matrix_A.{i}``,
  ``X.matrix_B.{i}`` (one pair per packed part of the base: q, k, v or k, v).
* peft: ``X.base_layer.weight`` (the base), ``X.lora_A.weight`` / ``X.lora_A.<adapter>.weight``, ``lora_B``;
  an embedding's ``X.lora_embedding_A[.<adapter>]`` ``[r, vocab]`` and ``lora_embedding_B`` ``[hidden, r]``
  (PEFT keeps them transposed: its delta is ``(B A)^T``); DoRA's ``X.lora_magnitude_vector[.<adapter>][.weight]``.

The rule (peft ``LoraParallelLinear``, SAT ``LoraLinear``): for a column-parallel base (``shard`` on
dim 0 or ``packed``), A ``[r, in]`` is replicated and B ``[out, r]`` is split like the base's rows (SAT's
``matrix_B.i`` is a shard of part ``i``); for a row-parallel base (``shard`` on dim 1), A ``[r, in]`` is
split on dim 1 and B is replicated. A replicated base keeps both replicated; B of a base with replicated KV
heads has the base's heads. An embedding split on its vocab rows has its ``lora_embedding_A`` split on its vocab
columns and ``lora_embedding_B`` replicated (PEFT's ``embedding_rowwise`` rule); a linear on vocab rows (``lm_head``)
has A replicated and B on the vocab rows. DoRA's magnitude has one value per output row: cut like B.

Pure: names and partitions in, partitions out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Grouped, Packed, Partition, Replicate, ReplicatedHeads, Shard, Vocab
from reshard.plans.base import Plan, Rule

BASE, A, B, MAGNITUDE = "base", "A", "B", "magnitude"
# what every LoRA name below holds
_MARKERS = re.compile(r"\.(original|base_layer|matrix_[AB]|lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)(\.|$)")
_PATTERNS = (
    (re.compile(r"^(?P<layer>.+)\.original\.(?P<param>weight|bias)$"), BASE),
    (re.compile(r"^(?P<layer>.+)\.base_layer\.(?P<param>weight|bias)$"), BASE),
    (re.compile(r"^(?P<layer>.+)\.matrix_A\.(?P<index>\d+)$"), A),
    (re.compile(r"^(?P<layer>.+)\.matrix_B\.(?P<index>\d+)$"), B),
    (re.compile(r"^(?P<layer>.+)\.lora_A(\.(?P<adapter>[^.]+))?\.weight$"), A),
    (re.compile(r"^(?P<layer>.+)\.lora_B(\.(?P<adapter>[^.]+))?\.weight$"), B),
    (re.compile(r"^(?P<layer>.+)\.lora_(?P<embedding>embedding)_A(\.(?P<adapter>[^.]+))?$"), A),
    (re.compile(r"^(?P<layer>.+)\.lora_(?P<embedding>embedding)_B(\.(?P<adapter>[^.]+))?$"), B),
    (re.compile(r"^(?P<layer>.+)\.lora_magnitude_vector(\.(?P<adapter>[^.]+))?(\.weight)?$"), MAGNITUDE),
)


@dataclass(frozen=True)
class LoraName:
    """What a LoRA tensor name says.

    Attributes:
        layer: the wrapped layer (``...attention.query_key_value``).
        role: ``base`` (the frozen weight or bias), ``A``, ``B`` or DoRA's ``magnitude``.
        index: SAT's part index of ``matrix_A.i`` / ``matrix_B.i``; None for peft names.
        param: for the base, ``weight`` or ``bias``.
        adapter: peft's adapter name in the key (``default``); None where the key has none (a saved adapter).
        embedding: peft's ``lora_embedding_A`` / ``_B`` (A ``[r, vocab]``, B ``[hidden, r]``).
    """

    layer: str
    role: str
    index: int | None = None
    param: str = "weight"
    adapter: str | None = None
    embedding: bool = False

    @property
    def peft(self) -> bool:
        """Whether the name is peft's (SAT's ``matrix_A.i`` carry a part index, peft's none)."""
        return self.index is None

    @property
    def base(self) -> str:
        """The name a plan knows the base tensor by (``X.weight`` or ``X.bias``)."""
        return f"{self.layer}.{self.param}"


def parse_lora_name(name: str) -> LoraName | None:
    """The LoRA reading of ``name``, or None when it is not a LoRA tensor."""
    for pattern, role in _PATTERNS:
        match = pattern.match(name)
        if match:
            groups = match.groupdict()
            index = int(groups["index"]) if groups.get("index") is not None else None
            param, embedding = groups.get("param") or "weight", groups.get("embedding") is not None
            return LoraName(groups["layer"], role, index, param, groups.get("adapter"), embedding)
    return None


def plain_name(name: str) -> str:
    """The name a LoRA-wrapped base tensor has without its wrapper (``X.base_layer.weight`` -> ``X.weight``)."""
    lora = parse_lora_name(name)
    return lora.base if lora is not None and lora.role == BASE else name


def lora_partition(base: Partition, lora: LoraName) -> Partition:
    """The partition of a LoRA tensor whose base layer's weight has partition ``base``.

    Raises:
        AmbiguousPartitionError: a base split in a way LoRA has no rule for (a padded vocab, a dim > 1),
            or a SAT part index the base does not have.
    """
    if lora.role == BASE or isinstance(base, Replicate):
        return base
    if lora.role == MAGNITUDE:  # one value per output row of the base
        lora = LoraName(lora.layer, B)
    if lora.embedding:  # A [r, vocab] and B [hidden, r] are the transposed halves of the embedding [vocab, hidden]
        match base:
            case Vocab(0):
                return Vocab(1) if lora.role == A else Replicate()
            case Shard(0, unit):
                return Shard(1, unit) if lora.role == A else Replicate()
            case Shard(1, unit):
                return Replicate() if lora.role == A else Shard(0, unit)
        raise AmbiguousPartitionError(f"no LoRA rule for an embedding split as {base.describe()}")
    match base:
        case Vocab(0):  # a linear on vocab rows (lm_head): B's rows are the vocab
            return Replicate() if lora.role == A else base
        case Shard(0, unit):
            if lora.index not in (None, 0):
                raise AmbiguousPartitionError(f"matrix_B.{lora.index} of a layer split as {base.describe()}")
            return Replicate() if lora.role == A else Shard(0, unit)
        case Shard(1, unit):
            return Shard(1, unit) if lora.role == A else Replicate()
        case ReplicatedHeads(0, _) if lora.index in (None, 0):  # B's rows are the base's KV heads
            return Replicate() if lora.role == A else base
        case Grouped(0, _) if lora.index is None:  # one peft B over a fused QKV: its rows are grouped as the base's
            return Replicate() if lora.role == A else base
        case Packed(0, parts, _):
            if lora.role == A:
                return Replicate()
            if lora.index is None:  # one B over every part (peft): its rows are packed like the base's
                return base
            if lora.index >= len(parts):
                raise AmbiguousPartitionError(f"matrix_B.{lora.index} but the base has {len(parts)} packed parts")
            return Shard(0, base.part_units()[lora.index])
    raise AmbiguousPartitionError(f"no LoRA rule for a base layer split as {base.describe()}")


class LoraPlan(Plan):
    """A plan whose LoRA tensors follow their base layer's rule; other names go to the plan's rules.

    A LoRA name is tried first, so a catch-all rule of the plan never swallows an adapter tensor.
    """

    def match(self, name: str) -> Rule | None:
        lora = parse_lora_name(name) if _MARKERS.search(name) else None
        if lora is None:
            return super().match(name)
        base_rule = super().match(f"{lora.layer}.weight" if lora.role != BASE else lora.base)
        if base_rule is None:
            return None

        def partition(config: ModelConfig | None) -> Partition:
            return lora_partition(base_rule.resolve(config), lora)

        role = (
            "DoRA magnitude" if lora.role == MAGNITUDE else f"LoRA {'embedding ' if lora.embedding else ''}{lora.role}"
        )
        label = "base" if lora.role == BASE else role + ("" if lora.index is None else f".{lora.index}")
        return Rule(f"{base_rule.pattern}(?#{label})", partition)


def with_lora(plan: Plan) -> LoraPlan:
    """``plan`` with LoRA tensors derived from their base layers."""
    return LoraPlan(plan.name, plan.rules)
