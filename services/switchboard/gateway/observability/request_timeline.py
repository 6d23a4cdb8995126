"""What the gateway learns about one request's life: the raw material of its spans and metrics.

Two clocks meet here, and each field says which it is on:

* **gateway wall clock** (``time.time_ns()`` of this process): arrival, submission, end;
* **engine monotonic clock** (``time.monotonic_ns()`` of the engine process that served it):
  the engine's events (QUEUED, SCHEDULED, PREEMPTED) and the ``EngineCoreOutputs.timestamp_ns``
  of the outputs that carried the first and the last token.

``engines.clock.EngineClock`` converts between them; a timeline fixes the conversion when it
closes (``wall_offset_ns``: by then the clock has seen every output of the call, so no engine
instant lands after the gateway received it), and every figure derived from it uses that one.

This is the one record of a Generate call's timing: ``close`` derives ``RequestTimes`` from it
once, and the client's ``RequestMetrics``, the Prometheus histograms and the span attributes all
report those same numbers (``n`` > 1 included: the call's first QUEUED, first SCHEDULED, first
and last token over all its sequences).

A stream resumed on another engine (``gateway/engines/resume.py``) has stamps from two engine
clocks: the observer places the later engine's on the first engine's clock before they are
recorded (``record_output``'s ``shift_ns``), so the timeline stays on one clock (``clock``), and
``resumes`` says where each sequence moved and when.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from switchboard.wire.engine_msgs import EngineCoreEvent, EngineCoreOutput, EventType, FinishReason

if TYPE_CHECKING:
    from switchboard.gateway.engines.engine_clock import EngineClock


@dataclasses.dataclass(frozen=True, slots=True)
class RequestTimes:
    """What a finished Generate call reports about its time, in nanoseconds. A phase the
    gateway never saw both ends of is None."""

    e2e_ns: int  # arrival -> the gateway was done (gateway wall clock)
    ttft_ns: int | None  # arrival -> the engine's outputs carrying the first token
    queue_ns: int | None  # first QUEUED -> first SCHEDULED (engine clock)
    prefill_ns: int | None  # first SCHEDULED -> first token
    decode_ns: int | None  # first token -> last token
    inference_ns: int | None  # first SCHEDULED -> last token
    num_preemptions: int
    num_output_tokens: int

    @property
    def tpot_ns(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.decode_ns or self.num_output_tokens < 2:
            return None
        return self.decode_ns / (self.num_output_tokens - 1)


@dataclasses.dataclass(slots=True)
class Resume:
    """One sequence cut off by its engine's death and continued on another (stamps on the
    timeline's clock)."""

    sequence: str  # the engine request id
    cut_off_on: tuple[int, str]  # (data-parallel rank, engine id)
    taken_by: tuple[int, str]
    cut_ns: int | None  # its last token before the cut (None: it had none)
    continued_ns: int | None = None  # its first token from the new engine (None: none yet)


def _between(start: int | None, end: int | None) -> int | None:
    return None if start is None or end is None else max(0, end - start)


@dataclasses.dataclass(slots=True)
class RequestTimeline:
    """One Generate call; with ``n`` > 1 its sequences are engine requests of their own, and the
    call's view is theirs together: the first to be queued, scheduled and to give a token, the
    last token of any, the tokens and preemptions of all."""

    request_id: str
    arrival_ns: int  # gateway wall clock: the RPC arrived
    submitted_ns: int | None = None  # gateway wall clock: tokenized and checked, ADD going out
    end_ns: int | None = None  # gateway wall clock: the gateway was done with it, however
    engine_index: int | None = None  # the data-parallel rank of the engine that served it last
    engine_id: str = ""
    # Every engine that served it, in order (more than one when resumed): (rank, engine id).
    engines: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    resumes: list[Resume] = dataclasses.field(default_factory=list)
    clock: EngineClock | None = None  # the engine clock of its stamps (its first engine's)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # of every sequence
    num_draft_tokens: int = 0  # speculative decoding: proposed, of every sequence
    num_accepted_tokens: int = 0  # and accepted
    # Engine clock, in arrival order, with the engine request (sequence) each belongs to.
    events: list[tuple[str, EngineCoreEvent]] = dataclasses.field(default_factory=list)
    first_token_ns: int | None = None  # engine clock: outputs that carried the first token
    last_token_ns: int | None = None  # engine clock: outputs that carried the latest token
    # Per sequence (engine request id): its latest token time, preemptions and finish reason.
    sequence_last_token_ns: dict[str, int] = dataclasses.field(default_factory=dict)
    sequence_preemptions: dict[str, int] = dataclasses.field(default_factory=dict)
    finish_reasons: dict[str, FinishReason] = dataclasses.field(default_factory=dict)
    output_token_ids: list[int] | None = None  # kept only when traces carry content
    # gateway wall ns = engine ns + this; fixed by ``close`` (None: no engine clock known)
    wall_offset_ns: int | None = None
    times: RequestTimes | None = None  # set by ``close``

    def to_wall_ns(self, engine_ns: int) -> int:
        """An engine instant on the gateway's wall clock (as placed when the call closed; the
        engine's own clock when the call never learnt its engine's)."""
        return engine_ns + (self.wall_offset_ns or 0)

    def close(self, clock_offset_ns: int | None, end_ns: int) -> RequestTimes:
        """Derive the call's ``RequestTimes`` (once: later calls return the same). ``end_ns``:
        gateway wall clock, when the gateway was done with the call."""
        if self.times is not None:
            return self.times
        self.wall_offset_ns = clock_offset_ns
        self.end_ns = max(end_ns, self.arrival_ns)
        queued, scheduled = self.queued_ns, self.scheduled_ns
        first, last = self.first_token_ns, self.last_token_ns
        self.times = RequestTimes(
            e2e_ns=self.end_ns - self.arrival_ns,
            ttft_ns=None
            if first is None or clock_offset_ns is None
            else max(0, first + clock_offset_ns - self.arrival_ns),
            queue_ns=_between(queued, scheduled),
            prefill_ns=_between(scheduled, first),
            decode_ns=_between(first, last),
            inference_ns=_between(scheduled, last),
            num_preemptions=self.num_preemptions,
            num_output_tokens=self.num_output_tokens,
        )
        return self.times

    def served_by(self, engine: tuple[int, str]) -> None:
        """An engine, (data-parallel rank, id), runs a sequence of it now."""
        self.engine_index, self.engine_id = engine
        if engine not in self.engines:
            self.engines.append(engine)

    def resumed(
        self, sequence: str, cut_off_on: tuple[int, str], taken_by: tuple[int, str]
    ) -> None:
        """``sequence`` was cut off on one engine and continues on another."""
        cut_ns = self.sequence_last_token_ns.get(sequence)
        self.resumes.append(Resume(sequence, cut_off_on, taken_by, cut_ns))
        self.served_by(taken_by)

    def record_output(self, output: EngineCoreOutput, timestamp_ns: int, shift_ns: int = 0) -> int:
        """Take in one engine output (``timestamp_ns``: its EngineCoreOutputs' stamp); return
        how many new tokens it carried. ``shift_ns`` places the stamps of an engine other than
        the timeline's first on that one's clock (a resumed stream)."""
        sequence = output.request_id
        timestamp_ns += shift_ns
        if output.events:
            self.events.extend(
                (sequence, EngineCoreEvent(event.type, event.timestamp_ns + shift_ns))
                for event in output.events
            )
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.num_preemptions:
            self.sequence_preemptions[sequence] = output.num_preemptions
        self.num_draft_tokens += output.num_draft_tokens
        self.num_accepted_tokens += output.num_accepted_tokens
        num_new = len(output.new_token_ids)
        if num_new:
            if self.first_token_ns is None:
                self.first_token_ns = timestamp_ns
            self.last_token_ns = timestamp_ns
            self.sequence_last_token_ns[sequence] = timestamp_ns
            self.num_output_tokens += num_new
            for resume in self.resumes:
                if resume.sequence == sequence and resume.continued_ns is None:
                    resume.continued_ns = timestamp_ns
            if self.output_token_ids is not None:
                self.output_token_ids.extend(output.new_token_ids)
        if output.finish_reason is not None:
            self.finish_reasons[sequence] = output.finish_reason
        return num_new

    @property
    def num_preemptions(self) -> int:
        return sum(self.sequence_preemptions.values())

    def first_event(self, event_type: EventType) -> int | None:
        """Engine clock: when the first event of this type happened, if the gateway knows."""
        for _, event in self.events:
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
        """Engine clock, in order: (PREEMPTED, that sequence's next SCHEDULED or None while it
        is still preempted)."""
        intervals: list[list[int | None]] = []
        open_by_sequence: dict[str, list[int | None]] = {}
        for sequence, event in self.events:
            if event.type == EventType.PREEMPTED and sequence not in open_by_sequence:
                interval: list[int | None] = [event.timestamp_ns, None]
                intervals.append(interval)
                open_by_sequence[sequence] = interval
            elif event.type == EventType.SCHEDULED and sequence in open_by_sequence:
                open_by_sequence.pop(sequence)[1] = event.timestamp_ns
        return [(start, end) for start, end in intervals if start is not None]
