"""The span tree's phases from synthetic engine events: tiling, nesting, preemptions, clamping."""

from __future__ import annotations

from switchboard.gateway.observability.request_timeline import RequestTimeline
from switchboard.gateway.observability.trace_phases import (
    DECODE,
    DISPATCH,
    PREEMPTED,
    PREEMPTION_NUMBER,
    PREFILL,
    QUEUE,
    RESPOND,
    RESUME_NUMBER,
    RESUMED,
    RESUMED_FROM,
    RESUMED_ON,
    TOKENIZE,
    Phase,
    request_phases,
)
from switchboard.wire.engine_msgs import (
    EngineCoreEvent,
    EngineCoreOutput,
    EventType,
    FinishReason,
)

OFFSET = 1_000_000  # engine monotonic + OFFSET = gateway wall clock, in these tests


def to_wall(engine_ns: int) -> int:
    return engine_ns + OFFSET


def engine_ns(wall_ns: int) -> int:
    return wall_ns - OFFSET


def event(kind: EventType, wall_ns: int) -> EngineCoreEvent:
    return EngineCoreEvent(kind, engine_ns(wall_ns))


def timeline(
    *,
    arrival: int = 1_000,
    submitted: int | None = 1_100,
    end: int = 2_000,
    events: list[EngineCoreEvent] | None = None,
    tokens_at: list[int] | None = None,  # gateway wall times of outputs with one token each
) -> RequestTimeline:
    t = RequestTimeline("r", OFFSET + arrival, submitted_ns=None)
    if submitted is not None:
        t.submitted_ns = OFFSET + submitted
    t.end_ns = OFFSET + end
    pending = list(events or [])
    for at in tokens_at or []:
        t.record_output(EngineCoreOutput("r", [7], events=pending or None), engine_ns(OFFSET + at))
        pending = []
    if pending:
        t.record_output(EngineCoreOutput("r", [], events=pending), 0)
    return t


def tiling(phases: list[Phase]) -> list[Phase]:
    return [p for p in phases if p.name not in (PREEMPTED, RESUMED)]


def assert_tiles(phases: list[Phase], t: RequestTimeline) -> None:
    """Contiguous, ordered, inside [arrival, end], durations adding up to the request's."""
    tiles = tiling(phases)
    assert tiles[0].start_ns == t.arrival_ns and tiles[-1].end_ns == t.end_ns
    for before, after in zip(tiles, tiles[1:], strict=False):
        assert before.end_ns == after.start_ns
    assert all(t.arrival_ns <= p.start_ns <= p.end_ns <= t.end_ns for p in phases)
    assert sum(p.duration_ns for p in tiles) == t.end_ns - t.arrival_ns


def test_a_finished_request_tiles_into_six_phases() -> None:
    t = timeline(
        events=[
            event(EventType.QUEUED, OFFSET + 1_150),
            event(EventType.SCHEDULED, OFFSET + 1_300),
        ],
        tokens_at=[1_500, 1_600, 1_700],
    )
    phases = request_phases(t, to_wall, ended_normally=True)
    assert [(p.name, p.start_ns - OFFSET, p.end_ns - OFFSET) for p in phases] == [
        (TOKENIZE, 1_000, 1_100),
        (DISPATCH, 1_100, 1_150),
        (QUEUE, 1_150, 1_300),
        (PREFILL, 1_300, 1_500),
        (DECODE, 1_500, 1_700),
        (RESPOND, 1_700, 2_000),
    ]
    assert_tiles(phases, t)


def test_each_preemption_is_one_span_from_preempted_to_the_next_scheduled() -> None:
    t = timeline(
        events=[
            event(EventType.QUEUED, OFFSET + 1_150),
            event(EventType.SCHEDULED, OFFSET + 1_200),
            event(EventType.PREEMPTED, OFFSET + 1_250),
            event(EventType.SCHEDULED, OFFSET + 1_400),
        ],
        tokens_at=[1_450],
    )
    t.record_output(
        EngineCoreOutput(
            "r",
            [8],
            events=[
                event(EventType.PREEMPTED, OFFSET + 1_500),
                event(EventType.SCHEDULED, OFFSET + 1_600),
            ],
        ),
        engine_ns(OFFSET + 1_650),
    )
    phases = request_phases(t, to_wall, ended_normally=True)
    preempted = [(p.start_ns - OFFSET, p.end_ns - OFFSET, p.attributes) for p in phases]
    preempted = [p for p, phase in zip(preempted, phases, strict=True) if phase.name == PREEMPTED]
    assert preempted == [
        (1_250, 1_400, {PREEMPTION_NUMBER: 1}),
        (1_500, 1_600, {PREEMPTION_NUMBER: 2}),
    ]
    prefill = next(p for p in phases if p.name == PREFILL)
    assert (prefill.start_ns - OFFSET, prefill.end_ns - OFFSET) == (1_200, 1_450)  # first SCHEDULED
    assert_tiles(phases, t)


def test_aborted_before_the_engine_reported_anything_is_all_queue_after_tokenize() -> None:
    t = timeline()
    phases = request_phases(t, to_wall, ended_normally=False)
    assert [(p.name, p.start_ns - OFFSET, p.end_ns - OFFSET) for p in phases] == [
        (TOKENIZE, 1_000, 1_100),
        (QUEUE, 1_100, 2_000),
    ]
    assert_tiles(phases, t)


def test_aborted_while_decoding_ends_decode_at_the_abort() -> None:
    t = timeline(
        events=[
            event(EventType.QUEUED, OFFSET + 1_150),
            event(EventType.SCHEDULED, OFFSET + 1_300),
        ],
        tokens_at=[1_500, 1_600],
    )
    phases = request_phases(t, to_wall, ended_normally=False)
    assert [p.name for p in phases] == [TOKENIZE, DISPATCH, QUEUE, PREFILL, DECODE]
    assert phases[-1].end_ns == t.end_ns
    assert_tiles(phases, t)


def test_preempted_when_it_ended_runs_to_the_end() -> None:
    t = timeline(
        events=[
            event(EventType.QUEUED, OFFSET + 1_150),
            event(EventType.SCHEDULED, OFFSET + 1_200),
        ],
        tokens_at=[1_300],
    )
    t.record_output(
        EngineCoreOutput("r", [], events=[event(EventType.PREEMPTED, OFFSET + 1_400)]), 0
    )
    phases = request_phases(t, to_wall, ended_normally=False)
    (preempted,) = [p for p in phases if p.name == PREEMPTED]
    assert (preempted.start_ns - OFFSET, preempted.end_ns - OFFSET) == (1_400, 2_000)
    assert_tiles(phases, t)


def test_a_request_that_never_reached_an_engine_has_no_phases() -> None:
    assert request_phases(timeline(submitted=None), to_wall, ended_normally=False) == []


def test_engine_times_outside_the_request_are_clamped_into_it() -> None:
    # A badly placed engine clock (events before the arrival and after the end) must still
    # give children inside their parent, in order, tiling the request.
    t = timeline(
        events=[event(EventType.QUEUED, OFFSET + 10), event(EventType.SCHEDULED, OFFSET + 20)],
        tokens_at=[5_000, 6_000],
    )
    phases = request_phases(t, to_wall, ended_normally=True)
    assert [p.name for p in phases] == [TOKENIZE, DISPATCH, QUEUE, PREFILL, DECODE, RESPOND]
    assert_tiles(phases, t)


def test_timeline_counts_tokens_and_keeps_first_and_last_token_times() -> None:
    t = timeline(
        events=[
            event(EventType.QUEUED, OFFSET + 1_150),
            event(EventType.SCHEDULED, OFFSET + 1_300),
        ],
        tokens_at=[1_500, 1_600, 1_700],
    )
    assert t.num_output_tokens == 3
    assert (t.first_token_ns, t.last_token_ns) == (
        engine_ns(OFFSET + 1_500),
        engine_ns(OFFSET + 1_700),
    )
    assert t.queued_ns == engine_ns(OFFSET + 1_150) and t.scheduled_ns == engine_ns(OFFSET + 1_300)


def test_sequences_of_one_call_pair_their_own_preemptions() -> None:
    # n = 2: two engine requests; their preemptions interleave, each resumes on its own.
    t = RequestTimeline("r", OFFSET, submitted_ns=OFFSET + 10)
    t.end_ns = OFFSET + 1_000

    def output(sequence: str, at: int, *events: tuple[EventType, int], preemptions: int = 0):
        stamped = [EngineCoreEvent(kind, wall - OFFSET) for kind, wall in events]
        out = EngineCoreOutput(sequence, [1], events=stamped or None, num_preemptions=preemptions)
        t.record_output(out, at - OFFSET)

    output("0_r", OFFSET + 100, (EventType.QUEUED, OFFSET + 20), (EventType.SCHEDULED, OFFSET + 30))
    output("1_r", OFFSET + 110, (EventType.QUEUED, OFFSET + 21), (EventType.SCHEDULED, OFFSET + 40))
    output(
        "1_r",
        OFFSET + 400,
        (EventType.PREEMPTED, OFFSET + 250),
        (EventType.SCHEDULED, OFFSET + 350),
        preemptions=1,
    )
    output(
        "0_r",
        OFFSET + 500,
        (EventType.PREEMPTED, OFFSET + 200),
        (EventType.SCHEDULED, OFFSET + 450),
        preemptions=1,
    )
    assert t.preemptions() == [(250, 350), (200, 450)]  # engine clock = wall - OFFSET
    assert t.num_preemptions == 2 and t.num_output_tokens == 4
    assert (t.queued_ns, t.scheduled_ns) == (20, 30)  # the first sequence to get there
    assert t.sequence_last_token_ns == {"0_r": 500, "1_r": 400}
    phases = request_phases(t, to_wall, ended_normally=True)
    assert_tiles(phases, t)
    assert len([p for p in phases if p.name == PREEMPTED]) == 2


def test_a_resumed_stream_shows_both_engines_on_one_clock() -> None:
    """Cut off on rank 1 after two tokens, continued on rank 0, whose clock runs SKEW ahead:
    its stamps are placed on the first engine's clock, and one engine.resumed phase spans the
    cut (last token on rank 1 -> first token on rank 0)."""
    skew = 5_000
    t = RequestTimeline("r", OFFSET, submitted_ns=OFFSET + 10)
    t.served_by((1, "e1"))
    queued = [EngineCoreEvent(EventType.QUEUED, 20), EngineCoreEvent(EventType.SCHEDULED, 30)]
    t.record_output(EngineCoreOutput("r", [7], events=queued), 100)
    t.record_output(EngineCoreOutput("r", [8]), 200)
    t.resumed("r", (1, "e1"), (0, "e0"))
    again = [
        EngineCoreEvent(EventType.QUEUED, 600 + skew),
        EngineCoreEvent(EventType.SCHEDULED, 650 + skew),
    ]
    t.record_output(EngineCoreOutput("r", [9], events=again), 700 + skew, shift_ns=-skew)
    t.record_output(EngineCoreOutput("r", [10], finish_reason=FinishReason.STOP), 800 + skew, -skew)
    t.end_ns = OFFSET + 900
    assert t.engines == [(1, "e1"), (0, "e0")]
    assert (t.engine_index, t.engine_id) == (0, "e0")  # the engine that ran it last
    assert (t.queued_ns, t.scheduled_ns) == (20, 30)  # the first engine's
    assert (t.first_token_ns, t.last_token_ns) == (100, 800)
    assert t.num_output_tokens == 4
    phases = request_phases(t, to_wall, ended_normally=True)
    assert_tiles(phases, t)
    (resumed,) = [p for p in phases if p.name == RESUMED]
    assert (resumed.start_ns, resumed.end_ns) == (OFFSET + 200, OFFSET + 700)
    assert resumed.attributes == {RESUME_NUMBER: 1, RESUMED_FROM: 1, RESUMED_ON: 0}


def test_a_stream_cut_off_before_its_first_token_resumes_from_submission() -> None:
    t = RequestTimeline("r", OFFSET, submitted_ns=OFFSET + 10)
    t.served_by((0, "a"))
    t.resumed("r", (0, "a"), (0, "b"))  # the restarted engine of the same rank
    t.end_ns = OFFSET + 500
    (resumed,) = [p for p in request_phases(t, to_wall, False) if p.name == RESUMED]
    assert (resumed.start_ns, resumed.end_ns) == (OFFSET + 10, OFFSET + 500)
    assert t.engines == [(0, "a"), (0, "b")]
