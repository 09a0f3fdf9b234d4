"""Where each stored tensor of a quantized linear sits on the linear's two axes: the declarative table.

A quantized linear ``M`` (``weight`` ``[out, in]`` before quantization) stores companions ``M.<suffix>``. For
each stored dim of a companion the table names the linear's axis it runs along (:data:`OUT`, :data:`IN`, or
none) and how many of that axis's elements one stored element stands for: ``1``, :data:`PACK` (eight int4
in an int32), :data:`BLOCK_ROWS` / :data:`BLOCK_COLUMNS` (an fp8 weight block), :data:`GROUP` (an int4 group)
or :data:`WHOLE` (one scale for the whole axis: per-channel scales on the input axis). A companion without
dims (``weight_shape``, global and activation scales) is whole on every rank. The cut of the linear, as the
model's plan gives it for ``M.weight``, becomes each companion's cut through this table
(:mod:`reshard.quantization.plan`); the runtimes' per-rank rules are that every stored element of a rank
covers whole elements of the rank's slice (vLLM ``validate_fp8_block_shape``, ``marlin.py``, ``auto_awq.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import lcm

from reshard.quantization.scheme import AWQ, BLOCK, CHANNEL, COMPRESSED, FP8, GPTQ, GROUP, TENSOR, QuantScheme

OUT, IN = 0, 1  # the axes of the linear's weight [out, in]
PACK, BLOCK_ROWS, BLOCK_COLUMNS, GROUP_SIZE, WHOLE = 8, "block_rows", "block_columns", "group", "whole"


@dataclass(frozen=True)
class Axis:
    """One stored dim: the linear's axis it runs along (``None``: neither) and what one element stands for."""

    axis: int | None
    per: int | str = 1


@dataclass(frozen=True)
class Companion:
    """A stored tensor of a quantized linear; ``dims`` empty: the same whole tensor on every rank."""

    suffix: str
    dims: tuple[Axis, ...] = ()
    weight: bool = False  # the one that holds the weights (its dtype and shape tell the linear's sizes)


_ROWS_COLUMNS = (Axis(OUT), Axis(IN))
_BLOCK_GRID = (Axis(OUT, BLOCK_ROWS), Axis(IN, BLOCK_COLUMNS))
_FP8_BLOCK = (
    Companion("weight", _ROWS_COLUMNS, weight=True),
    Companion("weight_scale_inv", _BLOCK_GRID),
    Companion("activation_scale"),
)
_CT_FP8 = {
    BLOCK: (
        Companion("weight", _ROWS_COLUMNS, True),
        Companion("weight_scale", (Axis(OUT, BLOCK_ROWS), Axis(IN, BLOCK_COLUMNS))),
    ),
    CHANNEL: (Companion("weight", _ROWS_COLUMNS, True), Companion("weight_scale", (Axis(OUT), Axis(IN, WHOLE)))),
    TENSOR: (Companion("weight", _ROWS_COLUMNS, True), Companion("weight_scale")),
}
_CT_INT4 = {
    GROUP: (
        Companion("weight_packed", (Axis(OUT), Axis(IN, PACK)), weight=True),
        Companion("weight_scale", (Axis(OUT), Axis(IN, GROUP_SIZE))),
        Companion("weight_zero_point", (Axis(OUT, PACK), Axis(IN, GROUP_SIZE))),
        Companion("weight_shape"),
    ),
    CHANNEL: (
        Companion("weight_packed", (Axis(OUT), Axis(IN, PACK)), weight=True),
        Companion("weight_scale", (Axis(OUT), Axis(IN, WHOLE))),
        Companion("weight_zero_point", (Axis(OUT, PACK), Axis(IN, WHOLE))),
        Companion("weight_shape"),
    ),
}
# GPTQ stores the transpose: qweight [in/8, out]. With act-order, every input row names its group in g_idx and
# the groups are not contiguous: scales and zeros stay whole on a row-parallel rank (SGLang, earlier vLLM).
_GPTQ = {
    False: (
        Companion("qweight", (Axis(IN, PACK), Axis(OUT)), weight=True),
        Companion("qzeros", (Axis(IN, GROUP_SIZE), Axis(OUT, PACK))),
        Companion("scales", (Axis(IN, GROUP_SIZE), Axis(OUT))),
        Companion("g_idx", (Axis(IN),)),
    ),
    True: (
        Companion("qweight", (Axis(IN, PACK), Axis(OUT)), weight=True),
        Companion("qzeros", (Axis(IN, WHOLE), Axis(OUT, PACK))),
        Companion("scales", (Axis(IN, WHOLE), Axis(OUT))),
        Companion("g_idx", (Axis(IN),)),
    ),
}
_AWQ = (
    Companion("qweight", (Axis(IN), Axis(OUT, PACK)), weight=True),
    Companion("qzeros", (Axis(IN, GROUP_SIZE), Axis(OUT, PACK))),
    Companion("scales", (Axis(IN, GROUP_SIZE), Axis(OUT))),
)
_INPUT_SCALES = (Companion("input_scale"), Companion("input_global_scale"), Companion("weight_global_scale"))


def companions(scheme: QuantScheme) -> tuple[Companion, ...]:
    """The stored tensors of one quantized linear of ``scheme``, the one holding the weights first. Without a
    group size (``group_size: -1``, one scale per output channel) a grouped dim is one group for the whole
    axis: whole on every rank that cuts that axis (vLLM ``auto_gptq.py``: scales whole on row-parallel)."""
    table = _table(scheme)
    if scheme.group_size is None:
        table = tuple(replace(c, dims=tuple(_whole_group(d) for d in c.dims)) for c in table)
    return table


def _whole_group(dim: Axis) -> Axis:
    return Axis(dim.axis, WHOLE) if dim.per == GROUP_SIZE else dim


def _table(scheme: QuantScheme) -> tuple[Companion, ...]:
    match scheme.method:
        case "fp8":
            return _FP8_BLOCK
        case "compressed-tensors" if scheme.packed:
            return _CT_INT4[GROUP if scheme.group_size else CHANNEL] + _INPUT_SCALES
        case "compressed-tensors":
            return _CT_FP8[scheme.strategy] + _INPUT_SCALES
        case "gptq":
            return _GPTQ[bool(scheme.act_order and scheme.group_size)]
        case "awq":
            return _AWQ
    raise ValueError(f"no companions for {scheme.method}")


def per_element(per: int | str, scheme: QuantScheme, full: int) -> int:
    """How many of the axis's ``full`` elements one stored element stands for, for ``scheme``."""
    if per == WHOLE:
        return full
    if per == BLOCK_ROWS or per == BLOCK_COLUMNS:
        assert scheme.block is not None
        return scheme.block[0 if per == BLOCK_ROWS else 1]
    if per == GROUP_SIZE:
        return scheme.group_size or full
    return int(per)


def alignment(scheme: QuantScheme, axis: int, full: int) -> int:
    """What a rank's share of the linear's ``axis`` must be a multiple of: every stored element whole, and for
    block fp8 the weight's block (vLLM ``validate_fp8_block_shape``)."""
    step = 1
    for companion in companions(scheme):
        for dim in companion.dims:
            if dim.axis == axis and dim.per != WHOLE:
                step = lcm(step, per_element(dim.per, scheme, full))
    return step


METHOD_NAMES = {FP8: "block fp8", COMPRESSED: "compressed-tensors", GPTQ: "GPTQ", AWQ: "AWQ"}


def runtime_rule(scheme: QuantScheme) -> str:
    """The per-rank rule the runtimes hold ``scheme``'s layers to, in words (with where vLLM says it)."""
    match scheme.method, scheme.strategy:
        case _, "block":
            rows, columns = scheme.block or (0, 0)
            where = "vLLM validate_fp8_block_shape"
            return f"{METHOD_NAMES[scheme.method]}: a rank holds whole {rows}x{columns} weight blocks ({where})"
        case "compressed-tensors", "group" | "channel" if scheme.packed:
            group = f"groups of {scheme.group_size} input columns, " if scheme.group_size else ""
            return (
                f"compressed-tensors int4: a rank holds whole {group}packed words of 8 (vLLM compressed_tensors_wNa16)"
            )
        case "gptq", _:
            group = f"groups of {scheme.group_size} input rows, " if scheme.group_size and not scheme.act_order else ""
            return f"GPTQ int4: a rank holds whole {group}packed words of 8 input rows and of 8 zeros (vLLM gptq)"
        case "awq", _:
            group = f"groups of {scheme.group_size} input rows, " if scheme.group_size else ""
            return f"AWQ int4: a rank holds whole {group}packed words of 8 output columns (vLLM auto_awq: out % 8)"
    return f"{METHOD_NAMES[scheme.method]} {scheme.strategy}: scales follow their rows"
