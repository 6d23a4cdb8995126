"""Applying a step's output to the scheduler's requests: settle speculative proposals, register
the blocks the step filled in the prefix cache, make each request's output (stop checks
included), and release the requests it finished.

``Scheduler.update_from_output`` calls it once per step, in the order the steps were scheduled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from switchboard.engine.request import RequestStatus
from switchboard.engine.speculation.steps import settle_proposals
from switchboard.engine.step_outputs import pooled_output, sampled_output
from switchboard.wire.engine_msgs import EngineCoreOutput
from switchboard.wire.step_msgs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from switchboard.engine.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING


def apply_step_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    num_scheduled_tokens: dict[str, int],
    sampling: set[str],
    later: Iterable[tuple[dict[str, int], set[str]]],
) -> dict[int, list[EngineCoreOutput]]:
    """The outputs by client_index. ``num_scheduled_tokens`` and ``sampling``: the step's
    tokens per request and the requests it samples; ``later``: the same of the steps scheduled
    after it, still computing (their tokens are counted in but not computed yet)."""
    sampled = dict(zip(runner_output.request_ids, runner_output.sampled_token_ids, strict=True))
    logprobs = (
        dict(zip(runner_output.request_ids, runner_output.logprobs, strict=True))
        if runner_output.logprobs
        else {}
    )
    prompt_logprobs = runner_output.prompt_logprobs
    outputs: dict[int, list[EngineCoreOutput]] = {}
    requests = scheduler.requests
    kv = scheduler.kv
    block_size = scheduler.block_size
    any_finished = False
    proposals = scheduler_output.scheduled_spec_decode_tokens
    for rid, num_scheduled in num_scheduled_tokens.items():
        request = requests.get(rid)
        if request is None or request.status != _RUNNING:
            continue  # ended while the step ran (aborted, stopped, preempted): dropped
        drafts = proposals.get(rid) if proposals else None
        if drafts and scheduler.speculator is not None:
            num_scheduled -= settle_proposals(
                scheduler.speculator, request, drafts, sampled.get(rid) or []
            )
        samples = rid in sampling
        if samples:
            request.num_pending_samples -= 1
        computed = request.num_computed_tokens  # as this step left it:
        for tokens_ahead, _ in later:
            computed -= tokens_ahead.get(rid, 0)
        if computed // block_size != (computed - num_scheduled) // block_size:
            kv.cache_blocks(request, computed)  # this step filled a block: shareable now
        if request.pooling_params is not None:
            if computed < request.num_tokens:
                continue  # a pooling request ends with its prompt, not before
            output = pooled_output(request, runner_output.pooled_outputs.get(rid))
        else:
            new_token_ids = sampled.get(rid)
            if not new_token_ids or not samples:
                continue  # a prefill chunk that stops short samples nothing
            output = sampled_output(
                request,
                new_token_ids,
                scheduler.max_model_len,
                logprobs.get(rid),
                prompt_logprobs.get(rid),
            )
            if drafts:
                output.num_draft_tokens = len(drafts)
                output.num_accepted_tokens = len(new_token_ids) - 1
        outputs.setdefault(request.client_index, []).append(output)
        if request.status == RequestStatus.FINISHED:
            scheduler.release(request)
            any_finished = True
    if any_finished:
        scheduler.running = [r for r in scheduler.running if r.status == _RUNNING]
    return outputs
