"""``quantization_config`` (config.json) read into a typed, pure description: what a runtime cuts by.

A quantized checkpoint's tensors can only be cut where the format's blocks, groups and packing allow, so the
fields that decide the storage are read here, once: the method, the weight block of block FP8, the group size
and bits of int4 formats, GPTQ's act-order, and the layers left unquantized. Closed world: a method not
listed in :data:`METHODS`, a field a method does not list as carried or irrelevant, or a value that changes
the storage in a way reshard does not plan (a second compressed-tensors group, sparsity, 3-bit GPTQ) is
refused by name. No torch, no file: :func:`read_scheme` takes the parsed config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError, shown

FP8, COMPRESSED, GPTQ, AWQ = "fp8", "compressed-tensors", "gptq", "awq"
METHODS = (FP8, COMPRESSED, GPTQ, AWQ)
BLOCK, GROUP, CHANNEL, TENSOR = "block", "group", "channel", "tensor"

# Fields each method may carry that do not change how the tensors are stored or cut (why, per method).
_IRRELEVANT = {
    FP8: {
        "quant_method": "read",
        "fmt": "e4m3 is the only stored fp8 type; the dtype is in the headers",
        "activation_scheme": "activations are quantized at run time (static: a replicated scalar per layer)",
        "weight_block_size": "read",
        "modules_to_not_convert": "read",
        "modules_to_convert": "read",
        "dequantize": "a loading option of transformers",
        "scale_fmt": "the scales' number format, not their layout",
        "expert_dtype": "read",
    },
    COMPRESSED: {
        "quant_method": "read",
        "format": "read",
        "config_groups": "read",
        "ignore": "read",
        "quantization_status": "read",
        "kv_cache_scheme": "read",
        "sparsity_config": "read",
        "transform_config": "read",
        "global_compression_ratio": "a statistic",
        "version": "the library's version",
        "provider": "who wrote it",
    },
    GPTQ: {
        "quant_method": "read",
        "bits": "read",
        "group_size": "read",
        "desc_act": "read",
        "act_group_aware": "a calibration choice; g_idx stores its result",
        "sym": "zeros are stored either way",
        "checkpoint_format": "read",
        "format": "read",
        "pack_dtype": "read",
        "method": "read",
        "damp_percent": "a calibration choice",
        "damp_auto_increment": "a calibration choice",
        "true_sequential": "a calibration choice",
        "static_groups": "a calibration choice; g_idx stores its result",
        "lm_head": "read",
        "meta": "who wrote it",
        "quantizer": "who wrote it",
        "mse": "a calibration choice",
        "v2": "a calibration choice",
        "v2_alpha": "a calibration choice",
        "hyb_act": "a calibration choice",
        "dynamic": "read",
        "modules_in_block_to_quantize": "which modules were quantized: told by their tensors",
        "tokenizer": "a loading option",
        "use_exllama": "a kernel choice of the loader",
        "exllama_config": "a kernel choice of the loader",
        "backend": "a kernel choice of the loader",
        "use_cuda_fp16": "a kernel choice of the loader",
        "model_seqlen": "a calibration choice",
        "block_name_to_quantize": "which modules were quantized: told by their tensors",
        "module_name_preceding_first_block": "a calibration choice",
        "batch_size": "a calibration choice",
        "pad_token_id": "a calibration choice",
        "max_input_length": "a loading option",
        "cache_block_outputs": "a calibration choice",
        "dataset": "a calibration choice",
        "modules_to_not_convert": "read",
        "fail_safe": "a calibration choice",
        "offload_to_disk": "a calibration choice",
        "rotation": "read",
    },
    AWQ: {
        "quant_method": "read",
        "bits": "read",
        "group_size": "read",
        "zero_point": "zeros are stored either way",
        "version": "read",
        "format": "read",
        "modules_to_not_convert": "read",
        "backend": "a kernel choice of the loader",
        "do_fuse": "a loading option",
        "fuse_max_seq_len": "a loading option",
        "modules_to_fuse": "a loading option",
        "exllama_config": "a kernel choice of the loader",
        "sym": "zeros are stored either way",
        "desc_act": "read",
        "checkpoint_format": "read",
        "pack_dtype": "read",
        "meta": "who wrote it",
        "method": "read",
        "quantizer": "who wrote it",
        "true_sequential": "a calibration choice",
        "damp_percent": "a calibration choice",
        "lm_head": "read",
        "dynamic": "read",
    },
}


# fp8: the values of the fields that could change what is stored (the first is the default).
_FP8_VALUES = {"fmt": ("e4m3",), "activation_scheme": ("dynamic", "static"), "scale_fmt": ("float", "ue8m0")}
# compressed-tensors: the fields of a config group and of its weights' scheme; the others are refused.
_CT_GROUP = {"targets", "weights", "input_activations", "output_activations", "format"}
_CT_WEIGHTS = {"num_bits", "type", "strategy", "symmetric", "group_size", "actorder", "dynamic", "block_structure"}
_CT_WEIGHTS |= {"observer", "observer_kwargs", "scale_dtype", "zp_dtype"}  # calibration choices; dtypes in headers


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's quantized linears are stored.

    Attributes:
        method: one of :data:`METHODS`.
        strategy: ``block`` (fp8 weight blocks), ``group`` (int4 groups), ``channel`` or ``tensor`` scales.
        bits: bits of a stored weight (8 for fp8, 4 for int4).
        packed: the weights are int4 packed 8 to an int32 (GPTQ, AWQ, compressed-tensors ``pack-quantized``).
        block: ``(rows, columns)`` of an fp8 weight block.
        group_size: input columns per scale of a grouped format (``None`` for one scale per channel).
        act_order: GPTQ ``desc_act``: each input row's group is read from ``g_idx``.
        symmetric: compressed-tensors stores no zero point when true.
        ignore: module names (or compressed-tensors ``re:`` patterns, or class names) left unquantized.
    """

    method: str
    strategy: str
    bits: int
    packed: bool
    block: tuple[int, int] | None = None
    group_size: int | None = None
    act_order: bool = False
    symmetric: bool = True
    ignore: tuple[str, ...] = ()

    def ignores(self, module: str) -> bool:
        """Whether ``module`` is left unquantized: named in the ignore list (whole name or last parts), or
        matched by one of compressed-tensors' ``re:`` patterns."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                try:
                    if re.match(entry[3:], module):
                        return True
                except re.error:
                    continue
            elif module == entry or module.endswith("." + entry):
                return True
        return False

    def describe(self) -> str:
        what = {
            BLOCK: f"{self.block[0]}x{self.block[1]} blocks" if self.block else "",
            GROUP: f"group {self.group_size}",
        }
        detail = what.get(self.strategy) or f"per-{self.strategy} scales"
        return f"{self.method} {self.bits}-bit, {detail}" + (", act-order" if self.act_order else "")


def read_scheme(config: Mapping[str, Any] | None, *, path: Path | None = None) -> QuantScheme | None:
    """The scheme of a config.json's ``quantization_config`` (``None`` when there is none).

    Raises:
        ReshardError: an unknown method or field, or a value reshard does not plan (named).
    """
    raw = config.get("quantization_config") if config is not None else None
    if raw is None:
        return None

    def refuse(detail: str) -> ReshardError:
        return ReshardError(
            f"quantization_config: {detail}",
            path=path,
            hint="reshard splits fp8 (block), compressed-tensors (int4 pack-quantized, fp8, int8 W8A8), "
            "gptq and awq (4-bit)",
        )

    if not isinstance(raw, Mapping):
        raise refuse("is not an object")
    method = raw.get("quant_method")
    if method not in METHODS:
        raise refuse(f"quant_method {shown(method)} is not one reshard knows ({', '.join(METHODS)})")
    unknown = sorted(str(k) for k in raw if k not in _IRRELEVANT[method])
    if unknown:
        raise refuse(f"{method} field(s) {shown(unknown)} unknown to reshard: they may change the storage")
    read = {FP8: _fp8, COMPRESSED: _compressed, GPTQ: _gptq, AWQ: _awq}[method]
    try:
        return read(raw)
    except (TypeError, ValueError) as err:
        raise refuse(str(err)) from None


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} {shown(value)} is not a positive integer")
    return value


def _names(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(value) > 100_000:
        raise ValueError(f"{what} is not a list of module names")
    return tuple(value)


def _fp8(raw: Mapping[str, Any]) -> QuantScheme:
    block = raw.get("weight_block_size")
    if block is None:
        raise ValueError("fp8 without weight_block_size (per-tensor scales) is not planned")
    if not isinstance(block, list) or len(block) != 2:
        raise ValueError(f"weight_block_size {shown(block)} is not [rows, columns]")
    if raw.get("expert_dtype", "fp8") != "fp8":
        raise ValueError(f"expert_dtype {shown(raw.get('expert_dtype'))} is not planned (fp8 only)")
    if raw.get("modules_to_convert"):
        raise ValueError("modules_to_convert (an allow-list of quantized modules) is not planned")
    for key, known in _FP8_VALUES.items():
        if raw.get(key, known[0]) not in known:
            raise ValueError(f"fp8 {key} {shown(raw.get(key))} is not planned ({', '.join(known)})")
    rows, columns = (_positive(b, "weight_block_size") for b in block)
    ignore = _names(raw.get("modules_to_not_convert"), "modules_to_not_convert")
    return QuantScheme(FP8, BLOCK, 8, False, block=(rows, columns), ignore=ignore)


def _compressed(raw: Mapping[str, Any]) -> QuantScheme:
    groups = raw.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise ValueError("config_groups must hold exactly one group (several schemes in one model are not planned)")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if raw.get(key):
            raise ValueError(f"{key} is not planned")
    if raw.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_status {shown(raw.get('quantization_status'))} is not planned (compressed)")
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(weights, Mapping):
        raise ValueError("the config group has no weights scheme")
    unknown = [str(k) for k in group if k not in _CT_GROUP] + [str(k) for k in weights if k not in _CT_WEIGHTS]
    if unknown:
        raise ValueError(f"config group field(s) {shown(unknown)} unknown to reshard: they may change the storage")
    if group.get("output_activations"):
        raise ValueError("output_activations (a stored output scale) is not planned")
    fmt = group.get("format") or raw.get("format")
    bits, kind = _positive(weights.get("num_bits"), "num_bits"), weights.get("type")
    strategy, size = weights.get("strategy"), weights.get("group_size")
    if weights.get("actorder") not in (None, "static", "group", "weight") or weights.get("dynamic"):
        raise ValueError(f"weights actorder {shown(weights.get('actorder'))} / dynamic weights are not planned")
    if weights.get("actorder") == "group":
        raise ValueError("weights actorder 'group' (a g_idx per layer) is not planned")
    ignore = _names(raw.get("ignore"), "ignore")
    symmetric = bool(weights.get("symmetric", True))
    if fmt == "pack-quantized" and kind == "int" and bits == 4:
        if strategy == GROUP:
            return QuantScheme(
                COMPRESSED,
                GROUP,
                4,
                True,
                group_size=_positive(size, "group_size"),
                symmetric=symmetric,
                ignore=ignore,
            )
        if strategy == CHANNEL:
            return QuantScheme(COMPRESSED, CHANNEL, 4, True, symmetric=symmetric, ignore=ignore)
    if fmt == "int-quantized" and kind == "int" and bits == 8 and strategy in (CHANNEL, TENSOR):
        if not symmetric:  # W8A8 int8 is symmetric; a zero point per channel is another tensor to cut
            raise ValueError("asymmetric int8 weights (a weight_zero_point per channel) are not planned")
        return QuantScheme(COMPRESSED, strategy, 8, False, ignore=ignore)  # W8A8 int8: stored as fp8 channel
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        if not symmetric or weights.get("actorder"):
            raise ValueError("fp8 weights with a zero point or an actorder are not planned")
        if strategy in (CHANNEL, TENSOR):
            return QuantScheme(COMPRESSED, strategy, 8, False, symmetric=symmetric, ignore=ignore)
        if strategy == BLOCK:
            block = weights.get("block_structure")
            if not isinstance(block, list) or len(block) != 2:
                raise ValueError(f"block_structure {shown(block)} is not [rows, columns]")
            rows, columns = (_positive(b, "block_structure") for b in block)
            return QuantScheme(COMPRESSED, BLOCK, 8, False, block=(rows, columns), ignore=ignore)
    raise ValueError(
        f"format {shown(fmt)} with {shown(kind)} {shown(bits)}-bit {shown(strategy)} weights is not planned"
    )


def _int4(raw: Mapping[str, Any], method: str, expected_format: str) -> tuple[int | None, tuple[str, ...]]:
    if raw.get("method", method) != method:
        raise ValueError(f"method {shown(raw.get('method'))} under quant_method {method}")
    if raw.get("bits") != 4:
        raise ValueError(f"bits {shown(raw.get('bits'))} is not planned (4 only)")
    fmt = raw.get("checkpoint_format") or raw.get("format") or raw.get("version") or expected_format
    if str(fmt).lower() != expected_format:
        raise ValueError(f"{method} format {shown(fmt)} is not planned ({expected_format} only)")
    if raw.get("pack_dtype", "int32") != "int32":
        raise ValueError(f"pack_dtype {shown(raw.get('pack_dtype'))} is not planned (int32 only)")
    for key in ("dynamic", "rotation", "lm_head"):
        if raw.get(key):
            raise ValueError(f"{key} is not planned")
    size = raw.get("group_size", -1)
    group = None if size == -1 else _positive(size, "group_size")
    return group, _names(raw.get("modules_to_not_convert"), "modules_to_not_convert")


def _gptq(raw: Mapping[str, Any]) -> QuantScheme:
    group, ignore = _int4(raw, GPTQ, "gptq")
    strategy = GROUP if group else CHANNEL
    return QuantScheme(GPTQ, strategy, 4, True, group_size=group, act_order=bool(raw.get("desc_act")), ignore=ignore)


def _awq(raw: Mapping[str, Any]) -> QuantScheme:
    if raw.get("desc_act"):
        raise ValueError("awq with desc_act is not planned")
    group, ignore = _int4(raw, AWQ, "gemm")
    return QuantScheme(AWQ, GROUP if group else CHANNEL, 4, True, group_size=group, ignore=ignore)
