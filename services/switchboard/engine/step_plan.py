"""One scheduling step's decisions, and the delta they become for the workers.

The scheduler fills a :class:`StepPlan` (which request computes how many tokens, which ones
join the batch, which were preempted), then :meth:`StepPlan.commit` turns it into the
``SchedulerOutput`` broadcast to the workers::

    new request     -> NewRequest(all tokens, whole block table, num_computed_tokens)
    running request -> CachedRequest(block ids added since it was last sent, num_computed_tokens)

and advances every scheduled request's ``num_computed_tokens`` by its share of the step; a
request the step takes to the end of its tokens gets a pending sample (the token the workers
will append), which a step scheduled before this one's output arrives counts as a token.

It also knows which prompt blocks the step fills (``filling``: block hash -> the request
computing it), so that a waiting request with the same prefix (e.g. a sibling sequence of an
``n`` > 1 request) waits one step and takes them from the prefix cache instead of computing them
a second time: blocks are registered in the cache only once their KV exists (``kv_cache.py``).
"""

from __future__ import annotations

from switchboard.engine import clock
from switchboard.engine.kv_cache import KVCacheManager
from switchboard.engine.request import Request
from switchboard.wire.block_hash import BlockHash
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput


class StepPlan:
    __slots__ = (
        "timestamp_ns",
        "token_budget",
        "budget",
        "scheduled",
        "new_requests",
        "preempted",
        "filling",
        "sampling",
    )

    def __init__(self, token_budget: int) -> None:
        self.timestamp_ns = clock.monotonic_ns()  # every admission of the step shares it
        self.token_budget = token_budget
        self.budget = token_budget  # tokens left
        self.scheduled: dict[str, int] = {}  # request_id -> tokens, in batch order
        self.new_requests: list[Request] = []
        self.preempted: list[Request] = []
        self.filling: dict[BlockHash, str] = {}  # hashed blocks this step computes -> by whom
        self.sampling: set[str] = set()  # requests the step samples (set by commit)

    def add(self, request: Request, num_tokens: int) -> None:
        self.scheduled[request.request_id] = num_tokens
        self.budget -= num_tokens
        if num_tokens > 1 and request.block_hashes:  # a prefill chunk: the blocks it fills
            first = request.num_computed_tokens // request.block_size
            end = (request.num_computed_tokens + num_tokens) // request.block_size
            for block_hash in request.block_hashes[first:end]:
                self.filling.setdefault(block_hash, request.request_id)

    def fills(self, block_hash: BlockHash) -> bool:
        """Whether a request still scheduled in this step computes the block of this hash."""
        owner = self.filling.get(block_hash)
        return owner is not None and owner in self.scheduled

    def withdraw(self, request: Request) -> None:
        """Undo this step's decision for a request that has just been preempted."""
        self.budget += self.scheduled.pop(request.request_id, 0)
        if request in self.new_requests:
            self.new_requests.remove(request)
        self.preempted.append(request)

    @property
    def num_scheduled_tokens(self) -> int:
        return self.token_budget - self.budget

    def commit(
        self,
        step_id: int,
        requests: dict[str, Request],
        kv: KVCacheManager,
        finished_request_ids: list[str],
    ) -> SchedulerOutput:
        """The step's delta for the workers; advances the requests' computed tokens and counts
        a pending sample for each request the step takes to the end of its tokens (their ids
        in ``sampling``)."""
        new_ids = set()
        new_requests = []
        for request in self.new_requests:
            block_ids = kv.block_ids(request.request_id)
            new_requests.append(
                NewRequest(
                    request.request_id,
                    list(request.all_token_ids),
                    request.sampling_params,
                    list(block_ids),
                    request.num_computed_tokens,
                    len(request.output_token_ids),
                    request.pooling_params,
                    request.lora_name,
                )
            )
            request.num_block_ids_sent = len(block_ids)
            new_ids.add(request.request_id)
        cached_requests = []
        block_ids_of = kv.block_ids
        for rid, num_tokens in self.scheduled.items():
            request = requests[rid]
            if rid not in new_ids:
                block_ids = block_ids_of(rid)
                sent = request.num_block_ids_sent
                cached_requests.append(
                    CachedRequest(rid, block_ids[sent:], request.num_computed_tokens)
                )
                request.num_block_ids_sent = len(block_ids)
            request.num_computed_tokens += num_tokens  # computed once the step has run
            if request.num_tokens_to_compute <= 0 and request.pooling_params is None:
                request.num_pending_samples += 1
                self.sampling.add(rid)
        return SchedulerOutput(
            step_id,
            new_requests,
            cached_requests,
            self.scheduled,
            self.num_scheduled_tokens,
            finished_request_ids,
        )
