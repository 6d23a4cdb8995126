"""When to schedule the next step ahead: not at once, but most of the way through this one.

With async scheduling the step after the running one is put on the workers' ring while the
running one computes, so the workers go straight from one to the next. Scheduled at the start of
the running step, it leaves out every request that arrives during that step: such a request
waits for the running step, then for the one scheduled ahead, and is prefilled in the step
after, about two and a half steps after it arrived. Held until ``HOLD_FRACTION`` of the last
step's period has passed, the engine takes arrivals in meanwhile; a request that arrived stops
scheduling ahead (``EngineCore._may_schedule_ahead``) and joins the step that follows the running
one, one step sooner. The price: after a step with arrivals the workers wait for the engine's
turn (applying outputs, scheduling), a millisecond or two, instead of starting the step queued
behind.

While it holds, the engine applies only what changes the scheduler's queues (requests added,
aborted, compiled); anything else (a utility call, a failure) ends the hold, nothing is
scheduled ahead, and the next turn handles it as it would have.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from switchboard.engine.intake import GATEWAY_LOST, GRAMMAR_READY
from switchboard.engine.io_threads import InputItem, InputQueue
from switchboard.wire.engine_msgs import RequestType

# How far into the running step (as a fraction of the last step's period) the next one is
# scheduled ahead.
HOLD_FRACTION = 0.6
# Steps shorter than this are not held: the workers' wait for the engine's turn after an
# arrival costs more than the step it saves (tiny-llama at 32 streams, ~8 ms steps, held at
# 0.6: TTFT p50 43.1 against 43.3 ms, output 2-7 % slower in each of three alternated rounds).
MIN_HELD_PERIOD_S = 0.02
POLL_MS = 1  # the longest an arrival waits to be taken in while the engine holds

# What the engine applies while it holds: they change only the scheduler's queues.
QUEUE_KINDS = (RequestType.ADD, RequestType.ABORT, GRAMMAR_READY, GATEWAY_LOST)


def hold_for_arrivals(
    until: float,
    step_done: Callable[[int], bool],
    input_queue: InputQueue,
    handle: Callable[[RequestType | str, Any], None],
    deferred: list[InputItem],
) -> bool:
    """Take arrivals in until ``until`` (``time.perf_counter``). True: schedule ahead now, the
    running step still runs; False: the running step is done, or an item came for the next
    turn (put in ``deferred``: a utility call, a failure), so the next step is scheduled
    after the running one's outputs, not ahead. ``step_done(timeout_ms)`` waits up to that
    long for the running step's output."""
    while True:
        left_ms = (until - time.perf_counter()) * 1000.0
        if left_ms <= 0:
            return True
        if step_done(max(1, min(POLL_MS, int(left_ms)))):
            return False
        while True:
            try:
                kind, payload = input_queue.get_nowait()
            except queue.Empty:
                break
            if kind not in QUEUE_KINDS:
                deferred.append((kind, payload))
                return False
            handle(kind, payload)
