"""An engine core's worker processes: how one is started (``python -m switchboard.worker``, by
module name: the engine never imports ``worker/``; its environment), the handle on one, and
stopping them (after the shutdown call: wait, SIGTERM, wait, SIGKILL).

The executor (``executor``) decides what each worker is (its ``WorkerStartup``) and when.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

from switchboard.wire.codec import WORKER_STARTUP
from switchboard.wire.step_msgs import WorkerStartup

logger = logging.getLogger(__name__)

# libgomp reads its wait policy once, when torch loads it: it is the worker's environment, set
# here. A decode step's loops run on the kernels' own pool (``kernels/csrc/work_pool.c``), so the
# OpenMP team only runs torch's operators (a prefill's matmuls, a few large copies); spinning
# after each of those, it took the core the pool's thread and the other processes needed
# (tiny-llama at 32 streams on 2 cores: 27 % of the worker's cycles in libgomp's spin loop).
# Passive, it sleeps at once. An OMP_WAIT_POLICY of the operator's own is kept.
WORKER_OMP_WAIT_POLICY = "PASSIVE"


def worker_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment a worker process starts with: ``environ`` plus the OpenMP wait policy,
    unless ``environ`` sets one."""
    return {"OMP_WAIT_POLICY": WORKER_OMP_WAIT_POLICY, **environ}


WORKER_MODULE = "switchboard.worker"
WORKER_EXIT_GRACE_S = 5.0  # after the shutdown call, before SIGTERM
WORKER_TERM_GRACE_S = 4.0  # after SIGTERM, before SIGKILL


def process_stopped(pid: int) -> bool:
    """The kernel says the process is stopped (SIGSTOP, a debugger): state T or t."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class WorkerProcess:
    """The executor's handle on one worker process."""

    def __init__(
        self, rank: int, tp_rank: int, pp_rank: int, process: subprocess.Popen[bytes]
    ) -> None:
        self.rank = rank
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid


def start_worker(startup: WorkerStartup, env: dict[str, str]) -> WorkerProcess:
    argv = [sys.executable, "-m", WORKER_MODULE, "--startup-json"]
    argv.append(WORKER_STARTUP.encode(startup))
    process = subprocess.Popen(argv, close_fds=True, env=env)
    logger.info(
        "Started worker rank %d (TP %d, PP %d) pid %d",
        startup.rank,
        startup.tp_rank,
        startup.pp_rank,
        process.pid,
    )
    return WorkerProcess(startup.rank, startup.tp_rank, startup.pp_rank, process)


def terminate_workers(workers: list[WorkerProcess]) -> None:
    """Wait for the workers to exit (they were asked to), then SIGTERM, then SIGKILL."""
    alive = _wait_exit(workers, WORKER_EXIT_GRACE_S)
    for worker in alive:
        logger.warning("Worker rank %d (pid %d) still running: SIGTERM", worker.rank, worker.pid)
        worker.process.terminate()
    alive = _wait_exit(alive, WORKER_TERM_GRACE_S)
    for worker in alive:
        logger.warning("Worker rank %d (pid %d) ignored SIGTERM: SIGKILL", worker.rank, worker.pid)
        worker.process.kill()
    _wait_exit(alive, WORKER_TERM_GRACE_S)


def _wait_exit(workers: list[WorkerProcess], timeout_s: float) -> list[WorkerProcess]:
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        try:
            worker.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [w for w in workers if w.process.poll() is None]
