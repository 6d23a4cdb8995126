"""Proposals in a scheduling step, and their settlement after it.

A decoding request ``r`` with ``N`` tokens has computed ``N - 1`` of them; with proposals
``d_0 .. d_{k-1}`` its step computes positions ``N - 1 .. N + k - 1`` (its last token, then the
proposals), so ``num_scheduled_tokens[r] = 1 + k`` and KV slots are reserved for all of them.
Proposals never preempt anyone: they take slots only where blocks are free, and budget only
what the step has left after the request's own token.

After the step the workers return ``a + 1`` tokens (``a`` proposals accepted, then the model's own
next token): the request then has ``N + a + 1`` tokens of which ``N + a`` have KV, so
``num_computed_tokens`` goes back by the ``k - a`` rejected positions. Their slots stay in the
request's block table and are written again by its next step (the next proposals need them
anyway); they are never registered in the prefix cache, which takes full blocks of accepted
tokens only.
"""

from __future__ import annotations

from switchboard.engine.kv_cache import KVCacheManager
from switchboard.engine.request import Request
from switchboard.engine.speculation.speculator import Speculator
from switchboard.engine.step_plan import StepPlan


def schedule_proposals(
    speculator: Speculator,
    plan: StepPlan,
    request: Request,
    kv: KVCacheManager,
    max_model_len: int,
    decoding: int,
    pending: int = 0,
) -> list[int]:
    """Extend a decoding request's share of the step (one token, already planned) by its
    proposals, in a step of ``decoding`` decoding requests, after its ``pending`` tokens in
    flight (a step scheduled ahead); returns them ([] when it proposes nothing or nothing
    fits)."""
    limit = min(
        plan.budget,
        # its last accepted token may be its last: never compute beyond the length limits
        request.sampling_params.max_tokens - request.num_output_tokens - pending - 1,
        max_model_len - request.num_tokens - pending - 1,
    )
    drafts = speculator.propose(request, limit, decoding, pending)
    if not drafts:
        return []
    if kv.allocate_slots(request, 1 + len(drafts)) is None:
        Speculator.drop_in_flight(request)
        return []
    plan.scheduled[request.request_id] += len(drafts)
    plan.budget -= len(drafts)
    return drafts


def settle_proposals(
    speculator: Speculator, request: Request, drafts: list[int], new_token_ids: list[int]
) -> int:
    """Record the verdict on a request's proposals and take back the rejected positions from
    its computed tokens; returns how many were rejected."""
    num_accepted = max(len(new_token_ids) - 1, 0)
    rejected = len(drafts) - num_accepted
    request.num_computed_tokens -= rejected
    speculator.accept(request, len(drafts), num_accepted)
    return rejected
