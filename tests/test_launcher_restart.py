"""The supervisor's restart budget, per process (engine cores, gateways, the coordinator):
backoff doubling, then fail-stop past the cap."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from switchboard.supervisor.launcher import Child, RestartPolicy, Supervisor


def dead_child(role: str) -> Child:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return Child(role, process, "switchboard.engine", "{}")


def test_an_engine_is_restarted_with_backoff_until_the_cap(tmp_path: Path) -> None:
    supervisor = Supervisor([], [], str(tmp_path), restart=RestartPolicy("always", 2, 60.0))
    delays = []
    for _ in range(2):
        child = dead_child("EngineCore_DP1")
        supervisor._children.append(child)
        assert supervisor._schedule_restart(child)
        assert child not in supervisor._children
        at, _ = supervisor._restarts.due.pop("EngineCore_DP1")
        delays.append(at)
    assert delays[1] > delays[0]  # 1 s, then 2 s
    child = dead_child("EngineCore_DP1")
    supervisor._children.append(child)
    assert not supervisor._schedule_restart(child), "the third death within the window stops"


def test_never_stops_the_server_on_any_death(tmp_path: Path) -> None:
    never = Supervisor([], [], str(tmp_path), restart=RestartPolicy("never"))
    for role in ("EngineCore_DP0", "Gateway_0", "Coordinator"):
        assert not never._schedule_restart(dead_child(role))


def test_a_gateway_and_the_coordinator_are_restarted_each_on_its_own_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each process has its own budget, and a gateway or the coordinator needs no engine-side
    cleanup (no ENGINE_CORE_DEAD, rings or workers to wait for)."""
    supervisor = Supervisor([], [], str(tmp_path), restart=RestartPolicy("always", 1, 300.0))
    with caplog.at_level(logging.ERROR, logger="switchboard.supervisor.restarts"):
        for role in ("Gateway_1", "Gateway_0", "Coordinator"):
            child = dead_child(role)
            supervisor._children.append(child)
            assert supervisor._schedule_restart(child), role
            assert child not in supervisor._children and role in supervisor._restarts.due
            line = (
                f"{role} (pid {child.process.pid}) exited with code 0: restarting it in 1.0 s "
                "(restart 1 of 1 within 300 s)"
            )
            assert line in caplog.text
    assert supervisor._dead_pids == [] and supervisor._restarts.orphans == {}
    again = dead_child("Gateway_1")
    supervisor._children.append(again)
    assert not supervisor._schedule_restart(again), "past its cap the server stops"
    assert supervisor._restarts.workers_gone("Gateway_0", now=0.0), "no workers to wait for"


def test_a_restart_waits_for_the_dead_engines_workers_then_kills_them(tmp_path: Path) -> None:
    """A killed engine's worker still holds its device memory: no restart while it lives; past
    the deadline it is killed (by pid), then the restart may go."""
    from switchboard.supervisor.restarts import start_time

    supervisor = Supervisor([], [], str(tmp_path), restart=RestartPolicy("always"))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = start_time(worker.pid)
        assert start
        supervisor._restarts.orphans["EngineCore_DP0"] = (100.0, {worker.pid: start})
        assert not supervisor._restarts.workers_gone("EngineCore_DP0", now=50.0)  # waits
        assert worker.poll() is None
        assert not supervisor._restarts.workers_gone("EngineCore_DP0", now=101.0)  # killed now
        worker.wait(10)
        assert supervisor._restarts.workers_gone("EngineCore_DP0", now=101.5)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def child_exiting_with(role: str, code: int) -> Child:
    process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    process.wait()
    return Child(role, process, "switchboard.engine", "{}")


def test_a_process_whose_first_start_failed_stops_the_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """START_FAILED on a first start (a bad model, a port in use) is not retried: each try
    would fail the same way. After a restart it is on the budget like any other exit."""
    from switchboard.common.exit_codes import START_FAILED

    supervisor = Supervisor([], [], str(tmp_path), restart=RestartPolicy("always", 3, 300.0))
    with caplog.at_level(logging.ERROR, logger="switchboard.supervisor.restarts"):
        for role in ("EngineCore_DP0", "Gateway_0"):
            failed = child_exiting_with(role, START_FAILED)
            supervisor._children.append(failed)
            assert not supervisor._schedule_restart(failed), role
            assert f"{role} (pid {failed.process.pid}) failed to start" in caplog.text
    assert supervisor._restarts.due == {}
    crashed = child_exiting_with("EngineCore_DP1", 1)
    supervisor._children.append(crashed)
    assert supervisor._schedule_restart(crashed), "a crash while serving is restarted"
    supervisor._restarts.due.clear()
    again = child_exiting_with("EngineCore_DP1", START_FAILED)
    supervisor._children.append(again)
    assert supervisor._schedule_restart(again), "a failed restart is on the budget"
