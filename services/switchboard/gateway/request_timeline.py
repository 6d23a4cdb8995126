"""What the gateway learns about one request's life: the raw material of its spans and metrics.

Two clocks meet here, and each field says which it is on:

* **gateway wall clock** (``time.time_ns()`` of this process): arrival, submission, end;
* **engine monotonic clock** (``time.monotonic_ns()`` of the engine process that served it):
  the engine's events (QUEUED, SCHEDULED, PREEMPTED) and the ``EngineCoreOutputs.timestamp_ns``
  of the outputs that carried the first and the last token.

Nothing here converts between them: ``engine_clock.EngineClock`` does, when spans are built.
"""

from __future__ import annotations

import dataclasses

from switchboard.wire.engine_msgs import EngineCoreEvent, EngineCoreOutput, EventType, FinishReason


@dataclasses.dataclass(slots=True)
class RequestTimeline:
    request_id: str
    arrival_ns: int  # gateway wall clock: the RPC arrived
    submitted_ns: int | None = None  # gateway wall clock: tokenized and checked, ADD going out
    end_ns: int | None = None  # gateway wall clock: the gateway was done with it, however
    engine_index: int | None = None  # the data-parallel rank of the engine that served it
    engine_id: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0
    num_preemptions: int = 0
    events: list[EngineCoreEvent] = dataclasses.field(default_factory=list)  # engine clock
    first_token_ns: int | None = None  # engine clock: outputs that carried the first token
    last_token_ns: int | None = None  # engine clock: outputs that carried the latest token
    finish_reason: FinishReason | None = None  # the engine's (or the gateway's) last word
    output_token_ids: list[int] | None = None  # kept only when traces carry content

    def record_output(self, output: EngineCoreOutput, timestamp_ns: int) -> int:
        """Take in one engine output (``timestamp_ns``: its EngineCoreOutputs' stamp); return
        how many new tokens it carried."""
        if output.events:
            self.events.extend(output.events)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        self.num_preemptions = max(self.num_preemptions, output.num_preemptions)
        num_new = len(output.new_token_ids)
        if num_new:
            if self.first_token_ns is None:
                self.first_token_ns = timestamp_ns
            self.last_token_ns = timestamp_ns
            self.num_output_tokens += num_new
            if self.output_token_ids is not None:
                self.output_token_ids.extend(output.new_token_ids)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
        return num_new

    def first_event(self, event_type: EventType) -> int | None:
        """Engine clock: when the first event of this type happened, if the gateway knows."""
        for event in self.events:
            if event.type == event_type:
                return event.timestamp_ns
        return None

    @property
    def queued_ns(self) -> int | None:
        return self.first_event(EventType.QUEUED)

    @property
    def scheduled_ns(self) -> int | None:
        return self.first_event(EventType.SCHEDULED)

    def preemptions(self) -> list[tuple[int, int | None]]:
        """Engine clock: (PREEMPTED, the next SCHEDULED or None while still preempted)."""
        intervals: list[tuple[int, int | None]] = []
        preempted_at: int | None = None
        for event in self.events:
            if event.type == EventType.PREEMPTED and preempted_at is None:
                preempted_at = event.timestamp_ns
            elif event.type == EventType.SCHEDULED and preempted_at is not None:
                intervals.append((preempted_at, event.timestamp_ns))
                preempted_at = None
        if preempted_at is not None:
            intervals.append((preempted_at, None))
        return intervals
