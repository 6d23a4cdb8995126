"""Holding the step ahead back (engine/ahead_hold.py): arrivals taken in while the running step
computes, the running step's end or an item for the next turn ending the hold."""

from __future__ import annotations

import queue
import time
from typing import Any

from switchboard.engine.ahead_hold import hold_for_arrivals
from switchboard.engine.intake import GRAMMAR_READY
from switchboard.wire.engine_msgs import RequestType


class Recorder:
    def __init__(self) -> None:
        self.handled: list[tuple[Any, Any]] = []

    def __call__(self, kind: Any, payload: Any) -> None:
        self.handled.append((kind, payload))


def never_done(timeout_ms: int) -> bool:
    time.sleep(timeout_ms / 1000.0)
    return False


def test_arrivals_are_taken_in_until_the_deadline() -> None:
    inputs: queue.Queue = queue.Queue()
    inputs.put((RequestType.ADD, "a"))
    inputs.put((GRAMMAR_READY, None))
    inputs.put((RequestType.ABORT, ["b"]))
    handle, deferred = Recorder(), []
    started = time.perf_counter()
    assert hold_for_arrivals(started + 0.02, never_done, inputs, handle, deferred)
    assert time.perf_counter() - started >= 0.02  # held to the deadline
    assert handle.handled == [
        (RequestType.ADD, "a"),
        (GRAMMAR_READY, None),
        (RequestType.ABORT, ["b"]),
    ]
    assert deferred == [] and inputs.empty()


def test_the_running_step_ending_first_ends_the_hold_without_scheduling_ahead() -> None:
    inputs: queue.Queue = queue.Queue()
    calls = []

    def done_on_third(timeout_ms: int) -> bool:
        calls.append(timeout_ms)
        return len(calls) == 3

    started = time.perf_counter()
    assert not hold_for_arrivals(started + 10.0, done_on_third, inputs, Recorder(), [])
    assert len(calls) == 3 and time.perf_counter() - started < 5.0


def test_a_utility_call_ends_the_hold_and_waits_for_the_next_turn() -> None:
    # nothing scheduled ahead: the next turn runs the call with no step in flight
    inputs: queue.Queue = queue.Queue()
    inputs.put((RequestType.ADD, "a"))
    inputs.put((RequestType.UTILITY, "call"))
    inputs.put((RequestType.ADD, "later"))
    handle, deferred = Recorder(), []
    started = time.perf_counter()
    assert not hold_for_arrivals(started + 10.0, never_done, inputs, handle, deferred)
    assert time.perf_counter() - started < 5.0
    assert handle.handled == [(RequestType.ADD, "a")]
    assert deferred == [(RequestType.UTILITY, "call")]
    assert inputs.get_nowait() == (RequestType.ADD, "later")  # left in order for the turn


def test_a_deadline_already_past_schedules_ahead_at_once() -> None:
    inputs: queue.Queue = queue.Queue()
    inputs.put((RequestType.ADD, "a"))
    handle = Recorder()
    assert hold_for_arrivals(time.perf_counter() - 1.0, never_done, inputs, handle, [])
    assert handle.handled == [] and not inputs.empty()
