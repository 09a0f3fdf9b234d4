"""The config-family check made exact where transformers can tell: the model ``from_pretrained`` would build for the
config, on the ``meta`` device (no memory), must find every one of its tensors in the checkpoint; a tensor it lacks
is one transformers would initialise at random in the published model.

:func:`reshard.plans.check_family` (names' signatures and the tensors that tell model types apart) judges while
planning, with no import; this check needs transformers, whose import costs seconds of CPU, so a conversion
starts it in a child process (or on a thread) when planning ends (:func:`start`) and hears its answer before
publishing (:meth:`FamilyCheck.result`): the bytes move meanwhile, and a refusal still leaves nothing behind. The
build's answer is the same every time for the same config and code, and kept in reshard's cache
(``plans/skeleton.py``): a conversion of a config built before judges at once, with no import and no child. The decoder
layers held are counted against the config at once, with no import (:func:`check_counts`). Where transformers
cannot build the class (an unknown model type, a config it rejects), the model has sub-models, or some tensor of the
checkpoint is not the model's under its own name (transformers renames it on load: per-expert tensors fused, LoRA
wrappers), the signature check stands alone.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import sys
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from reshard.config import ModelConfig
from reshard.errors import ReshardError, shown
from reshard.plans import judged_families
from reshard.plans.lora import plain_name
from reshard.plans.skeleton import ModelSkeleton, build_skeleton, cached_skeleton

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
    problem = _judged(skeleton, plain, config)
    if problem is not None:
        raise problem


def _judged(skeleton: ModelSkeleton | ReshardError, plain: list[str], config: ModelConfig) -> ReshardError | None:
    """The refusal :func:`check_built_family` raises given the build's answer (a refusal of transformers' own, a
    model with sub-models: none, the signature check stands)."""
    if isinstance(skeleton, ReshardError) or skeleton.sub_models:
        return None
    return _missing(skeleton, set(plain), config)


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
    """:func:`check_built_family` running beside the conversion (or ``judged`` already, its ``refusal`` given);
    :meth:`result` waits for it and raises its refusal.

    Where the platform forks (Linux) and no other thread runs, the check runs in a child process forked from this
    one: it shares the torch already imported, and its pure-Python import and build then take another core instead
    of holding the interpreter lock that the thread moving bytes needs between its reads (on a thread, the check
    lengthened the conversion by about its own time; measured: docs/performance.md). Elsewhere it runs on a
    thread. A child that dies without answering is not taken as a pass: the check then runs here.
    """

    def __init__(
        self,
        config: ModelConfig | None,
        names: list[str],
        *,
        judged: bool = False,
        refusal: ReshardError | None = None,
    ) -> None:
        self._args = (config, names)
        self.judged = judged  # the answer is known already: result() does not wait
        self._error: ReshardError | None = refusal
        self._thread: threading.Thread | None = None
        self._child: tuple[int, int] | None = None  # (pid, read end of the pipe)
        if judged:  # from the cache's answer: nothing to run
            return
        if _can_fork():
            self._child = _fork_check(config, names)
            self._ender = weakref.finalize(self, _end_child, *self._child)  # a run failing first leaves no child
        else:
            self._thread = threading.Thread(target=self._run, name="reshard-family", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            check_built_family(*self._args)
        except ReshardError as err:
            self._error = err

    def result(self) -> None:
        """Wait for the check; raise its refusal, if any."""
        if self._child is not None:
            self._ender.detach()
            answer = _answer(*self._child)
            self._child = None
            if answer is None:
                self._run()
            elif answer.refusal is not None:
                detail, path, tensor, hint = answer.refusal
                self._error = ReshardError(detail, path=path, tensor=tensor, hint=hint)
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error


@dataclass(frozen=True)
class _Answer:
    """What the child found: None, or the refusal's fields."""

    refusal: tuple[str, str | None, str | None, str | None] | None


def _can_fork() -> bool:
    """Linux, one thread, and no process group (gloo's threads of a ``--workers`` run are not Python's to see)."""
    dist = sys.modules.get("torch.distributed")
    grouped = dist is not None and dist.is_available() and dist.is_initialized()
    return sys.platform == "linux" and hasattr(os, "fork") and threading.active_count() == 1 and not grouped


def _fork_check(config: ModelConfig | None, names: list[str]) -> tuple[int, int]:
    """Fork a child that runs the check and writes its :class:`_Answer` to a pipe; returns (pid, read end)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    code = 1  # the child: never returns into the caller's code
    try:
        os.close(read)
        try:
            check_built_family(config, names)
            answer = _Answer(None)
        except ReshardError as err:
            answer = _Answer((err.detail, err.path, err.tensor, err.hint))
        with os.fdopen(write, "wb") as pipe:
            pipe.write(pickle.dumps(answer))
        code = 0
    finally:
        os._exit(code)


def _answer(pid: int, read: int) -> _Answer | None:
    """The child's answer (None: it died without one), the child reaped."""
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        return None
    answer = pickle.loads(data)  # noqa: S301 - written by our own child process, through a pipe only it holds
    return answer if isinstance(answer, _Answer) else None


def _end_child(pid: int, read: int) -> None:
    """Stop and reap a child whose answer nobody waited for."""
    with contextlib.suppress(OSError):
        os.close(read)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


def start(config: ModelConfig | None, names: list[str]) -> FamilyCheck | None:
    """Start the check beside the conversion when the config can be judged against the names (else None: nothing
    to wait); a layer count past the tensors is refused at once. When reshard's cache holds the build's answer
    (``plans/skeleton.py`` ``cached_skeleton``), the check is judged here at once (``judged``: :meth:`FamilyCheck.
    result` does not wait, and a run of one process hears a refusal before moving any byte): no import, no child.

    Raises:
        ReshardError: the config has more layers than the checkpoint has tensors.
    """
    plain = sorted({plain_name(n) for n in names})
    if config is None or judged_families(config, plain) is None:
        return None
    check_counts(config, plain)
    if _over(config.raw, len(plain), COUNTS) is not None:  # not built: the signature check stands
        return None
    known = cached_skeleton(config)
    if known is not None:
        return FamilyCheck(config, names, judged=True, refusal=_judged(known, plain, config))
    return FamilyCheck(config, names)
