"""The ``reshard`` command line (click): the commands, their text rendering and the one output sink."""

import os

# numpy's OpenBLAS starts a thread per core (2 % of a profile's samples in its `blas_thread_server` though reshard
# does no BLAS math with numpy; torch's is MKL): on the 2-core bench VM, a tmpfs conversion without them took 0.85 x
# the CPU, paired runs (docs/performance.md). Set before numpy loads; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from reshard.cli.main import main, run  # noqa: E402

__all__ = ["main", "run"]
