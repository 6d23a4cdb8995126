"""The supervisor's restart bookkeeping (``launcher.py`` acts on it): each process's budget of
restarts within a window, the backoff before each, the restarts due, and a dead engine core's
workers, which must be gone before its restart (they hold its device memory)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from dataclasses import dataclass

from switchboard.common.exit_codes import START_FAILED
from switchboard.supervisor.processes import descendants

logger = logging.getLogger("switchboard.supervisor.restarts")

RESTART_BACKOFF_S = 1.0  # first restart; doubles with each restart in the window
RESTART_BACKOFF_MAX_S = 30.0
WORKERS_GONE_WAIT_S = 10.0  # a dead engine's workers get this long to exit (then SIGKILL)
_DESCENDANTS_EVERY_S = 2.0  # how often the engines' worker pids are noted
# Every role the supervisor restarts under RestartPolicy "always" (each process its own budget).
RESTARTED_ROLES = ("EngineCore", "Gateway", "Coordinator")


@dataclass
class Child:
    role: str  # e.g. "Gateway_0", "EngineCore_DP0"
    process: subprocess.Popen[bytes]
    module: str = ""
    config_json: str = ""


@dataclass(frozen=True)
class RestartPolicy:
    """What the supervisor does when a child (engine core, gateway, coordinator) exits on its
    own."""

    mode: str = "never"  # always | never
    max_restarts: int = 5  # per process within window_s; one more stops the server
    window_s: float = 300.0

    @property
    def restarts(self) -> bool:
        return self.mode == "always"


def start_time(pid: int) -> str:
    """The process's start time (/proc/<pid>/stat field 22), "" if it is gone: tells a pid
    from a later process that reused it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class Restarts:
    """One supervisor's restarts under its :class:`RestartPolicy`."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.times: dict[str, list[float]] = {}  # role -> restarts in the window
        self.due: dict[str, tuple[float, Child]] = {}  # role -> (restart at, the dead child)
        # Each engine's workers as last seen (pid -> start time): a killed engine's workers
        # outlive it for a moment, holding its device memory; its restart waits for them.
        self.engine_workers: dict[str, dict[int, str]] = {}
        self.orphans: dict[str, tuple[float, dict[int, str]]] = {}  # role -> (deadline, pids)
        self._noted_at = 0.0

    def note_engine_workers(self, children: list[Child], now: float) -> None:
        """Note the running engine cores' workers (every ``_DESCENDANTS_EVERY_S`` at most)."""
        if not self.policy.restarts or now - self._noted_at < _DESCENDANTS_EVERY_S:
            return
        self._noted_at = now
        for child in children:
            if child.role.startswith("EngineCore") and child.process.poll() is None:
                pids = descendants(child.process.pid)
                self.engine_workers[child.role] = {
                    pid: start for pid in pids if (start := start_time(pid))
                }

    def schedule(self, child: Child, now: float) -> bool:
        """A child exited on its own: its restart is due after a backoff if the policy and its
        budget allow (True); False: the server stops."""
        policy = self.policy
        if not (policy.restarts and child.role.startswith(RESTARTED_ROLES)):
            return False
        if child.process.returncode == START_FAILED and child.role not in self.times:
            logger.error(
                "%s (pid %d) failed to start (its error is logged above): a restart would fail "
                "the same way; stopping the server",
                child.role,
                child.process.pid,
            )
            return False
        window = [t for t in self.times.get(child.role, []) if now - t < policy.window_s]
        if len(window) >= policy.max_restarts:
            logger.error(
                "%s exited again: %d restarts within %.0f s already; stopping the server",
                child.role,
                len(window),
                policy.window_s,
            )
            return False
        backoff = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** len(window))
        window.append(now)
        self.times[child.role] = window
        self.due[child.role] = (now + backoff, child)
        if child.role.startswith("EngineCore"):
            workers = self.engine_workers.pop(child.role, {})
            self.orphans[child.role] = (now + backoff + WORKERS_GONE_WAIT_S, workers)
        logger.error(
            "%s (pid %d) exited with code %s: restarting it in %.1f s (restart %d of %d "
            "within %.0f s)",
            child.role,
            child.process.pid,
            child.process.returncode,
            backoff,
            len(window),
            policy.max_restarts,
            policy.window_s,
        )
        return True

    def take_due(self, now: float) -> list[Child]:
        """The dead children whose restart is due now (their workers gone), no longer due."""
        ready = []
        for role, (at, dead) in list(self.due.items()):
            if now >= at and self.workers_gone(role, now):
                del self.due[role]
                ready.append(dead)
        return ready

    def workers_gone(self, role: str, now: float) -> bool:
        """The dead engine's workers have exited (they notice their parent is gone within a
        second or a step); past the deadline they are killed, by pid."""
        deadline, workers = self.orphans.get(role, (0.0, {}))
        alive = {pid for pid, start in workers.items() if start_time(pid) == start}
        if not alive:
            self.orphans.pop(role, None)
            return True
        if now < deadline:
            return False
        for pid in alive:
            logger.warning("worker pid %d of the dead %s did not exit: killing it", pid, role)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return False
