"""The environment the executor starts a worker with: the caller's, plus a passive OpenMP wait
policy unless the caller set one."""

from __future__ import annotations

from switchboard.engine.worker_processes import WORKER_OMP_WAIT_POLICY, worker_environment


def test_adds_the_passive_wait_policy_and_keeps_the_rest() -> None:
    env = worker_environment({"PATH": "/usr/bin", "SWITCHBOARD_LOG_LEVEL": "DEBUG"})
    assert env == {
        "PATH": "/usr/bin",
        "SWITCHBOARD_LOG_LEVEL": "DEBUG",
        "OMP_WAIT_POLICY": WORKER_OMP_WAIT_POLICY,
    }
    assert WORKER_OMP_WAIT_POLICY == "PASSIVE"


def test_an_operators_policy_wins() -> None:
    assert worker_environment({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
