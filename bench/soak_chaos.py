"""The chaos side of bench/soak.py: the server's processes by role, a kill -9 of one of them every
interval, waiting until the killed role is back, and what the processes hold (RSS, open files,
shared-memory segments) for the leak report.

Roles are the process titles the launcher gives (``switchboard::Gateway_1`` -> ``Gateway_1``),
found among the descendants of the server's supervisor, so only processes this run started are
ever signalled. Roles are killed in random order, each once per round (a seeded shuffle), so no
process comes near its restart cap (5 within 300 s) and a run of a few minutes kills every role.

Not run by itself.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from switchboard.supervisor.processes import list_processes
from switchboard.wire.shm_ring import segment_prefix

BACK_TIMEOUT_S = 180.0  # an engine's restart is a fresh start: interpreter, workers, weights
GATEWAY_GRACE_S = 2.0  # a client may still hold a broken connection this long after the restart
SHM_DIR = "/dev/shm"


def roles(supervisor_pid: int) -> dict[str, int]:
    """Role (``Gateway_0``, ``EngineCore_DP1``, ``Worker_DP0_PP0_TP0``, ``Coordinator``) -> pid."""
    found = {}
    for process in list_processes(supervisor_pid):
        if process.pid != supervisor_pid:
            found[f"{process.role}_{process.rank}" if process.rank else process.role] = process.pid
    return found


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def open_files(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def mapped_segments(pid: int) -> set[str]:
    """The /dev/shm segments ``pid`` has mapped."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {Path(line.split()[-1]).name for line in f if f" {SHM_DIR}/" in line}
    except OSError:
        return set()


def ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http_url}/ready", timeout=5) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


@dataclasses.dataclass
class Kill:
    role: str
    pid: int
    at: float  # time.monotonic()
    back_after_s: float | None = None  # None: not back within BACK_TIMEOUT_S


class ServerWatch:
    """What this run saw of the server's processes: every pid per role, the segments they
    mapped, and their RSS / open files at the start and the end."""

    def __init__(self, supervisor_pid: int, log_path: Path) -> None:
        self.supervisor_pid = supervisor_pid
        self.log_path = log_path
        self.seen_pids: dict[str, set[int]] = {}
        self.segments: set[str] = set()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def snapshot(self, segments: bool = False) -> dict[str, int]:
        """The roles now; with ``segments``, also note the shm segments they have mapped."""
        current = roles(self.supervisor_pid)
        for role, pid in current.items():
            self.seen_pids.setdefault(role, set()).add(pid)
            if segments:
                self.segments |= mapped_segments(pid)
        return current

    def usage(self) -> dict[str, dict[str, float | int | None]]:
        return {
            role: {"pid": pid, "rss_mib": rss_mib(pid), "open_files": open_files(pid)}
            for role, pid in sorted(self.snapshot(segments=True).items())
        }

    def ring_segments(self) -> set[str]:
        """The shm ring segments of every engine this run saw (alive or not)."""
        prefixes = tuple(
            segment_prefix(pid)
            for role, pids in self.seen_pids.items()
            if role.startswith("EngineCore")
            for pid in pids
        )
        try:
            names = os.listdir(SHM_DIR)
        except FileNotFoundError:
            return set()
        return {n for n in names if n.startswith(prefixes)} if prefixes else set()

    def orphaned_segments(self) -> list[str]:
        """Segments of engines that are gone (killed and restarted), still in /dev/shm: the
        supervisor removes a dead engine's ring, so these are leaks."""
        alive = set(roles(self.supervisor_pid).values())
        gone = {
            segment_prefix(pid)
            for role, pids in self.seen_pids.items()
            if role.startswith("EngineCore")
            for pid in pids
            if pid not in alive
        }
        return sorted(n for n in self.ring_segments() if n.startswith(tuple(gone))) if gone else []

    def leftover_segments(self) -> list[str]:
        """After the server stopped: every segment it mapped or named that still exists."""
        try:
            existing = set(os.listdir(SHM_DIR))
        except FileNotFoundError:
            return []
        return sorted((self.segments & existing) | self.ring_segments())


class Chaos:
    """kill -9 of one role every ``interval_s`` (after the previous one is back), in a thread."""

    def __init__(
        self,
        watch: ServerWatch,
        http_urls: list[str],
        interval_s: float,
        rng: random.Random,
        on_kill: Callable[[Kill], None] = lambda _kill: None,
    ) -> None:
        self.watch = watch
        self.http_urls = http_urls  # gateway i's HTTP API
        self.interval_s = interval_s
        self.rng = rng
        self.kills: list[Kill] = []
        self.on_kill = on_kill
        self._lock = threading.Lock()
        self._outages: list[tuple[float, float]] = []  # a gateway's: kill -> back + grace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-chaos", daemon=True)
        self._order: list[str] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(BACK_TIMEOUT_S + 30)

    def gateway_outage_during(self, start: float, end: float) -> bool:
        """Whether a gateway was down (or just back) at some moment of [start, end]."""
        with self._lock:
            return any(o_start <= end and start <= o_end for o_start, o_end in self._outages)

    def _next_role(self, current: dict[str, int]) -> str:
        if not self._order:
            self._order = sorted(current)
            self.rng.shuffle(self._order)
        return self._order.pop()

    def _run(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            current = self.watch.snapshot(segments=True)
            role = self._next_role(current)
            pid = current.get(role)
            if pid is None:
                continue
            before = self.watch.log()
            kill = Kill(role, pid, time.monotonic())
            if role.startswith("Gateway"):
                with self._lock:
                    self._outages.append((kill.at, float("inf")))
            os.kill(pid, signal.SIGKILL)
            self.kills.append(kill)
            self.on_kill(kill)
            back = self._wait_back(role, pid, before)
            if back is not None:
                kill.back_after_s = back - kill.at
            if role.startswith("Gateway"):
                with self._lock:
                    self._outages[-1] = (kill.at, time.monotonic() + GATEWAY_GRACE_S)
            next_at = max(kill.at + self.interval_s, time.monotonic())

    def _wait_back(self, role: str, pid: int, log_before: str) -> float | None:
        """When the killed role is serving again (None: not within BACK_TIMEOUT_S)."""
        deadline = time.monotonic() + BACK_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.is_back(role, pid, log_before):
                return time.monotonic()
            time.sleep(0.25)
        return None

    def is_back(self, role: str, pid: int, log_before: str) -> bool:
        current = self.watch.snapshot()
        if current.get(role) in (None, pid):
            return False
        log = self.watch.log()
        if role.startswith(("EngineCore", "Worker")):
            rank = role.split("_DP", 1)[1].split("_")[0]
            line = f"(DP rank {rank}) READY"  # every gateway admits the restarted engine
            return log.count(line) >= log_before.count(line) + len(self.http_urls)
        if role.startswith("Gateway"):
            index = int(role.split("_", 1)[1])
            return ready(self.http_urls[index]) and all(
                log.count(f"(DP rank {rank}) READY") > log_before.count(f"(DP rank {rank}) READY")
                for rank in self.engine_ranks(current)
            )
        line = "Load table complete"  # the coordinator's table is rebuilt
        return log.count(line) > log_before.count(line)

    @staticmethod
    def engine_ranks(current: dict[str, int]) -> list[str]:
        return sorted(r.split("_DP", 1)[1] for r in current if r.startswith("EngineCore"))
