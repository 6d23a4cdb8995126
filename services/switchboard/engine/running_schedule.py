"""Step 1 of scheduling a step: the running requests. Decoding ones first (one token each, and
their speculative proposals), so a long prefill chunk never takes their turn, then partly
prefilled ones (a chunk of at most the scheduler's chunk cap). A request that finds no free KV
block preempts others until it fits or is itself the victim. Under scheduling ahead, a request
whose pending samples may end it, or that its grammar or speculation must see first, waits
for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from switchboard.engine.preemption import pick_victim, preempt
from switchboard.engine.request import Request, RequestStatus
from switchboard.engine.speculation.steps import schedule_proposals
from switchboard.engine.step_plan import StepPlan

if TYPE_CHECKING:
    from switchboard.engine.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING


def schedule_running(scheduler: Scheduler, plan: StepPlan) -> None:
    cap = scheduler.chunk_cap()
    prefilling: list[Request] = []
    speculator = scheduler.speculator
    if speculator is not None and not speculator.active(len(scheduler.running)):
        speculator = None
    decoding = scheduler.num_decoding() if speculator is not None else 0
    for request in list(scheduler.running):  # decoding requests first
        if plan.budget <= 0:
            break
        if request.status != _RUNNING:  # preempted earlier in this step
            continue
        pending = request.num_pending_samples
        if pending and waits_for_pending(request, pending, scheduler.max_model_len):
            continue
        if request.num_tokens_to_compute == 1:
            _schedule_one(scheduler, plan, request, 1)
            if (
                speculator is not None
                and (not pending or speculator.proposes_ahead)
                and request.status == _RUNNING
            ):
                drafts = schedule_proposals(
                    speculator,
                    plan,
                    request,
                    scheduler.kv,
                    scheduler.max_model_len,
                    decoding,
                    pending,
                )
                if drafts:
                    scheduler.proposals[request.request_id] = drafts
        else:
            prefilling.append(request)
    for request in prefilling:
        if plan.budget <= 0:
            break
        if request.status != _RUNNING:
            continue
        num_tokens = request.num_tokens_to_compute
        if cap and num_tokens > cap:
            num_tokens = cap
        _schedule_one(scheduler, plan, request, num_tokens)


def waits_for_pending(request: Request, pending: int, max_model_len: int) -> bool:
    """Whether a request with tokens still to come from a step in flight must have them
    first: they may end it by length, or its grammar masks the next token by them."""
    return (
        request.grammar is not None
        or (request.speculation is not None and request.speculation.in_flight > 0)
        or request.num_output_tokens + pending >= request.sampling_params.max_tokens
        or request.num_tokens + pending >= max_model_len
    )


def _schedule_one(scheduler: Scheduler, plan: StepPlan, request: Request, num_tokens: int) -> None:
    max_model_len = scheduler.max_model_len
    num_tokens = min(num_tokens, plan.budget, max_model_len - request.num_computed_tokens)
    if num_tokens <= 0:
        return
    while scheduler.kv.allocate_slots(request, num_tokens) is None:
        victim = pick_victim(scheduler)
        preempt(scheduler, victim, plan)
        if victim is request:
            return
    plan.add(request, num_tokens)
