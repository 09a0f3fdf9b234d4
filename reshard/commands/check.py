"""``reshard check``: can this model be split M ways, and if not, why? A pre-flight report.

:func:`check_model` is pure: parameter names and full shapes, the config and a plan in, a
:class:`CheckReport` out. It finds parameters no rule covers, dims and head counts that do not divide
by the tp (naming the heads), a depthwise ``conv1d`` whose channels would not match what its fused
input projection hands it on each rank, the vocab padding needed, and a model with no TP plan at all.
:func:`check` reads only headers (or, for a bare ``config.json``, builds the model on the ``meta``
device) and never tensor data.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reshard.config import ModelConfig, load_config
from reshard.engine.open import OpenedCheckpoint, open_checkpoint
from reshard.errors import AmbiguousPartitionError, ReshardError, ShapeMismatchError
from reshard.options import ReadOptions
from reshard.partition import Partition, Replicate, Vocab, partition_to_dict, rank_shapes
from reshard.plans import Plan, Rule, select_plan
from reshard.plans.transformers_plan import build_skeleton
from reshard.vocab import padded_size

Shape = tuple[int, ...]
ERROR, WARNING = "error", "warning"

# Which head count a split tensor is cut by: (name pattern, config keys; "vision." reads vision_config).
HEAD_COUNTS = (
    (r"visual\..*attn\.(qkv|proj)\.", ("vision.num_heads",)),
    (r"self_attn\.(q_proj|o_proj)\.", ("num_attention_heads",)),
    (r"self_attn\.[kv]_proj\.", ("num_key_value_heads",)),
    (r"linear_attn\.(in_proj_qkv\.|conv1d\.)", ("linear_num_key_heads", "linear_num_value_heads")),
    (r"linear_attn\.(in_proj_qkvz|in_proj_ba)\.", ("linear_num_key_heads",)),
    (r"linear_attn\.(in_proj_[zab]\.|out_proj\.|A_log|dt_bias)", ("linear_num_value_heads",)),
)
FUSED_INPUTS = ("in_proj_qkv.weight", "in_proj_qkvz.weight")


@dataclass
class Problem:
    severity: str  # "error": cannot be split so; "warning": can, but read this
    message: str
    tensors: list[str] = field(default_factory=list)


@dataclass
class CheckedTensor:
    name: str
    shape: list[int]
    rule: str | None
    partition: dict[str, Any] | None
    rank_shape: list[int] | None  # rank 0's shape at the target tp (None when it cannot be split)
    problems: list[str] = field(default_factory=list)


@dataclass
class CheckReport:
    """Every parameter, its rule and per-rank shape, and every problem; ``ok`` when it splits ``tp`` ways."""

    source: str
    input: str  # "checkpoint" or "config"
    model_type: str | None
    plan: str
    tp: int
    uneven: bool
    tensors: list[CheckedTensor]
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not any(p.severity == ERROR for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


def check_model(
    shapes: dict[str, Shape],
    config: ModelConfig | None,
    plan: Plan,
    tp: int,
    *,
    vocab_size: int | None = None,
    uneven: bool = False,
    pad_multiple: int | None = None,
    source: str = "",
    kind: str = "checkpoint",
) -> CheckReport:
    """Check every parameter of ``shapes`` (full, unpadded shapes) against ``plan`` at ``tp`` ranks.

    Example:
        >>> from reshard.plans.llama import LLAMA_PLAN
        >>> check_model({"lm_head.weight": (10, 4)}, None, LLAMA_PLAN, 4).problems[0].message
        'vocab 10 needs padding to 12 rows (a multiple of 4) for tp=4'
    """
    problems: list[Problem] = []
    if not plan.rules:
        what = config.model_type if config and config.model_type else "this model"
        problems.append(Problem(ERROR, f"no TP plan for {what}: nothing says how to split it (pass --plan FILE)"))
    vocab = vocab_size if vocab_size is not None else config.vocab_size if config else None
    multiple = pad_multiple or tp
    tensors, heads, partitions = [], {}, {}
    for name, shape in shapes.items():
        rule = plan.match(name)
        label = None if rule is None else "(not in the plan: replicated)" if rule.implicit else rule.pattern
        row = CheckedTensor(name, list(shape), label, None, None)
        tensors.append(row)
        if rule is None:
            if plan.rules:
                row.problems.append("no rule covers it")
            continue
        try:
            partition = rule.resolve(config)
        except AmbiguousPartitionError as err:
            row.problems.append(err.detail)
            continue
        partitions[name] = (rule, partition)
        row.partition = partition_to_dict(partition)
        if rule.implicit and len(shape) >= 2:
            row.problems.append(f"not in the {plan.name} plan: every rank holds it whole")
        padded = _padded_vocab(partition, shape, vocab, multiple, uneven)
        try:
            row.rank_shape = list(rank_shapes(partition, shape, tp, padded=padded, uneven=uneven)[0])
        except ShapeMismatchError as err:
            row.problems.append(f"{partition.describe()} cannot be split {tp} ways: {err.detail}")
        if not isinstance(partition, Replicate) and not rule.gathered:  # gathered: computed whole after
            for key in _head_keys(name):
                heads.setdefault(key, []).append(name)
    problems += _head_problems(heads, config, tp)
    _check_convs(shapes, partitions, tp, uneven, tensors)
    problems += _tensor_problems(tensors, heads, config, tp)
    problems += _vocab_problems(partitions, shapes, vocab, tp, multiple, uneven)
    return CheckReport(source, kind, config.model_type if config else None, plan.name, tp, uneven, tensors, problems)


def _padded_vocab(partition: Partition, shape: Shape, vocab: int | None, multiple: int, uneven: bool) -> int | None:
    """The vocab rows after padding (a tensor already longer than the config's vocab keeps its rows)."""
    if not isinstance(partition, Vocab):
        return None
    return padded_size(max(vocab or 0, shape[partition.dim]), multiple, uneven=uneven)


def _head_keys(name: str) -> tuple[str, ...]:
    for pattern, keys in HEAD_COUNTS:
        if re.search(pattern, name):
            return keys
    return ()


def head_count(config: ModelConfig | None, key: str) -> int | None:
    """A head count from the config; ``vision.K`` reads ``vision_config.K``."""
    if config is None:
        return None
    if key.startswith("vision."):
        return (config.raw.get("vision_config") or {}).get(key.removeprefix("vision."))
    return config.get(key)


def _head_problems(heads: dict[str, list[str]], config: ModelConfig | None, tp: int) -> list[Problem]:
    out = []
    for key, names in heads.items():
        count = head_count(config, key)
        if isinstance(count, int) and count % tp:
            fewer = f" (fewer than the {tp} ranks)" if count < tp else ""
            out.append(
                Problem(ERROR, f"{key}={count} heads do not divide by tp={tp}{fewer}: a head would be cut", names)
            )
    return out


def _tensor_problems(
    tensors: list[CheckedTensor], heads: dict[str, list[str]], config: ModelConfig | None, tp: int
) -> list[Problem]:
    """One problem per tensor problem, except splits already explained by a head count."""
    explained = {n for key, names in heads.items() if (head_count(config, key) or tp) % tp for n in names}
    grouped: dict[str, list[str]] = {}
    for row in tensors:
        for message in row.problems:
            if not (row.name in explained and "cannot be split" in message):
                grouped.setdefault(message, []).append(row.name)
    return [Problem(WARNING if m.startswith("not in the") else ERROR, m, names) for m, names in grouped.items()]


def _check_convs(
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


def _vocab_problems(
    partitions: dict[str, tuple[Rule, Partition]],
    shapes: dict[str, Shape],
    vocab: int | None,
    tp: int,
    multiple: int,
    uneven: bool,
) -> list[Problem]:
    names = [n for n, (_, p) in partitions.items() if isinstance(p, Vocab)]
    if not names:
        return []
    size = max(vocab or 0, shapes[names[0]][partitions[names[0]][1].dim])
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


# ---------------------------------------------------------------- reading the input (headers only)


@dataclass(frozen=True)
class CheckOptions:
    tp: int
    plan: Path | str | None = None
    config: Path | None = None
    uneven: bool = False
    pad_multiple: int | None = None
    trust_pickle: bool = False


def check(path: Path, options: CheckOptions) -> CheckReport:
    """Check a checkpoint (its headers) or a bare ``config.json`` (its model built on ``meta``).

    Raises:
        ReshardError: unreadable input, rank shapes that do not join, or a config transformers cannot build.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        kind, config = "config", load_config(options.config or path)
        shapes = build_skeleton(config).shapes
        plan = select_plan(config, shapes, plan_file=options.plan)
        vocab = config.vocab_size
    else:
        read = ReadOptions(config=options.config, plan=options.plan, trust_pickle=options.trust_pickle)
        opened = open_checkpoint(path, read, target_tp=options.tp, read_bytes=False)
        kind, config, plan, vocab = "checkpoint", opened.source.config, opened.plan, opened.vocab.original
        shapes = _full_shapes(opened)
    return check_model(
        shapes,
        config,
        plan,
        options.tp,
        vocab_size=vocab,
        uneven=options.uneven,
        pad_multiple=options.pad_multiple,
        source=str(path),
        kind=kind,
    )


def _full_shapes(opened: OpenedCheckpoint) -> dict[str, Shape]:
    """Every tensor's canonical shape as a conversion would gather it; a tensor no rule covers whose ranks hold
    one shape keeps it (``check_model`` reports the missing rule)."""
    shapes = {}
    for tensor in opened.tensors:
        rank = [ref.shape for ref in tensor.refs]
        if tensor.shape is not None:
            shapes[tensor.name] = tensor.shape
        elif len(rank) == opened.source.tp and len(set(rank)) == 1 and opened.plan.match(tensor.name) is None:
            shapes[tensor.name] = rank[0]
        else:
            raise ReshardError(f"rank shapes {rank} do not join: {tensor.problem.detail}", tensor=tensor.name)
    return shapes
