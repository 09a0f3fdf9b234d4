"""The findings of ``reshard check``, each a pure function of names, shapes, partitions and the config.

Head counts that do not divide by the tp (or KV heads copied onto several ranks: a note), a depthwise
``conv1d`` whose channels do not match its fused input projection on each rank, the vocab padding a tp needs,
and the grouping of per-tensor problems into one line each. Every size comes from the sub-config that owns
the tensor (:meth:`reshard.config.ModelConfig.for_tensor`), so a vision tower's heads are its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from reshard.config import ModelConfig
from reshard.geometry import Partition, Replicate, Shard, Vocab, head_replicas, padded_size, rank_shapes
from reshard.plans import Rule
from reshard.quantization import QuantScheme

Shape = tuple[int, ...]
ERROR, WARNING, NOTE = "error", "warning", "note"
NOT_IN_PLAN = "not in the"  # how a warning about a tensor the plan leaves whole starts

# Which head count a split tensor is cut by: (name pattern, config keys of the tensor's own sub-config).
HEAD_COUNTS = (
    (r"visual\..*attn\.(qkv|proj)\.", ("num_heads",)),
    (r"self_attn\.(q_proj|q_b_proj|kv_b_proj|o_proj)\.", ("num_attention_heads",)),
    (r"self_attn\.[kv]_proj\.", ("num_key_value_heads",)),
    (r"linear_attn\.(in_proj_qkv\.|conv1d\.)", ("linear_num_key_heads", "linear_num_value_heads")),
    (r"linear_attn\.(in_proj_qkvz|in_proj_ba)\.", ("linear_num_key_heads",)),
    (r"linear_attn\.(in_proj_[zab]\.|out_proj\.|A_log|dt_bias)", ("linear_num_value_heads",)),
)
FUSED_INPUTS = ("in_proj_qkv.weight", "in_proj_qkvz.weight")
KV_HEADS = "num_key_value_heads"  # copied onto tp / count ranks past their count, unless quantized in whole units


@dataclass
class Problem:
    severity: str  # "error": cannot be split so; "warning": can, but read this; "note": how it will be split
    message: str
    tensors: list[str] = field(default_factory=list)


@dataclass
class CheckedTensor:
    name: str
    shape: list[int]
    rule: str | None
    partition: dict | None
    rank_shape: list[int] | None  # rank 0's shape at the target tp (None when it cannot be split)
    problems: list[str] = field(default_factory=list)


HeadKey = tuple[str, str]  # (the sub-config's scope, the head-count key)


def head_keys(name: str) -> tuple[str, ...]:
    for pattern, keys in HEAD_COUNTS:
        if re.search(pattern, name):
            return keys
    return ()


def head_count(config: ModelConfig | None, scope: str, key: str) -> int | None:
    """A head count from the sub-config at ``scope`` (the whole config for "")."""
    value = config.sub_config(scope).get(key) if config is not None else None
    return value if isinstance(value, int) else None


def label(scope: str, key: str) -> str:
    return f"{scope}.{key}" if scope else key


def head_problems(
    heads: dict[HeadKey, list[str]], partitions: dict[str, tuple[Rule, Partition]], config: ModelConfig | None, tp: int
) -> list[Problem]:
    """An error per head count that does not divide by ``tp``; a note where the KV heads are copied instead."""
    out = []
    for (scope, key), names in heads.items():
        count = head_count(config, scope, key)
        if not isinstance(count, int) or count % tp == 0:
            continue
        if all(head_replicas(partitions[n][1], tp) > 1 for n in names):
            out.append(
                Problem(
                    NOTE,
                    f"{label(scope, key)}={count} heads, fewer than the {tp} ranks: each is copied onto {tp // count} "
                    "ranks, those whose query heads use it (as vLLM runs it)",
                    names,
                )
            )
            continue
        fewer = f" (fewer than the {tp} ranks)" if count < tp else ""
        message = f"{label(scope, key)}={count} heads do not divide by tp={tp}{fewer}: a head would be cut"
        if key == KV_HEADS and tp % count == 0 and any(_whole_units(partitions[n][1]) for n in names):
            message = (
                f"{label(scope, key)}={count} heads, fewer than the {tp} ranks: a head copied onto a rank would "
                "not be whole quantization blocks or groups"
            )
        out.append(Problem(ERROR, message, names))
    return out


def _whole_units(partition: Partition) -> bool:
    """A quantized linear's cut in whole blocks, groups or packed words (no head copied whole)."""
    return isinstance(partition, Shard) and partition.whole


def tensor_problems(
    tensors: list[CheckedTensor], heads: dict[HeadKey, list[str]], config: ModelConfig | None, tp: int
) -> list[Problem]:
    """One problem per tensor problem, except splits already explained by a head count."""
    cut = [names for (scope, key), names in heads.items() if (head_count(config, scope, key) or tp) % tp]
    explained = {n for names in cut for n in names}
    grouped: dict[str, list[str]] = {}
    for row in tensors:
        for message in row.problems:
            if not (row.name in explained and "cannot be split" in message):
                grouped.setdefault(message, []).append(row.name)
    return [Problem(WARNING if m.startswith(NOT_IN_PLAN) else ERROR, m, names) for m, names in grouped.items()]


def check_convs(
    shapes: dict[str, Shape],
    partitions: dict[str, tuple[Rule, Partition]],
    tp: int,
    uneven: bool,
    tensors: list[CheckedTensor],
) -> None:
    """A depthwise ``conv1d`` has one channel per group: each rank's conv must hold exactly the channels
    its fused input projection hands it (all of them when that output is gathered or replicated)."""
    rows = {row.name: row for row in tensors}
    for name in shapes:
        if not name.endswith("linear_attn.conv1d.weight") or name not in partitions or rows[name].rank_shape is None:
            continue
        prefix = name[: -len("conv1d.weight")]
        proj = next((prefix + p for p in FUSED_INPUTS if prefix + p in partitions), None)
        if proj is None or rows[proj].rank_shape is None:
            continue
        (proj_rule, proj_partition), (_, conv_partition) = partitions[proj], partitions[name]
        channels, rows_total = shapes[name][0], shapes[proj][0]
        if proj_rule.gathered or isinstance(proj_partition, Replicate):
            fed = [channels] * tp
        else:
            per_rank = rank_shapes(proj_partition, shapes[proj], tp, uneven=uneven)
            fed = [s[0] * channels // rows_total for s in per_rank]
        held = [s[0] for s in rank_shapes(conv_partition, shapes[name], tp, uneven=uneven)]
        if held != fed:
            rows[name].problems.append(
                f"holds {held[0]} channels per rank but {proj.rsplit('.', 2)[-2]} hands it {fed[0]}: "
                "a depthwise conv needs the same channels (split it as its input projection)"
            )
        elif proj.endswith(FUSED_INPUTS[0]) and not proj_rule.gathered and proj_partition != conv_partition:
            rows[name].problems.append(
                f"split as {conv_partition.describe()} but its input in_proj_qkv as {proj_partition.describe()}: "
                "each rank would filter other channels than it holds"
            )


def padded_vocab(partition: Partition, shape: Shape, vocab: int | None, multiple: int, uneven: bool) -> int | None:
    """The vocab rows after padding (a tensor already longer than the config's vocab keeps its rows)."""
    if not isinstance(partition, Vocab):
        return None
    return padded_size(max(vocab or 0, shape[partition.dim]), multiple, uneven=uneven)


def vocab_problems(
    partitions: dict[str, tuple[Rule, Partition]],
    shapes: dict[str, Shape],
    vocab: int | None,
    tp: int,
    multiple: int,
    uneven: bool,
) -> list[Problem]:
    vocabs = {n: p for n, (_, p) in partitions.items() if isinstance(p, Vocab)}
    names = list(vocabs)
    if not names:
        return []
    size = max(vocab or 0, shapes[names[0]][vocabs[names[0]].dim])
    if uneven:
        if size % tp:
            return [Problem(WARNING, f"vocab {size} splits unevenly over tp={tp} (torch.chunk)", names)]
        return []
    padded = padded_size(size, multiple)
    if padded == size:
        return []
    return [
        Problem(WARNING, f"vocab {size} needs padding to {padded} rows (a multiple of {multiple}) for tp={tp}", names)
    ]


def quantization_findings(scheme: QuantScheme, tp: int) -> list[Problem]:
    """What the runtimes do with ``scheme`` at ``tp`` beyond the cut of each tensor: a note naming the scheme
    (every quantized tensor is cut with its weight, in whole units), and GPTQ act-order with groups, which vLLM
    0.32+ refuses under tensor parallelism (``gptq_utils.py``) while SGLang loads it with whole scales and zeros
    on each row-parallel rank (what reshard writes)."""
    found = [
        Problem(NOTE, f"quantized ({scheme.describe()}): scales, zeros and packed weights are cut with their weight")
    ]
    if scheme.method == "gptq" and scheme.act_order and scheme.group_size and tp > 1:
        found.append(
            Problem(
                WARNING,
                f"GPTQ act-order (desc_act) with group_size {scheme.group_size}: vLLM refuses it at tp > 1 "
                "(gptq_utils.py); SGLang loads it (row-parallel ranks keep scales and qzeros whole, as written here)",
            )
        )
    return found
