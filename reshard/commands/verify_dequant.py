"""Each format's own dequantization arithmetic, in torch, for ``verify``'s per-rank check.

A rank's stored tensors of one quantized linear dequantize to the rank's slice of the linear's weight only if
every scale, zero and packed word is on the rank whose rows or columns it covers. A gathered comparison cannot
see a wrong cut (the bytes come back identical); dequantizing each rank's pieces on their own can. Every
function returns the weight ``[out, in]`` in float32 and raises ``ValueError`` when the pieces do not fit
together (the shapes of a wrong cut).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from reshard.quantization import QuantScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order of the 8 output columns within a packed word


def dequantize(scheme: QuantScheme, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One linear's weight ``[out, in]`` from its stored tensors (keyed by suffix: ``qweight``, ``scales``...)."""
    match scheme.method:
        case "fp8":
            return _blocks(stored["weight"], stored["weight_scale_inv"], scheme.block)
        case "compressed-tensors" if scheme.packed:
            return _compressed_int4(scheme, stored)
        case "compressed-tensors":
            if scheme.strategy == "block":
                return _blocks(stored["weight"], stored["weight_scale"], scheme.block)
            return stored["weight"].float() * stored["weight_scale"].float()
        case "gptq":
            return _gptq(scheme, stored)
        case "awq":
            return _awq(scheme, stored)
    raise ValueError(f"no dequantization for {scheme.method}")


def _blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """Block fp8: every ``rows x columns`` block times its scale (the last block of a dim may be partial)."""
    rows, columns = block or (1, 1)
    out, inp = weight.shape
    if scale.shape != (-(-out // rows), -(-inp // columns)):
        raise ValueError(f"scale grid {list(scale.shape)} does not cover a weight of {list(weight.shape)}")
    grid = scale.float().repeat_interleave(rows, 0)[:out].repeat_interleave(columns, 1)[:, :inp]
    return weight.float() * grid


def _nibbles(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words along the last dim -> 8 four-bit values each (word nibble ``k`` is element ``order[k]``)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    inverse = [order.index(k) for k in range(8)]
    return values[..., inverse].flatten(-2).to(torch.int32)


def _per_group(values: torch.Tensor, size: int, dim: int, group: int | None) -> torch.Tensor:
    """Group rows (``dim`` 0) or columns (``dim`` 1) repeated over the ``size`` elements they cover."""
    count = values.shape[dim]
    step = group if group else size
    if -(-size // step) != count:
        raise ValueError(f"{count} groups do not cover {size} elements in groups of {step}")
    return values.repeat_interleave(step, dim).narrow(dim, 0, size)


def _compressed_int4(scheme: QuantScheme, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors ``pack-quantized``: ``weight_packed [out, in/8]`` holds value + 8 per nibble,
    little-endian; ``weight_zero_point [out/8, groups]`` packed the same way along the output rows."""
    q = _nibbles(stored["weight_packed"]) - 8
    out, inp = q.shape
    scale = _per_group(stored["weight_scale"].float(), inp, 1, scheme.group_size)
    if "weight_zero_point" in stored:
        zeros = _nibbles(stored["weight_zero_point"].T).T - 8
        q = q - _per_group(zeros[:out], inp, 1, scheme.group_size)
    if scale.shape != q.shape:
        raise ValueError(f"scales of {list(scale.shape)} do not cover weights of {list(q.shape)}")
    return q.float() * scale


def _gptq(scheme: QuantScheme, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """GPTQ (v1 storage): ``qweight [in/8, out]`` packed along the input rows, zeros stored minus one,
    ``scales [groups, out]``; with act-order each input row's group is ``g_idx`` (whole model's groups)."""
    q = _nibbles(stored["qweight"].T).T  # [in, out]
    inp, out = q.shape
    zeros = _nibbles(stored["qzeros"]) + 1  # [groups, out]
    scales = stored["scales"].float()
    if scheme.act_order and "g_idx" in stored:
        groups = stored["g_idx"].long()
        if groups.shape != (inp,):
            raise ValueError(f"g_idx of {list(groups.shape)} for {inp} input rows")
        z, s = zeros[groups], scales[groups]
    else:
        z, s = (_per_group(t, inp, 0, scheme.group_size) for t in (zeros, scales))
    if s.shape != q.shape or z.shape[0] != inp or z.shape[1] < out:
        raise ValueError(f"scales {list(scales.shape)} and zeros do not cover qweight of {list(q.shape)}")
    return ((q - z[:, :out]).float() * s).T


def _awq(scheme: QuantScheme, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """AWQ GEMM: ``qweight [in, out/8]`` packed along the output columns in AutoAWQ's order, zeros the same
    way, ``scales [groups, out]``."""
    q = _nibbles(stored["qweight"], AWQ_ORDER)  # [in, out]
    inp, out = q.shape
    zeros = _per_group(_nibbles(stored["qzeros"], AWQ_ORDER), inp, 0, scheme.group_size)
    scales = _per_group(stored["scales"].float(), inp, 0, scheme.group_size)
    if scales.shape != q.shape or zeros.shape != q.shape:
        raise ValueError(f"scales {list(scales.shape)} and zeros do not cover qweight of {list(q.shape)}")
    return ((q - zeros).float() * scales).T
