"""Progress bars: tqdm on stderr, off under ``--json`` / ``--quiet`` and when ``TQDM_DISABLE`` is set."""

from __future__ import annotations


def quiet_unless(progress: bool) -> dict[str, bool]:
    """tqdm keyword arguments: off when ``progress`` is False, else tqdm's defaults, so that the
    ``TQDM_DISABLE`` environment variable (which tqdm only applies to arguments not passed) still works."""
    return {} if progress else {"disable": True}
