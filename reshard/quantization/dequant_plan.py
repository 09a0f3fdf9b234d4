"""What ``convert --dtype`` does to each tensor: dequantize an FP8 weight with its scale, cast a float, keep the
rest, drop the quantization's companions. Pure: headers and ``quantization_config`` in, decisions out (no torch).

The formats dequantized (docs/quantization-dequant.md):

* ``quant_method: fp8`` (transformers' FineGrainedFP8, DeepSeek-V3/R1): ``weight`` FP8 and ``weight_scale_inv``
  per ``weight_block_size`` block (one per tensor without it); ``activation_scale`` (static activations) dropped.
* ``quant_method: compressed-tensors`` in the ``float-quantized`` / ``naive-quantized`` formats with 8-bit float
  weights (llm-compressor's FP8, FP8_DYNAMIC, FP8_BLOCK): ``weight`` FP8 and ``weight_scale`` per tensor, per
  channel or per block; ``input_scale`` dropped.

Closed world: every key of ``quantization_config`` is read, declared irrelevant with a reason, or refused by name,
and so is every quantization tensor; a method not dequantized here is refused as "dequantizing <method> is not
supported". Activation quantization is dropped on purpose: it is how a runtime runs FP8 matmuls, and a dequantized
model runs its activations in the float dtype it is written in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError, shown
from reshard.quantization.dequantize import Cast, Dequantize

# --dtype: the float dtypes a checkpoint can be written in, by name.
FLOAT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FLOATING = frozenset({"F16", "BF16", "F32", "F64"})
FP8 = frozenset({"F8_E4M3", "F8_E5M2"})
SCALE_CODES = FLOATING | {"F8_E8M0"}  # ue8m0 scales are powers of two, exact in float32
# Names quantization methods give the tensors they store beside a weight (only these are ever dropped).
COMPANIONS = ("weight_scale_inv", "weight_scale", "input_scale", "activation_scale")

# quant_method "fp8": each key read, or irrelevant to the dequantized weights (why).
FP8_READ = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "expert_dtype"}
FP8_IRRELEVANT = {
    "dequantize": "a load-time switch of transformers",
    "modules_to_not_convert": "unquantized modules store no scale and are cast as floats",
    "modules_to_convert": "the quantized modules are those that store a scale",
}
# quant_method "compressed-tensors".
CT_READ = {"quant_method", "config_groups", "format", "quantization_status", "kv_cache_scheme"}
CT_READ |= {"sparsity_config", "transform_config"}
CT_IRRELEVANT = {
    "ignore": "unquantized modules store no scale and are cast as floats",
    "global_compression_ratio": "a statistic",
    "version": "the writer's version; the storage is read from the other keys",
    "provider": "the writer's name",
}
CT_FORMATS = {"float-quantized", "naive-quantized"}
CT_STRATEGIES = {"tensor", "channel", "block"}
CT_WEIGHT_IRRELEVANT = {"observer", "observer_kwargs", "dynamic", "scale_dtype", "zp_dtype", "block_structure"}


@dataclass(frozen=True)
class Fp8Format:
    """How one checkpoint stores its FP8 weights.

    Attributes:
        method: ``quant_method``, for messages.
        scale: the companion holding each weight's scale.
        dropped: companions dropped (activation scales).
        blocks: the scale blocks the config allows; ``None`` stands for one scale per tensor, ``(1, 0)`` for one per
            row (0: every column).
        via_scale: the product is rounded to the scale's dtype before the target's (compressed-tensors).
    """

    method: str
    scale: str
    dropped: tuple[str, ...]
    blocks: tuple[tuple[int, int] | None, ...]
    via_scale: bool


@dataclass(frozen=True)
class Unit:
    """One target tensor of a ``--dtype`` conversion: the source tensors it is made of, and how."""

    sources: tuple[str, ...]
    target: str
    code: str
    transform: Dequantize | Cast | None


@dataclass(frozen=True)
class Recast:
    """Every tensor's fate: the units to write, the companions dropped, the problems found (all at once)."""

    units: tuple[Unit, ...]
    dropped: tuple[str, ...]
    problems: tuple[ReshardError, ...]
    dequantized: int


def fp8_format(config: Mapping[str, Any] | None, *, path: Path | None = None) -> Fp8Format | None:
    """The FP8 storage ``config``'s ``quantization_config`` describes (None when there is none); any other
    quantization is refused by name."""
    quant = (config or {}).get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ReshardError(f"quantization_config is {shown(quant)}, not a mapping", path=path)
    method = quant.get("quant_method")
    if method == "fp8":
        return _fine_grained(quant, path)
    if method == "compressed-tensors":
        return _compressed(quant, path)
    raise _unsupported(_named(method), path)


def _named(value: Any) -> str:
    """A short printable name as it is (``gptq``), anything else bounded by :func:`~reshard.errors.shown`."""
    return value if isinstance(value, str) and value.isprintable() and len(value) <= 40 else shown(value)


def _unsupported(what: str, path: Path | None, why: str = "") -> ReshardError:
    return ReshardError(
        f"dequantizing {what} is not supported{why}",
        path=path,
        hint="reshard dequantizes FP8 (quant_method fp8, compressed-tensors float-quantized); convert without --dtype "
        "to keep the quantized tensors",
    )


def _unknown_keys(quant: Mapping[str, Any], known: set[str], what: str, path: Path | None) -> None:
    unknown = sorted(str(k) for k in quant if k not in known)
    if unknown:
        raise ReshardError(f"{what} has keys the dequantizer does not know: {shown(unknown)}", path=path)


def _fine_grained(quant: Mapping[str, Any], path: Path | None) -> Fp8Format:
    """transformers' FineGrainedFP8 / DeepSeek-V3's ``quant_method: fp8``."""
    _unknown_keys(quant, FP8_READ | set(FP8_IRRELEVANT), "quantization_config (fp8)", path)
    if quant.get("fmt", "e4m3") != "e4m3":
        raise _unsupported(f"fp8 fmt {_named(quant.get('fmt'))}", path)
    if quant.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise _unsupported(f"fp8 scale_fmt {_named(quant.get('scale_fmt'))}", path)
    if quant.get("expert_dtype", "fp8") != "fp8":
        raise _unsupported(f"fp8 with expert_dtype {_named(quant.get('expert_dtype'))}", path)
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _unsupported(f"fp8 activation_scheme {_named(scheme)}", path)
    block = quant.get("weight_block_size")
    if block is not None and not (
        isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= 1 << 20 for b in block)
    ):
        raise ReshardError(f"weight_block_size {shown(block)} is not two positive sizes", path=path)
    return Fp8Format("fp8", "weight_scale_inv", ("activation_scale",), (tuple(block) if block else None,), False)


def _compressed(quant: Mapping[str, Any], path: Path | None) -> Fp8Format:
    """compressed-tensors with 8-bit float weights (llm-compressor's FP8 schemes)."""
    _unknown_keys(quant, CT_READ | set(CT_IRRELEVANT), "quantization_config (compressed-tensors)", path)
    if quant.get("quantization_status", "compressed") != "compressed":
        raise _unsupported(f"compressed-tensors in status {_named(quant.get('quantization_status'))}", path)
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quant.get(key):
            raise _unsupported(f"compressed-tensors with a {key}", path)
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ReshardError("compressed-tensors quantization_config has no config_groups", path=path)
    blocks: list[tuple[int, int] | None] = []
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise ReshardError(f"config_groups.{shown(name)} is not a mapping", path=path)
        _unknown_keys(
            group, {"targets", "weights", "input_activations", "output_activations", "format"}, "a group", path
        )
        fmt = group.get("format") or quant.get("format")
        weights = group.get("weights") or {}
        if not isinstance(weights, Mapping):
            raise ReshardError(f"config_groups.{shown(name)}.weights is {shown(weights)}, not a mapping", path=path)
        bits, kind = weights.get("num_bits"), weights.get("type")
        if fmt not in CT_FORMATS or bits != 8 or kind != "float":
            raise _unsupported(f"compressed-tensors {_named(fmt)} ({_named(kind)}, {_named(bits)} bits)", path)
        if group.get("output_activations"):
            raise _unsupported("compressed-tensors with output_activations", path)
        blocks.append(_ct_block(weights, path))
    return Fp8Format("compressed-tensors", "weight_scale", ("input_scale",), tuple(blocks), True)


def _ct_block(weights: Mapping[str, Any], path: Path | None) -> tuple[int, int] | None:
    """The scale block of one compressed-tensors group's weights (None: one per tensor; ``(1, 0)``: per row)."""
    known = {"num_bits", "type", "strategy", "symmetric", "group_size", "actorder"} | CT_WEIGHT_IRRELEVANT
    _unknown_keys(weights, known, "a group's weights", path)
    strategy = weights.get("strategy")
    if strategy not in CT_STRATEGIES or weights.get("symmetric") is False or weights.get("actorder"):
        raise _unsupported(f"compressed-tensors fp8 with strategy {_named(strategy)}", path)
    if strategy == "tensor":
        return None
    if strategy == "channel":
        return (1, 0)
    block = weights.get("block_structure")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= 1 << 20 for b in block)):
        raise ReshardError(f"block_structure {shown(block)} is not two positive sizes", path=path)
    return (block[0], block[1])


def recast(
    headers: Mapping[str, TensorHeader],
    config: Mapping[str, Any] | None,
    dtype: str,
    *,
    path: Path | None = None,
) -> Recast:
    """Every tensor of a checkpoint (``headers``: canonical shapes and dtype codes) written in ``dtype``.

    Raises:
        ReshardError: ``dtype`` is not a float dtype, or the quantization is one not dequantized here.
    """
    code = FLOAT_DTYPES.get(dtype)
    if code is None:
        raise ReshardError(f"--dtype {shown(dtype)} is not one of {', '.join(FLOAT_DTYPES)}")
    fmt = fp8_format(config, path=path)
    consumed: set[str] = set()
    units, dropped, problems = [], [], []
    for name, header in headers.items():
        if header.code in FP8:
            if fmt is not None:  # its scale belongs to it, even when it cannot be dequantized
                consumed.add(f"{name.rpartition('.')[0]}.{fmt.scale}")
            try:
                units.append(_dequantized(name, header, headers, fmt, code, path))
            except ReshardError as err:
                problems.append(err)
    for name, header in headers.items():
        if header.code in FP8 or name in consumed:
            continue
        if name.rpartition(".")[2] in COMPANIONS:
            weight = f"{name.rpartition('.')[0]}.weight"
            if fmt is not None and name.endswith(fmt.dropped) and weight in headers and headers[weight].code in FP8:
                dropped.append(name)
                continue
            problems.append(ReshardError("a quantization tensor without its FP8 weight", path=path, tensor=name))
        elif header.code in FLOATING and header.code != code:
            units.append(Unit((name,), name, code, Cast(code)))
        else:
            units.append(Unit((name,), name, header.code, None))
    dequantized = sum(isinstance(u.transform, Dequantize) for u in units)
    return Recast(tuple(units), tuple(sorted(dropped)), tuple(problems), dequantized)


def _dequantized(
    name: str,
    header: TensorHeader,
    headers: Mapping[str, TensorHeader],
    fmt: Fp8Format | None,
    code: str,
    path: Path | None,
) -> Unit:
    """The unit that dequantizes the FP8 tensor ``name`` with its scale, or the reason it cannot."""
    if fmt is None:
        raise ReshardError("an FP8 tensor, but config.json has no quantization_config", path=path, tensor=name)
    base, _, leaf = name.rpartition(".")
    scale_name = f"{base}.{fmt.scale}"
    scale = headers.get(scale_name)
    if leaf != "weight" or scale is None:
        raise ReshardError(f"an FP8 tensor without its {fmt.scale}", path=path, tensor=name)
    if len(header.shape) != 2:
        raise ReshardError(f"an FP8 weight of shape {list(header.shape)}: only 2-D weights", path=path, tensor=name)
    if scale.code not in SCALE_CODES:
        raise ReshardError(f"its {fmt.scale} is {scale.code}, not a float", path=path, tensor=name)
    block = _block_of(header.shape, scale.shape, fmt)
    if block is None:
        raise ReshardError(
            f"{fmt.scale} {list(scale.shape)} is not a scale grid of {list(header.shape)} "
            f"for the blocks its quantization_config ({fmt.method}) gives",
            path=path,
            tensor=name,
        )
    via = scale.code if fmt.via_scale and scale.code != "F32" else None
    return Unit((name, scale_name), name, code, Dequantize(block, code, via))


def _block_of(shape: tuple[int, ...], scale: tuple[int, ...], fmt: Fp8Format) -> tuple[int, int] | None:
    """The block of ``shape`` each scale covers, from the blocks the format allows and the scale's shape (per
    tensor: one value; per row: ``[rows, 1]``; blocks: ``[ceil(rows / r), ceil(cols / c)]``); None if none fits."""
    rows, cols = shape
    for block in fmt.blocks:
        if block is None:
            whole = (max(rows, 1), max(cols, 1))
            if math.prod(scale) == 1 and len(scale) <= 2:
                return whole
            continue
        block_rows, block_cols = block[0], block[1] or max(cols, 1)
        grid = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
        if tuple(scale) == grid:
            return (block_rows, block_cols)
    return None


def dequantized_config(raw: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """``config.json`` of the written model: no ``quantization_config``, its dtype ``dtype`` (under the keys the
    source uses, ``dtype`` when it names none)."""
    config = {k: v for k, v in raw.items() if k != "quantization_config"}
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    return config | dict.fromkeys(keys, dtype)
