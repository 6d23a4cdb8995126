"""The scheduler: which requests compute which tokens in the next step, on the paged KV cache.

One scheduling model, no prefill/decode phases: every request has ``num_computed_tokens`` and
each step gives it tokens to catch up with ``num_tokens`` (prompt + outputs), under a token
budget (``max_num_batched_tokens``; ``shared_step_tokens``, when set, while more than one request
is in: a lone long prompt takes big steps, a crowd small ones, and running requests that take
more than a quarter of it get their decodes and a whole shared budget for prompts) and a cap on
running requests (``max_num_seqs``):

1. running requests, decoding ones first (one token each) so a long prefill chunk never takes
   their turn, then partly prefilled ones (a chunk of at most ``long_prefill_token_threshold``
   when another request is eligible). A request that finds no free KV block preempts others
   (FCFS: the newest running; priority: the lowest priority) until it fits or is itself the
   victim;
2. waiting requests in queue order (FCFS, or (priority, arrival)), each after a prefix-cache
   lookup, while budget, sequence slots and blocks last; skipped for the step if step 1
   preempted (memory is short). Under the priority policy a waiting request may also preempt
   running requests of strictly lower priority, so urgent work does not wait for it to finish.
   A waiting request whose LoRA adapter is not running while ``max_loras`` others are is
   passed over (it stays in its place) for this step.
   A waiting request whose next prompt block another request computes in this step (the same
   prefix: sibling sequences of ``n`` > 1 arrive together) waits one step, with the queue
   behind it, and then takes that block from the prefix cache instead of computing it again.

Preemption is by recompute: blocks freed, ``num_computed_tokens`` reset, outputs kept, request
back at the front of the waiting queue; its id goes out in ``finished_request_ids`` so workers
drop their state, and on resume it is a NewRequest again whose tokens are prompt + outputs.

Step 1 is in ``running_schedule``, preemption in ``preemption``, the prefix-cache lookup and
admission of a waiting request in ``prefix_admission``, applying a step's output in
``output_update``.

The step's :class:`SchedulerOutput` is a delta (see ``wire/step_msgs.py``). A request id never
appears both in ``finished_request_ids`` and among the scheduled requests of one output.

Scheduling ahead (the engine's async scheduling): the next step may be scheduled while the last
one computes, before its output is applied. A request that step samples has a pending sample,
and the next step gives it its next token as if it were there (the workers append the token they
sampled themselves). A request whose pending tokens may end it by length (``max_tokens``,
``max_model_len``), or whose grammar must see them first, waits for them. Outputs are applied in
step order; one that arrives for a request which ended meanwhile (a stop token, an abort, a
preemption) is dropped, so at most one extra token is computed and never shown.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from switchboard.config import CacheConfig, SchedulerConfig
from switchboard.engine import clock
from switchboard.engine.kv_cache import KVCacheManager
from switchboard.engine.lora_registry import adapter_may_join, adapters_of
from switchboard.engine.output_update import apply_step_output
from switchboard.engine.preemption import preempt, preempt_for
from switchboard.engine.prefix_admission import admit, prefix_cache_hits, waits_for_shared_prefill
from switchboard.engine.request import Request, RequestStatus
from switchboard.engine.request_queue import make_request_queue
from switchboard.engine.running_schedule import schedule_running
from switchboard.engine.scheduler_stats import SchedulerCounters
from switchboard.engine.speculation.speculator import make_speculator
from switchboard.engine.step_plan import StepPlan
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EventType,
    FinishReason,
    SchedulerStats,
)
from switchboard.wire.step_msgs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        max_loras: int = 0,
    ) -> None:
        """``max_loras``: distinct LoRA adapters running at once (0: LoRA off)."""
        if scheduler_config.max_num_seqs <= 0 or scheduler_config.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        block_size = cache_config.block_size
        if max_model_len <= 0 or -(-max_model_len // block_size) > num_blocks:
            raise ValueError(
                f"max_model_len {max_model_len} does not fit {num_blocks} blocks of "
                f"{block_size} tokens: one full-length request must fit the KV cache"
            )
        self.config = scheduler_config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.policy = scheduler_config.scheduling_policy
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.kv = KVCacheManager(num_blocks, block_size, cache_config.enable_prefix_caching)
        self.waiting = make_request_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.finished_ids: dict[str, None] = {}  # for the next output (ordered set)
        # Steps scheduled and not yet applied, in order: step id -> (tokens per request, the
        # requests it samples). More than one while a step is scheduled ahead.
        self._in_flight: dict[int, tuple[dict[str, int], set[str]]] = {}
        self._step_id = 0
        self.counters = SchedulerCounters()
        # Speculative decoding (engine/speculation/), None when off; the step's proposals.
        self.speculator = make_speculator(scheduler_config.speculative_config)
        self.proposals: dict[str, list[int]] = {}
        self.max_loras = max_loras
        logger.info(
            "scheduler: policy=%s max_num_seqs=%d max_num_batched_tokens=%d "
            "shared_step_tokens=%d long_prefill_token_threshold=%d blocks=%d x %d tokens "
            "prefix_caching=%s",
            self.policy,
            scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens,
            scheduler_config.shared_step_tokens,
            scheduler_config.long_prefill_token_threshold,
            num_blocks,
            block_size,
            self.enable_prefix_caching,
        )

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request (stamps QUEUED). ValueError if it can never run."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already in the scheduler")
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens, "
                f"allowed 1..{self.max_model_len}"
            )
        if request.block_size != self.block_size:
            raise ValueError(f"request {rid!r} was hashed for block size {request.block_size}")
        if request.hash_blocks != self.enable_prefix_caching:
            request.hash_blocks = self.enable_prefix_caching
            request.update_block_hashes()
        request.record_event(EventType.QUEUED, clock.monotonic_ns())
        self.requests[rid] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str] | str, reason: FinishReason) -> None:
        """End requests from outside (aborts): no output is produced for them. Idempotent;
        unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        waiting: set[Request] = set()
        running: set[Request] = set()
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            if request.status == _RUNNING:
                running.add(request)
                self.finished_ids[rid] = None  # workers hold its state
            else:
                waiting.add(request)
            self.kv.free(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
        if waiting:
            self.waiting.remove_requests(waiting)
        if running:
            self.running = [r for r in self.running if r not in running]
        if waiting or running:
            logger.debug("ended %d requests from outside (%s)", len(waiting) + len(running), reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """Ids the workers must still be told to drop (send a step even with nothing to run)."""
        return bool(self.finished_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_admissible_waiting(self) -> bool:
        """Whether requests wait that a step could take now: a sequence slot is free. (Waiting
        for a slot, they cannot join the next step whenever it is scheduled.)"""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(self._step_budget())
        schedule_running(self, plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self._step_id += 1
        self.counters.record_step(plan.num_scheduled_tokens)
        finished_ids = list(self.finished_ids)
        self.finished_ids.clear()
        output = plan.commit(self._step_id, self.requests, self.kv, finished_ids)
        if self.proposals:
            output.scheduled_spec_decode_tokens = self._take_proposals(plan)
        self._in_flight[self._step_id] = (output.num_scheduled_tokens, plan.sampling)
        return output

    def _take_proposals(self, plan: StepPlan) -> dict[str, list[int]]:
        """The step's proposals, of the requests still in it (one preempted later in the
        step is not)."""
        proposals, self.proposals = self.proposals, {}
        for rid in [rid for rid in proposals if rid not in plan.scheduled]:
            del proposals[rid]
        return proposals

    def wants_latest_tokens(self) -> bool:
        """Whether the next step needs the latest tokens of a running request, so the engine
        does not schedule it ahead: one whose proposals the step in flight verifies (how many
        tokens it gets is not known until then) or, with a draft model, one that proposes at
        its next step (the engine reserves the draft's positions after its latest token)."""
        speculator = self.speculator
        if speculator is None or not speculator.active(len(self.running)):
            return False
        if speculator.proposes_ahead:
            return any(
                r.speculation is not None and r.speculation.in_flight > 0 for r in self.running
            )
        decoding = self.num_decoding()
        return any(
            speculator.will_propose(r, decoding)
            for r in self.running
            if r.num_tokens_to_compute <= 1
        )

    def num_decoding(self) -> int:
        """Running requests with one token to compute: the decodes of the next step."""
        return sum(1 for r in self.running if r.num_tokens_to_compute <= 1)

    def _step_budget(self) -> int:
        """``max_num_batched_tokens``; ``shared_step_tokens`` (when set) while more than one
        request is in the engine. While the running requests' decodes take more than a quarter
        of it, the step could not keep to it and leave prompts room: they get their decodes and
        a whole shared budget more, so that a crowd of decoding streams never starves a prompt
        (measured, tiny-llama: at 64 streams a 128-token budget with 64 for prompts queued
        them twice as long as 256)."""
        budget = self.config.max_num_batched_tokens
        shared = self.config.shared_step_tokens
        if shared and len(self.running) + len(self.waiting) > 1:
            if len(self.running) > shared // 4:
                return min(budget, len(self.running) + shared)
            return min(budget, shared)
        return budget

    def chunk_cap(self) -> int:
        """The most prompt tokens a request computes in one step (0: no cap): the
        ``long_prefill_token_threshold`` while another request is in."""
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0 and len(self.running) + len(self.waiting) > 1:
            return threshold
        return 0

    def _schedule_waiting(self, plan: StepPlan) -> None:
        cap = self.chunk_cap()
        max_num_seqs = self.config.max_num_seqs
        skipped: list[Request] = []
        while self.waiting and plan.budget > 0:
            request = self.waiting.peek()
            if request in plan.preempted:  # not back in the step that preempted it
                break
            if len(self.running) >= max_num_seqs:
                if preempt_for(self, request, plan):
                    continue
                break
            if request.lora_name and not adapter_may_join(request, self.running, self.max_loras):
                skipped.append(self.waiting.pop())  # its adapter waits for a free slot
                continue
            hits, num_hit_tokens = prefix_cache_hits(self.kv, request)
            if waits_for_shared_prefill(request, len(hits), plan, self.block_size):
                break  # FCFS: the queue behind it waits that one step too
            num_tokens = request.num_tokens - num_hit_tokens
            if cap and num_tokens > cap:
                num_tokens = cap
            num_tokens = min(num_tokens, plan.budget, self.max_model_len - num_hit_tokens)
            if self.kv.allocate_slots(request, num_tokens, hits) is None:
                if preempt_for(self, request, plan):
                    continue
                break
            self.waiting.pop()
            admit(self, plan, request, num_hit_tokens, num_tokens)
        for request in reversed(skipped):  # back in their places
            self.waiting.add_preempted(request)

    # ------------------------------------------------------------------ after the step

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[int, list[EngineCoreOutput]]:
        """Append sampled tokens, run stop checks, free finished requests and register newly
        computed full blocks in the prefix cache. Returns the outputs by client_index.

        Steps are applied in the order they were scheduled; a step scheduled after this one
        may be in flight (its tokens are then not computed yet)."""
        record = self._in_flight.pop(scheduler_output.step_id, None)
        if record is None:
            raise ValueError(f"step {scheduler_output.step_id} is not in flight: applied twice?")
        num_scheduled_tokens, sampling = record
        later = self._in_flight.values()  # steps scheduled after this one, still computing
        return apply_step_output(
            self, scheduler_output, runner_output, num_scheduled_tokens, sampling, later
        )

    def release(self, request: Request) -> None:
        """A request the step finished: free its blocks, forget it, tell the workers."""
        self.kv.free(request)
        del self.requests[request.request_id]
        self.finished_ids[request.request_id] = None

    # ------------------------------------------------------------------ stats and utilities

    def make_stats(self) -> SchedulerStats:
        """Gauges now, counters cumulative since start-up, tokens of the last step."""
        stats = self.counters.make_stats(len(self.running), len(self.waiting), self.kv)
        if self.speculator is not None:
            self.speculator.fill_stats(stats)
        if self.max_loras:
            stats.running_lora_adapters = adapters_of(self.running)
            stats.waiting_lora_adapters = adapters_of(self.waiting)
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def preempt_all(self) -> int:
        """Put every running request back in the waiting queue with its blocks freed (the
        engine is going to sleep; they are recomputed after waking). Returns how many.

        Sleeping workers drop every request's state themselves, so the victims' ids are not
        sent as finished: they would otherwise meet their own re-admission in the next step."""
        victims = list(self.running)
        plan = StepPlan(0)
        for request in reversed(victims):  # newest first: the oldest ends at the queue's front
            preempt(self, request, plan)
            del self.finished_ids[request.request_id]
        return len(victims)

    def get_stats(self) -> dict[str, Any]:
        """The ``get_stats`` utility: plain values an operator can read."""
        queries = self.kv.prefix_queries
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.kv.usage(),
            "num_blocks": self.kv.num_blocks,
            "num_free_blocks": self.kv.num_free_blocks,
            "block_size": self.block_size,
            "prefix_caching": self.enable_prefix_caching,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prefix_cache_hit_rate": self.kv.prefix_hits / queries if queries else 0.0,
            "num_preemptions": self.counters.num_preemptions,
            "scheduling_policy": self.policy,
        }
