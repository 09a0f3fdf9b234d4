"""Several processes converting one checkpoint: ``torchrun ... -m reshard convert`` or ``convert --workers P``.

Every process opens and plans the checkpoint itself (planning reads headers only and is deterministic), so all
agree on every output file without exchanging a plan. The data files are shared out by bytes
(:func:`reshard.engine.run.worker_shares.assign`); each process reads the tensors its files hold and writes only its
files, in one staged folder on a file system they all see. Rank 0 makes that folder and publishes it, after a gather of
every tensor's manifest facts: the output and the manifest are the same bytes for any number of processes.

The processes talk through ``torch.distributed`` with the gloo backend (CPU only), set up from the environment
torchrun gives (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); :func:`launch` starts the same on
one machine. A process that fails sends its error to the others at the next gather, so all stop with the same
line naming it; one that dies breaks the others' connections, and they stop too.

Joining the group is bounded: a worker that died (or never started) before joining would otherwise keep the
others waiting a day. :func:`join` waits :data:`SETUP_TIMEOUT` seconds (``RESHARD_WORKER_TIMEOUT``, which
``convert --worker-timeout`` sets for its workers), on a thread, so that a stopping signal ends the wait.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from reshard.errors import ReshardError

# A gather waits for the slowest process's share of the whole conversion: hours for a terabyte.
TIMEOUT = timedelta(days=1)
# Joining the group waits this long for every worker (seconds); the environment variable changes it.
SETUP_TIMEOUT = 60.0
SETUP_TIMEOUT_ENV = "RESHARD_WORKER_TIMEOUT"

T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """This process's place among the workers of one conversion."""

    rank: int
    size: int

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        import torch.distributed as dist

        box = [value]
        self._collective(dist.broadcast_object_list, box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        import torch.distributed as dist

        values: list[Any] = [None] * self.size
        self._collective(dist.all_gather_object, values, value)
        return values

    def _collective(self, call: Any, *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except RuntimeError as err:  # gloo: a peer's connection closed (it died) or timed out
            why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ReshardError(f"a worker was lost ({why})", hint="nothing was published") from err

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def together(group: Group, work: Callable[[], T]) -> list[T]:
    """``work()`` on every worker; every worker's result, in rank order. If any worker failed, every worker
    raises the same one line, naming the first that failed and why (a signal is not caught: the process ends,
    and the others find it lost at this gather)."""
    try:
        result, error = work(), None
    except ReshardError as err:
        result, error = None, err.one_line()
    except Exception as err:  # noqa: BLE001 - a worker's failure, of any kind, must reach the others
        where = f"{err.filename}: " if isinstance(err, OSError) and err.filename else ""
        result, error = None, f"{where}{getattr(err, 'strerror', None) or err}"
    outcomes = group.gather((error, result))
    for rank, (failure, _) in enumerate(outcomes):
        if failure is not None:
            raise ReshardError(f"worker {rank}: {failure}", hint="nothing was published")
    return [outcome for _, outcome in outcomes]


def join() -> Group | None:
    """The group torchrun (or :func:`launch`) started this process in; None when it runs alone."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    import torch  # noqa: F401 - first, as it waits for an import of torch under way on another thread
    import torch.distributed as dist  # which this alone would not: it would run on a half-imported torch

    if not dist.is_initialized():
        seconds = setup_timeout()
        failure = _interruptible(lambda: dist.init_process_group("gloo", timeout=timedelta(seconds=seconds)))
        if failure is not None:
            why = str(failure).strip().splitlines()[0] if str(failure).strip() else type(failure).__name__
            raise ReshardError(
                f"the workers did not all join within {seconds:g} s ({why})",
                hint=f"a worker died or was not started, or MASTER_ADDR / MASTER_PORT differ; "
                f"--worker-timeout or {SETUP_TIMEOUT_ENV} sets the wait; nothing was written",
            )
        dist.distributed_c10d._set_pg_timeout(TIMEOUT)  # the gathers wait for the slowest share
    return Group(dist.get_rank(), dist.get_world_size())


def setup_timeout() -> float:
    """How long joining the group may take: ``RESHARD_WORKER_TIMEOUT`` seconds, else :data:`SETUP_TIMEOUT`."""
    raw = os.environ.get(SETUP_TIMEOUT_ENV, "").strip()
    if not raw:
        return SETUP_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= TIMEOUT.total_seconds()):
        raise ReshardError(
            f"{SETUP_TIMEOUT_ENV}={raw[:40]!r} is not a number of seconds between 0 and {TIMEOUT.total_seconds():g}"
        )
    return seconds


def _interruptible(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` on a thread while this one waits in short steps: a signal's handler runs meanwhile (a call
    blocked in C++ would hold it off), and ends the wait. The exception ``call`` raised, or None."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            failure.append(err)

    thread = threading.Thread(target=target, name="reshard-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    return failure[0] if failure else None


def launch(argv: list[str], workers: int) -> int:
    """Run ``python -m reshard *argv`` as ``workers`` processes of one group on this machine (what
    ``torchrun --standalone --nproc-per-node workers -m reshard *argv`` starts); their exit code.

    Rank 0 keeps this terminal (report, progress bars, its error line); the others' output is shown only if they
    fail without rank 0 saying why. When rank 0 fails, or this process is stopped, the others are stopped too.
    """
    port = _free_port()
    procs = []
    for rank in range(workers):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(workers),
            "LOCAL_WORLD_SIZE": str(workers),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        quiet = subprocess.DEVNULL if rank else None
        stderr = subprocess.PIPE if rank else None
        procs.append(subprocess.Popen([sys.executable, "-m", "reshard", *argv], env=env, stdout=quiet, stderr=stderr))
    try:
        codes = [procs[0].wait()]
        for proc in procs[1:]:
            if codes[0] != 0 and proc.poll() is None:
                proc.terminate()
            codes.append(proc.wait())
    except BaseException:  # this process stopped (a signal): stop the workers too, and let them clean up
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait()
        raise
    if codes[0] == 0 and any(codes[1:]):
        failed = next(rank for rank, code in enumerate(codes) if code)
        pipe = procs[failed].stderr  # a worker's (rank > 0) is a pipe
        message = pipe.read().decode(errors="replace").strip().splitlines() if pipe is not None else []
        sys.stderr.write((message[-1] if message else f"Error: worker {failed} exited with {codes[failed]}") + "\n")
        return codes[failed] if codes[failed] > 0 else 2
    return codes[0] if codes[0] >= 0 else 128 - codes[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
