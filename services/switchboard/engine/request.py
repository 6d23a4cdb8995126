"""The scheduler's per-request state.

A request's tokens are ``all_token_ids = prompt_token_ids + output_token_ids``. The scheduler
gives it tokens until ``num_computed_tokens`` (tokens whose KV is in the cache) catches up with
``num_tokens``; the last step of that catch-up samples one more token. One number therefore
covers a first prefill, a chunked prefill, a prefix-cache hit, decoding and a resume after
preemption.

Status::

    WAITING --schedule--> RUNNING --stop check--> FINISHED
       ^                     |  \\--abort---------> FINISHED
       +-----preempt---------+
    (a preempted request waits at the front of the queue, keeps its output tokens and
     recomputes its KV on resume; an abort can also end a WAITING request)
"""

from __future__ import annotations

import enum
from typing import Any

from switchboard.wire.block_hash import BlockHash, extend_block_hashes
from switchboard.wire.engine_msgs import (
    EngineCoreEvent,
    EngineCoreRequest,
    EventType,
    FinishReason,
    PoolingParams,
    SamplingParams,
)
from switchboard.wire.lora import lora_name_of


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, after a preemption
    FINISHED = 3


class Request:
    __slots__ = (
        "request_id",
        "client_index",
        "priority",
        "arrival_ns",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "sampling_params",
        "cache_salt",
        "events",
        "num_preemptions",
        "status",
        "finish_reason",
        "stop_reason",
        "num_cached_tokens",
        "block_size",
        "block_hashes",
        "hash_blocks",
        "num_block_ids_sent",
        "num_pending_samples",
        "pooling_params",
        "grammar",
        "speculation",
        "lora_name",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        block_size: int,
        arrival_ns: int,
        client_index: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        hash_blocks: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_name: str = "",
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.arrival_ns = arrival_ns  # engine monotonic clock; breaks priority ties (FCFS)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.events: list[EngineCoreEvent] = []
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1  # prefix-cache hit at the first admission; -1 = not yet
        self.block_size = block_size
        # Hash of every full block of all_token_ids (prompt at creation, outputs as they fill).
        self.block_hashes: list[BlockHash] = []
        self.hash_blocks = hash_blocks
        self.num_block_ids_sent = 0  # block-table entries the workers already know
        # Steps sent to the workers, not yet applied, that sample a token for it (the engine
        # schedules a step ahead while one computes): the scheduler counts those tokens as if
        # they were there, since the workers will have them.
        self.num_pending_samples = 0
        # Set for an embedding request: prefill only, finished with its pooled vector.
        self.pooling_params = pooling_params
        # Set for a constrained request (structured output): engine/constrained_decoding.py's
        # RequestGrammar, advanced with every accepted output token.
        self.grammar: Any = None
        # engine/speculation's per-request state, made at its first decode step when enabled.
        self.speculation: Any = None
        self.lora_name = lora_name  # the LoRA adapter it runs with ("" = the base model)
        self.update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls,
        req: EngineCoreRequest,
        block_size: int,
        arrival_ns: int,
        *,
        hash_blocks: bool = True,
    ) -> Request:
        """Build the scheduler's state; runs in the engine's input thread, where the prompt's
        block hashes are computed so that the busy loop does not pay for them.

        ``hash_blocks=False`` (prefix caching off) skips the hashing. Raises ValueError for a
        token id outside uint32.
        """
        request = cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params if req.sampling_params is not None else SamplingParams(),
            block_size=block_size,
            arrival_ns=arrival_ns,
            client_index=req.client_index,
            priority=req.priority,
            cache_salt=req.cache_salt,
            hash_blocks=hash_blocks,
            pooling_params=req.pooling_params,
            lora_name=lora_name_of(req.lora_request),
        )
        if req.output_token_ids:  # a resumed stream: continue as after a preemption
            request.output_token_ids = list(req.output_token_ids)
            request.all_token_ids += req.output_token_ids
            request.update_block_hashes()
        return request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not computed yet, counting those a step in flight will sample."""
        return len(self.all_token_ids) + self.num_pending_samples - self.num_computed_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self) -> None:
        """Hash the blocks that became full since the last call (no-op with caching off)."""
        if self.hash_blocks and len(self.all_token_ids) >= (
            (len(self.block_hashes) + 1) * self.block_size
        ):
            extend_block_hashes(
                self.block_hashes,
                self.all_token_ids,
                self.block_size,
                self.cache_salt,
                self.lora_name,
            )

    def record_event(self, event_type: EventType, timestamp_ns: int) -> None:
        self.events.append(EngineCoreEvent(event_type, timestamp_ns))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events not yet delivered (each is delivered once), or None."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
