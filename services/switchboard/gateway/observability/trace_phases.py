"""The phases of one request, on the gateway's wall clock: what its child spans are made of.

Pure functions of a ``RequestTimeline`` and a clock mapping (no OpenTelemetry here), so the
span tree can be tested with synthetic events.

The phases tile the request, from arrival to end, without gaps or overlaps::

    gateway.tokenize  arrival          -> submitted        tokenize and check the prompt
    gateway.dispatch  submitted        -> QUEUED           wire 1, the engine's input thread,
                                                           the busy loop picking it up
    engine.queue      QUEUED           -> first SCHEDULED  waiting for KV blocks / a batch slot
    engine.prefill    first SCHEDULED  -> first token      computing the prompt
    engine.decode     first token      -> last token       generating
    gateway.respond   last token       -> end              wire 1 back, detokenize, reply

so their durations add up to the request's. A phase whose start the gateway never learnt is
folded into the one before it (an engine that never reported QUEUED: the dispatch time counts
as queueing). A request that did not end normally (aborted, failed, cancelled) has no
``gateway.respond``: its last phase runs until it ended. Every instant is clamped into
[arrival, end] and kept in order, so a child never leaves its parent.

Preemptions overlap the tiling: one ``engine.preempted`` per PREEMPTED -> next SCHEDULED (or the
end, if the request ended while preempted). So do resumes: one ``engine.resumed`` per sequence
cut off by its engine's death, from its last token there (or submission, if it had none) to its
first token from the engine that took it (or the end), with both engines' ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from switchboard.gateway.observability.request_timeline import RequestTimeline

TOKENIZE = "gateway.tokenize"
DISPATCH = "gateway.dispatch"
QUEUE = "engine.queue"
PREFILL = "engine.prefill"
DECODE = "engine.decode"
RESPOND = "gateway.respond"
PREEMPTED = "engine.preempted"
RESUMED = "engine.resumed"
TILING = (TOKENIZE, DISPATCH, QUEUE, PREFILL, DECODE, RESPOND)

PREEMPTION_NUMBER = "switchboard.preemption.number"  # 1 for a request's first preemption
RESUME_NUMBER = "switchboard.resume.number"  # 1 for a request's first resume
RESUMED_FROM = "switchboard.resume.from_engine.index"  # the rank it was cut off on
RESUMED_ON = "switchboard.engine.index"  # the rank that took it


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
    name: str
    start_ns: int  # gateway wall clock
    end_ns: int
    attributes: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def request_phases(
    timeline: RequestTimeline, to_wall_ns: Callable[[int], int], ended_normally: bool
) -> list[Phase]:
    """The tiling phases, then one phase per preemption and per resume. Empty for a request
    that never got past tokenization (it has no engine time to show)."""
    start = timeline.arrival_ns
    end = timeline.end_ns if timeline.end_ns is not None else start
    end = max(end, start)
    if timeline.submitted_ns is None:
        return []

    def at_wall(engine_ns: int) -> int:
        return _clamp(to_wall_ns(engine_ns), start, end)

    def place(engine_ns: int | None) -> int | None:
        return None if engine_ns is None else at_wall(engine_ns)

    queued = place(timeline.queued_ns)
    marks: list[tuple[str, int | None]] = [
        (TOKENIZE, start),
        (DISPATCH, _clamp(timeline.submitted_ns, start, end)),
        (QUEUE, queued),
        (PREFILL, place(timeline.scheduled_ns)),
        (DECODE, place(timeline.first_token_ns)),
        (RESPOND, place(timeline.last_token_ns) if ended_normally else None),
    ]
    if queued is None:  # never heard of the engine: it was waiting for it all along
        marks[1] = (QUEUE, marks[1][1])
        marks[2] = (QUEUE, None)
    known = [(name, at) for name, at in marks if at is not None]
    phases = []
    previous = start
    for i, (name, at) in enumerate(known):
        begin = max(at, previous)
        finish = max(known[i + 1][1], begin) if i + 1 < len(known) else end
        phases.append(Phase(name, begin, finish))
        previous = finish
    for number, (preempted, resumed) in enumerate(timeline.preemptions(), start=1):
        begin = at_wall(preempted)
        finish = at_wall(resumed) if resumed is not None else end
        phases.append(Phase(PREEMPTED, begin, max(begin, finish), {PREEMPTION_NUMBER: number}))
    submitted = _clamp(timeline.submitted_ns, start, end)
    for number, resume in enumerate(timeline.resumes, start=1):
        begin = at_wall(resume.cut_ns) if resume.cut_ns is not None else submitted
        finish = at_wall(resume.continued_ns) if resume.continued_ns is not None else end
        attributes = {
            RESUME_NUMBER: number,
            RESUMED_FROM: resume.cut_off_on[0],
            RESUMED_ON: resume.taken_by[0],
        }
        phases.append(Phase(RESUMED, begin, max(begin, finish), attributes))
    return phases


def _clamp(value: int, low: int, high: int) -> int:
    return low if value < low else high if value > high else value
