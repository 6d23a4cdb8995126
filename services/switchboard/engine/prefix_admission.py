"""Admitting a waiting request with the prefix cache: the lookup (skipped where every prompt
position must be computed), waiting one step for a block another request computes in this step
(sibling sequences of ``n`` > 1 share a prefix), and the move to the running requests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from switchboard.engine.block_pool import KVCacheBlock
from switchboard.engine.kv_cache import KVCacheManager
from switchboard.engine.request import Request, RequestStatus
from switchboard.engine.step_plan import StepPlan
from switchboard.wire.engine_msgs import EventType

if TYPE_CHECKING:
    from switchboard.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def prefix_cache_hits(kv: KVCacheManager, request: Request) -> tuple[list[KVCacheBlock], int]:
    """The prefix-cache lookup, skipped for a request that still owes prompt logprobs: those
    need the logits of every prompt position, which a cache hit would not compute. Skipped for
    pooling requests too: mean/max pooling needs every position's hidden state."""
    if not takes_prefix_hits(request):
        return [], 0
    return kv.get_computed_blocks(request)


def takes_prefix_hits(request: Request) -> bool:
    if request.pooling_params is not None:
        return False
    return request.sampling_params.prompt_logprobs is None or bool(request.output_token_ids)


def waits_for_shared_prefill(
    request: Request, num_hit_blocks: int, plan: StepPlan, block_size: int
) -> bool:
    """Whether the next block this request would compute is being computed in this step by
    another request (same prefix: typically a sibling sequence of ``n`` > 1 sent together).
    Waiting one step turns it into a prefix-cache hit instead of a second computation."""
    if not plan.filling or not takes_prefix_hits(request):
        return False
    max_hit_blocks = (request.num_tokens - 1) // block_size  # last token: recomputed
    hashes = request.block_hashes
    if num_hit_blocks >= min(len(hashes), max_hit_blocks):
        return False
    if not plan.fills(hashes[num_hit_blocks]):
        return False
    logger.debug(
        "request %s waits a step: its block %d is being computed for another request",
        request.request_id,
        num_hit_blocks,
    )
    return True


def admit(
    scheduler: Scheduler, plan: StepPlan, request: Request, num_hit_tokens: int, num_tokens: int
) -> None:
    """Move a waiting request, its blocks allocated, to the running requests and the step."""
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = num_hit_tokens
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = num_hit_tokens
    if scheduler.enable_prefix_caching:
        scheduler.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
    request.record_event(EventType.SCHEDULED, plan.timestamp_ns)
    scheduler.running.append(request)
    plan.new_requests.append(request)
    plan.add(request, num_tokens)
