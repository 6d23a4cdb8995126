"""Process inspection and sizing: `switchboard ps` and `switchboard topology`.

Both read the process titles (``switchboard::<Role>_<ranks>``, docs/architecture.md), which
setproctitle writes into each process's command line, so `ps -eo pid,args | grep switchboard::`
and these commands agree.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

TITLE_PREFIX = "switchboard::"
_TITLE = re.compile(r"switchboard::(Gateway|EngineCore|Worker|Coordinator)(?:_(\S+))?")


@dataclass(frozen=True)
class SwitchboardProcess:
    pid: int
    role: str  # Gateway | EngineCore | Worker | Coordinator
    rank: str  # "0", "DP0", "DP0_PP0_TP1", "" for the coordinator
    cpu_seconds: float
    cpu_percent: float  # average over the process's lifetime
    ppid: int = 0


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _uptime_s() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def _parent_pids() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def descendants(root_pid: int) -> set[int]:
    """Pids below ``root_pid`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parent_pids().items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def list_processes(root_pid: int | None = None) -> list[SwitchboardProcess]:
    """Every running process whose title is a switchboard title, ordered by role then rank;
    with ``root_pid``, only that process and its descendants (one server's processes)."""
    found = []
    ticks, uptime = _clock_ticks(), _uptime_s()
    wanted = None if root_pid is None else descendants(root_pid) | {root_pid}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (wanted is not None and int(entry) not in wanted):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # the process ended while we looked
            continue
        match = _TITLE.match(args)
        if not match:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        age_s = max(uptime - int(fields[19]) / ticks, 1e-3)  # starttime
        found.append(
            SwitchboardProcess(
                pid=int(entry),
                role=match.group(1),
                rank=match.group(2) or "",
                cpu_seconds=cpu_s,
                cpu_percent=100.0 * cpu_s / age_s,
                ppid=int(fields[1]),
            )
        )
    order = {"Gateway": 0, "Coordinator": 1, "EngineCore": 2, "Worker": 3}
    return sorted(found, key=lambda p: (order[p.role], p.rank, p.pid))


def format_ps(processes: list[SwitchboardProcess]) -> str:
    lines = [f"{'ROLE':<12} {'RANK':<14} {'PID':>8} {'PPID':>8} {'CPU s':>9} {'CPU %':>7}"]
    for p in processes:
        rank = p.rank or "-"
        lines.append(
            f"{p.role:<12} {rank:<14} {p.pid:>8} {p.ppid:>8} {p.cpu_seconds:>9.1f} "
            f"{p.cpu_percent:>7.1f}"
        )
    lines.append(f"{len(processes)} switchboard processes")
    return "\n".join(lines)


@dataclass(frozen=True)
class Topology:
    api_servers: int
    data_parallel: int
    pipeline_parallel: int
    tensor_parallel: int

    @property
    def workers(self) -> int:
        return self.data_parallel * self.pipeline_parallel * self.tensor_parallel

    @property
    def coordinators(self) -> int:
        return 1 if self.data_parallel > 1 else 0

    @property
    def total(self) -> int:
        return self.api_servers + self.data_parallel + self.workers + self.coordinators

    @property
    def min_vcpus(self) -> int:
        """One physical core per process (the engine core busy-loops); a vCPU is half a core
        with hyper-threading."""
        return 2 * self.total

    def titles(self) -> list[str]:
        names = [f"Gateway_{i}" for i in range(self.api_servers)]
        names += [f"EngineCore_DP{r}" for r in range(self.data_parallel)]
        names += [
            f"Worker_DP{r}_PP{p}_TP{t}"
            for r in range(self.data_parallel)
            for p in range(self.pipeline_parallel)
            for t in range(self.tensor_parallel)
        ]
        names += ["Coordinator"] * self.coordinators
        return [TITLE_PREFIX + n for n in names]


def format_topology(topo: Topology) -> str:
    rows = [
        ("gateways (--api-servers)", topo.api_servers),
        ("engine cores (DP)", topo.data_parallel),
        ("workers (DP x PP x TP)", topo.workers),
        ("coordinator (DP > 1)", topo.coordinators),
    ]
    totals = [
        ("total processes", topo.total),
        ("minimum vCPUs (1 core = 2 vCPUs per process)", topo.min_vcpus),
    ]
    width = max(len(r[0]) for r in rows + totals) + 2
    lines = [f"{name:<{width}}{count:>5}" for name, count in rows]
    lines.append("-" * (width + 5))
    lines += [f"{name:<{width}}{count:>5}" for name, count in totals]
    return "\n".join(lines)
