"""SIGINT, SIGTERM, SIGHUP and SIGQUIT as an exception, so that a run stopped from outside unwinds like a failed one.

Python turns SIGINT into ``KeyboardInterrupt`` but lets SIGTERM end the process on the spot, SIGHUP (the terminal or
the ssh session closing) too, and SIGQUIT with a core, leaving a staged output folder (``.OUT.<random>.reshard-tmp``),
the output's lock or ``verify --roundtrip``'s temporary folder behind. Under :func:`handled` (the command line
installs it) each raises :class:`Interrupted` in the main thread instead, so every ``with`` block on the way out runs:
the worker threads are joined, the staged folder and the temporary folders are removed. After the first signal, more
signals are ignored until the command ends: a second Ctrl-C must not cut that cleanup short. :func:`deferred` holds a
signal off while a step must not be split (creating the staged folder, renaming the output into place) and raises it
after.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

# SIGPIPE is not among them: Python ignores it, so a closed pipe is an ``OSError`` (EPIPE) where it is written, which
# unwinds the same way; handling it would turn a closed socket of any thread (a Hub download) into a stop.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by ``signum`` (one of :data:`SIGNALS`); the exit code is ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    active = False  # the handler is installed
    fired = False  # an Interrupted was raised: ignore further signals
    pending: int | None = None  # a signal that arrived inside deferred()
    depth = 0


_state = _State()


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state.fired:
        return
    if _state.depth:
        _state.pending = signum
        return
    _state.fired = True
    raise Interrupted(signum)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Raise :class:`Interrupted` on any of :data:`SIGNALS` while inside (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread() or _state.active:
        yield
        return
    previous = {sig: signal.signal(sig, _handler) for sig in SIGNALS}
    _state.active, _state.fired, _state.pending, _state.depth = True, False, None, 0
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _state.active = False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold the :data:`SIGNALS` off inside (a step that must not be split); raise :class:`Interrupted` after it
    when one came. Outside :func:`handled` a plain block (Python's own SIGINT handling applies)."""
    if not _state.active or threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if _state.depth == 0 and _state.pending is not None and not _state.fired:
            signum, _state.pending, _state.fired = _state.pending, None, True
            raise Interrupted(signum)
