"""How many intra-op (OpenMP) threads a worker's torch uses.

The default gives each worker an equal share of the CPUs this process may run on: the cores in
its affinity mask, capped by a cgroup v2 CPU quota (a Kubernetes CPU limit), divided by the
workers that share the host (every worker of every engine that ``switchboard serve`` starts).
The gateway and the engine core get no core of their own: on a 2-core machine a worker with two
threads served tiny-llama at 8 concurrent streams 30 % faster than with one, the gateway and the
engine core (10-15 % of a core together) notwithstanding. ``--torch-threads N`` overrides it.

The same count sizes the C kernels' work pool (``kernels/csrc/work_pool.c``), which runs a decode
step's loops without OpenMP's end-of-loop barrier. The executor starts the worker with
``OMP_WAIT_POLICY=PASSIVE`` (unless the environment sets one): torch's own OpenMP team then
sleeps as soon as an operator is done instead of spinning for the core the pool's thread and
the other processes need. Idle, neither takes CPU.
"""

from __future__ import annotations

import math
import os

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def usable_cpus(cpu_max_path: str = CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 quota if one is set."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        with open(cpu_max_path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    try:
        limit = math.ceil(int(quota) / int(period))
    except (ValueError, ZeroDivisionError):
        return cpus
    return max(1, min(cpus, limit))


def auto_torch_threads(workers_on_host: int, cpus: int | None = None) -> int:
    """An equal share of the usable CPUs for each of ``workers_on_host`` workers (at least 1)."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, cpus // max(1, workers_on_host))


def torch_threads(configured: int, workers_on_host: int, cpus: int | None = None) -> int:
    """``configured`` if set (> 0), else :func:`auto_torch_threads`."""
    return configured if configured > 0 else auto_torch_threads(workers_on_host, cpus)
