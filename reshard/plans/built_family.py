"""The config-family check made exact where transformers can tell: the model ``from_pretrained`` would build for the
config, on the ``meta`` device (no memory), must find every one of its tensors in the checkpoint; a tensor it lacks
is one transformers would initialise at random in the published model.

:func:`reshard.plans.check_family` (names' signatures and the tensors that tell model types apart) judges while
planning, with no import; this check needs transformers, whose import costs about 2.5 s of CPU, so a conversion
starts it on a thread when planning ends (:func:`start`) and hears its answer before publishing
(:meth:`FamilyCheck.result`): the bytes move meanwhile, and a refusal still leaves nothing behind. The decoder
layers held are counted against the config at once, with no import (:func:`check_counts`). Where transformers
cannot build the class (an unknown model type, a config it rejects), the model has sub-models, or some tensor of the
checkpoint is not the model's under its own name (transformers renames it on load: per-expert tensors fused, LoRA
wrappers), the signature check stands alone.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable

from reshard.config import ModelConfig
from reshard.errors import ReshardError, shown
from reshard.plans import judged_families
from reshard.plans.lora import plain_name
from reshard.plans.skeleton import ModelSkeleton, build_skeleton

__all__ = ["FamilyCheck", "check_built_family", "check_counts", "start"]

HINT = "pass the config.json of this checkpoint's model (--config)"
# Layer counts: every layer has a tensor of its own, so more layers than the checkpoint has tensors is a refusal
# before anything is built (and a damaged count of 10^12 layers would take a build without end).
LAYER_COUNTS = frozenset({"num_hidden_layers", "n_layer"})
# Counts that size the build too, but need not each have a tensor (experts fused into one tensor per layer): past
# the checkpoint's tensors, the model is not built and the names' signatures judge alone.
COUNTS = frozenset({*LAYER_COUNTS, "num_experts", "num_local_experts", "n_routed_experts"})
# A transformers decoder layer's tensors (a top-level ``num_hidden_layers`` counts them).
DECODER_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _over(raw: object, tensors: int, keys: frozenset[str], depth: int = 0) -> tuple[str, object] | None:
    """A count of ``keys`` in the config (or its sub-configs) above ``tensors``, as ``(key, value)``."""
    if not isinstance(raw, dict) or depth > 3:
        return None
    for key, value in raw.items():
        if key in keys and isinstance(value, int) and value > tensors:
            return key, value
        found = _over(value, tensors, keys, depth + 1) if isinstance(value, dict) else None
        if found is not None:
            return found
    return None


def check_layer_count(config: ModelConfig, names: list[str]) -> None:
    """Refuse a config with more layers than ``names`` has tensors, before anything is built (no import)."""
    layers = _over(config.raw, len(names), LAYER_COUNTS)
    if layers is not None:
        raise ReshardError(
            f"{_where(config)}the config says {layers[0]} {shown(layers[1])}, more layers than the checkpoint has "
            f"tensors ({len(names)}): from_pretrained would initialise the missing ones at random",
            hint=HINT,
        )


def _where(config: ModelConfig) -> str:
    return f"{config.path}: " if config.path else ""


def check_built_family(config: ModelConfig | None, names: Iterable[str]) -> None:
    """Refuse ``config`` when the model transformers builds for it has tensors that ``names`` lack (tied ones
    aside), naming the class and the counts.

    Raises:
        ReshardError: a tensor of the built model is not in the checkpoint.
    """
    plain = sorted({plain_name(n) for n in names})
    if config is None or judged_families(config, plain) is None:
        return
    check_layer_count(config, plain)
    if _over(config.raw, len(plain), COUNTS) is not None:
        return
    try:
        skeleton = build_skeleton(config)
    except ReshardError:  # a class transformers cannot build from it: the signature check stands
        return
    if skeleton.sub_models:
        return
    problem = _missing(skeleton, set(plain), config)
    if problem is not None:
        raise problem


def _missing(skeleton: ModelSkeleton, have: set[str], config: ModelConfig) -> ReshardError | None:
    """The refusal when the built model lacks tensors; judged only where every tensor of the checkpoint is one of the
    model's under its own name: transformers renames others on load (per-expert tensors fused, LoRA wrappers), so
    a name missing then says nothing."""
    if not have <= set(skeleton.shapes):
        return None
    missing = sorted(set(skeleton.shapes) - skeleton.tied - have)
    if not missing:
        return None
    shared = len(have & set(skeleton.shapes))
    return ReshardError(
        f"{_where(config)}transformers builds {skeleton.model_class} for this config (model_type "
        f"{config.model_type!r}), and {len(missing)} of its {len(skeleton.shapes)} tensors are not among the "
        f"checkpoint's {len(have)} ({shared} are), e.g. {missing[0]!r}: from_pretrained would initialise them at "
        "random",
        hint=HINT,
    )


def check_counts(config: ModelConfig | None, names: Iterable[str]) -> None:
    """The part every conversion runs (no import): a config with more layers than the checkpoint has tensors, or
    than it holds decoder layers (``model.layers.{i}.``; extra layers, as DeepSeek-V3's multi-token prediction
    layer, are not refused: transformers ignores them).

    Raises:
        ReshardError: the config has more layers than the checkpoint holds.
    """
    plain = sorted({plain_name(n) for n in names})
    if config is None or judged_families(config, plain) is None:
        return
    check_layer_count(config, plain)
    held = {int(m.group(1)) for n in plain if (m := DECODER_LAYER.match(n))}
    said = config.raw.get("num_hidden_layers")
    if held and isinstance(said, int) and said > len(held & set(range(said))):
        missing = sorted(set(range(said)) - held)
        raise ReshardError(
            f"{_where(config)}the config says num_hidden_layers {said}, but the checkpoint holds {len(held)} decoder "
            f"layer(s) (layer {missing[0]} is missing): from_pretrained would initialise the missing ones at random",
            hint=HINT,
        )


class FamilyCheck:
    """:func:`check_built_family` running on a thread; :meth:`result` waits for it and raises its refusal."""

    def __init__(self, config: ModelConfig | None, names: list[str]) -> None:
        self._error: ReshardError | None = None
        self._thread = threading.Thread(target=self._run, args=(config, names), name="reshard-family", daemon=True)
        self._thread.start()

    def _run(self, config: ModelConfig | None, names: list[str]) -> None:
        try:
            check_built_family(config, names)
        except ReshardError as err:
            self._error = err

    def result(self) -> None:
        """Wait for the check; raise its refusal, if any."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def start(config: ModelConfig | None, names: list[str]) -> FamilyCheck | None:
    """Start the check on a thread when the config can be judged against the names (else None: nothing to wait);
    a layer count past the tensors is refused at once.

    Raises:
        ReshardError: the config has more layers than the checkpoint has tensors.
    """
    plain = sorted({plain_name(n) for n in names})
    if config is None or judged_families(config, plain) is None:
        return None
    check_counts(config, plain)
    return FamilyCheck(config, names)
