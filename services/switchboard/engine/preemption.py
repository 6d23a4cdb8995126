"""Preemption by recompute: which running request gives way (FCFS: the newest; priority: the
lowest priority), and putting it back at the front of the waiting queue with its blocks freed
and its outputs kept. Its id goes to the workers as finished, so they drop its state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from switchboard.engine import clock
from switchboard.engine.request import Request, RequestStatus
from switchboard.engine.speculation.speculator import Speculator
from switchboard.engine.step_plan import StepPlan
from switchboard.wire.engine_msgs import EventType

if TYPE_CHECKING:
    from switchboard.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def pick_victim(scheduler: Scheduler) -> Request:
    if scheduler.policy == "priority":
        return max(scheduler.running, key=lambda r: (r.priority, r.arrival_ns))
    return scheduler.running[-1]


def preempt_for(scheduler: Scheduler, request: Request, plan: StepPlan) -> bool:
    """Priority policy: make room for a waiting request by preempting the lowest-priority
    running request, if its priority is strictly lower (a larger value). False if none."""
    if scheduler.policy != "priority" or not scheduler.running:
        return False
    victim = pick_victim(scheduler)
    if victim.priority <= request.priority:
        return False
    preempt(scheduler, victim, plan)
    return True


def preempt(scheduler: Scheduler, request: Request, plan: StepPlan) -> None:
    running = scheduler.running
    if running[-1] is request:
        running.pop()
    else:
        running.remove(request)
    scheduler.kv.free(request)
    plan.withdraw(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_pending_samples = 0  # a step in flight still samples it: dropped
    Speculator.drop_in_flight(request)
    request.num_block_ids_sent = 0
    request.num_preemptions += 1
    request.record_event(EventType.PREEMPTED, clock.monotonic_ns())
    scheduler.waiting.add_preempted(request)
    scheduler.finished_ids[request.request_id] = None  # workers drop its state
    log = logger.warning if scheduler.counters.record_preemption() == 1 else logger.debug
    log(
        "preempted request %s (%s policy, %d tokens, %d free blocks); preemptions "
        "recompute work: more KV cache memory or fewer max_num_seqs avoids them",
        request.request_id,
        scheduler.policy,
        request.num_tokens,
        scheduler.kv.num_free_blocks,
    )
