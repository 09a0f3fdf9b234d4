"""The ``reshard`` command line (click): the commands, their text rendering and the one output sink."""

import os

# numpy's OpenBLAS starts a thread per core, which spin and cost CPU though reshard does no BLAS math with numpy
# (torch's is MKL; measured: docs/performance.md). Set before numpy loads; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from reshard.cli.main import main, run  # noqa: E402

__all__ = ["main", "run"]
