"""Progress bars: tqdm on stderr, off under ``--json`` / ``--quiet`` and when ``TQDM_DISABLE`` is set."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any


class _NoBar:
    """What a run without a bar updates: nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        pass


def progress_bar(progress: bool, **options: Any) -> Any:
    """A tqdm bar on stderr with ``options`` when ``progress``, else one that shows nothing. tqdm is imported only
    for a bar shown: ``tqdm.auto`` brings asyncio and ``importlib.metadata``, a visible share of a quiet run's
    start-up (measured: docs/performance.md). Shown bars keep tqdm's defaults, so that ``TQDM_DISABLE``
    (which tqdm applies only to arguments not passed) still turns them off."""
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, **options)
