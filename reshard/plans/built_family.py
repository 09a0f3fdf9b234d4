"""The config-family check made exact where transformers can tell: the model ``from_pretrained`` would build for the
config, on the ``meta`` device (no memory), must find every one of its tensors in the checkpoint; a tensor it lacks
is one transformers would initialise at random in the published model.

:func:`reshard.plans.check_family` (names' signatures and the tensors that tell model types apart) judges while
planning, with no import; this check needs transformers, whose import costs seconds of CPU, so a conversion starts
it on a thread when planning ends (:func:`start`) and hears its answer before publishing (:meth:`FamilyCheck.result`):
the bytes move meanwhile, and a refusal still leaves nothing behind. Where transformers cannot build the class (an
unknown model type, a config it rejects) or the model has sub-models (composite models rename tensors on load), the
signature check stands alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.plans import judged_families
from reshard.plans.lora import plain_name
from reshard.plans.skeleton import ModelSkeleton, build_skeleton

__all__ = ["FamilyCheck", "check_built_family", "start"]


def check_built_family(config: ModelConfig | None, names: Iterable[str]) -> None:
    """Refuse ``config`` when the model transformers builds for it has tensors that ``names`` lack (tied ones
    aside), naming the class and the counts.

    Raises:
        ReshardError: a tensor of the built model is not in the checkpoint.
    """
    plain = sorted({plain_name(n) for n in names})
    if config is None or judged_families(config, plain) is None:
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
    wanted = set(skeleton.shapes) - skeleton.tied
    missing = sorted(wanted - have)
    if not missing:
        return None
    shared = len(have & set(skeleton.shapes))
    where = f"{config.path}: " if config.path else ""
    return ReshardError(
        f"{where}transformers builds {skeleton.model_class} for this config (model_type {config.model_type!r}), and "
        f"{len(missing)} of its {len(skeleton.shapes)} tensors are not among the checkpoint's {len(have)} ({shared} "
        f"are), e.g. {missing[0]!r}: from_pretrained would initialise them at random",
        hint="pass the config.json of this checkpoint's model (--config)",
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
    """Start the check on a thread when the config can be judged against the names (else None: nothing to wait)."""
    if config is None or judged_families(config, sorted({plain_name(n) for n in names})) is None:
        return None
    return FamilyCheck(config, names)
