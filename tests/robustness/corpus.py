"""The corpus: broken and hostile checkpoints, each a copy of a base (``bases.py``) with one thing damaged.

The cases are registered by the ``corpus_*`` modules (``cases.py`` says what a case holds); over a hundred,
across every layout.
"""

from __future__ import annotations

import corpus_hf  # noqa: F401  (registers its cases)
import corpus_ranks_dcp  # noqa: F401
import corpus_torch  # noqa: F401
from cases import CASES, Case

assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"

__all__ = ["CASES", "Case"]
