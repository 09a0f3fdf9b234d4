"""What ``convert --dtype`` does to each tensor: dequantize an FP8 weight with its scale, cast a float, keep the
rest, drop the quantization's companions. Pure: headers and the checkpoint's
:class:`~reshard.quantization.QuantScheme` in, decisions out (no torch).

The formats dequantized (docs/quantization-dequant.md):

* ``quant_method: fp8`` (transformers' FineGrainedFP8, DeepSeek-V3/R1): ``weight`` FP8 and ``weight_scale_inv``
  per ``weight_block_size`` block; ``activation_scale`` (static activations) dropped.
* ``quant_method: compressed-tensors`` in the ``float-quantized`` format with 8-bit float weights (llm-compressor's
  FP8, FP8_DYNAMIC, FP8_BLOCK): ``weight`` FP8 and ``weight_scale`` per tensor, per channel or per block;
  ``input_scale`` dropped.

Closed world: ``quantization_config`` is read once, by :func:`reshard.quantization.read_scheme` (every key read,
declared irrelevant with a reason, or refused by name), and every quantization tensor is dequantized, dropped or
refused here; a method not dequantized here is refused as "dequantizing <method> is not supported". Activation
quantization is dropped on purpose: it is how a runtime runs FP8 matmuls, and a dequantized model runs its
activations in the float dtype it is written in.
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
from reshard.quantization.scheme import BLOCK, CHANNEL, COMPRESSED, FP8, TENSOR, QuantScheme

# --dtype: the float dtypes a checkpoint can be written in, by name.
FLOAT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FLOATING = frozenset({"F16", "BF16", "F32", "F64"})
FP8_CODES = frozenset({"F8_E4M3", "F8_E5M2"})
SCALE_CODES = FLOATING | {"F8_E8M0"}  # ue8m0 scales are powers of two, exact in float32
# Names quantization methods give the tensors they store beside a weight (only these are ever dropped).
COMPANIONS = ("weight_scale_inv", "weight_scale", "input_scale", "activation_scale")


@dataclass(frozen=True)
class Fp8Storage:
    """Where one checkpoint's FP8 weights keep their scales, from its :class:`~reshard.quantization.QuantScheme`.

    Attributes:
        method: ``quant_method``, for messages.
        scale: the companion holding each weight's scale.
        dropped: companions dropped (activation scales).
        block: the scale block; ``None`` stands for one scale per tensor, ``(1, 0)`` for one per row (0: every
            column).
        via_scale: the product is rounded to the scale's dtype before the target's (compressed-tensors).
    """

    method: str
    scale: str
    dropped: tuple[str, ...]
    block: tuple[int, int] | None
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


def fp8_storage(scheme: QuantScheme | None, *, path: Path | None = None) -> Fp8Storage | None:
    """How the FP8 weights of a checkpoint of ``scheme`` keep their scales (None without a scheme). ``scheme`` is
    its ``quantization_config`` as :func:`~reshard.quantization.read_scheme` read it: the one parser, closed world.

    Raises:
        ReshardError: a quantization other than FP8 weights (the int4 formats), refused by name.
    """
    if scheme is None:
        return None
    if scheme.method == FP8 and scheme.strategy == BLOCK:
        return Fp8Storage(FP8, "weight_scale_inv", ("activation_scale",), scheme.block, False)
    if scheme.method == COMPRESSED and scheme.bits == 8 and not scheme.packed:
        block = {TENSOR: None, CHANNEL: (1, 0), BLOCK: scheme.block}[scheme.strategy]
        return Fp8Storage(COMPRESSED, "weight_scale", ("input_scale",), block, True)
    raise ReshardError(
        f"dequantizing {scheme.describe()} is not supported",
        path=path,
        hint="reshard dequantizes FP8 (quant_method fp8, compressed-tensors float-quantized); convert without --dtype "
        "to keep the quantized tensors",
    )


def recast(
    headers: Mapping[str, TensorHeader],
    scheme: QuantScheme | None,
    dtype: str,
    *,
    path: Path | None = None,
) -> Recast:
    """Every tensor of a checkpoint (``headers``: canonical shapes and dtype codes; ``scheme``: its
    ``quantization_config`` as :func:`~reshard.quantization.read_scheme` read it) written in ``dtype``.

    Raises:
        ReshardError: ``dtype`` is not a float dtype, or the quantization is one not dequantized here.
    """
    code = FLOAT_DTYPES.get(dtype)
    if code is None:
        raise ReshardError(f"--dtype {shown(dtype)} is not one of {', '.join(FLOAT_DTYPES)}")
    fmt = fp8_storage(scheme, path=path)
    consumed: set[str] = set()
    units, dropped, problems = [], [], []
    for name, header in headers.items():
        if header.code in FP8_CODES:
            if fmt is not None:  # its scale belongs to it, even when it cannot be dequantized
                consumed.add(f"{name.rpartition('.')[0]}.{fmt.scale}")
            try:
                units.append(_dequantized(name, header, headers, fmt, code, path))
            except ReshardError as err:
                problems.append(err)
    for name, header in headers.items():
        if header.code in FP8_CODES or name in consumed:
            continue
        if name.rpartition(".")[2] in COMPANIONS:
            weight = f"{name.rpartition('.')[0]}.weight"
            quantized = weight in headers and headers[weight].code in FP8_CODES
            if fmt is not None and name.endswith(fmt.dropped) and quantized:
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
    fmt: Fp8Storage | None,
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


def _block_of(shape: tuple[int, ...], scale: tuple[int, ...], fmt: Fp8Storage) -> tuple[int, int] | None:
    """The block of ``shape`` each scale covers, from the format's block and the scale's shape (per tensor: one
    value; per row: ``[rows, 1]``; blocks: ``[ceil(rows / r), ceil(cols / c)]``); None if it does not fit."""
    rows, cols = shape
    if fmt.block is None:
        return (max(rows, 1), max(cols, 1)) if math.prod(scale) == 1 and len(scale) <= 2 else None
    block_rows, block_cols = fmt.block[0], fmt.block[1] or max(cols, 1)
    grid = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    return (block_rows, block_cols) if tuple(scale) == grid else None


def dequantized_config(raw: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """``config.json`` of the written model: no ``quantization_config``, its dtype ``dtype`` (under the keys the
    source uses, ``dtype`` when it names none)."""
    config = {k: v for k, v in raw.items() if k != "quantization_config"}
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    return config | dict.fromkeys(keys, dtype)
