"""A resumed request as the gateway's observer records it: every engine that ran it, where it was
cut and continued, and one clock for its timeline although its engines' clocks disagree."""

from __future__ import annotations

import time
import types

from switchboard.gateway.engines.types import EngineHandle, StepOutput
from switchboard.gateway.observability.observer import RequestObserver
from switchboard.gateway.observability.stats_log import TokenCounts
from switchboard.wire.engine_msgs import EngineCoreOutput, EngineReady, FinishReason

MS = 1_000_000


class _Context:
    """What the observer reads of a gRPC call: nothing here."""

    def invocation_metadata(self) -> tuple:
        return ()

    def peer(self) -> str:
        return ""

    def code(self) -> None:
        return None

    def time_remaining(self) -> None:
        return None


def engine(rank: int, engine_id: str, offset_ns: int) -> EngineHandle:
    """An engine whose monotonic clock is ``offset_ns`` behind this gateway's wall clock."""
    now = time.time_ns()
    ready = EngineReady(engine_id, rank, 512, 16, 16, 256, now, now - offset_ns)
    return EngineHandle(identity=engine_id.encode(), ready=ready)


def observer() -> RequestObserver:
    observability = types.SimpleNamespace(
        counts=TokenCounts(), tracer=None, metrics=None, trace_content=False, model_name="m"
    )
    return RequestObserver(observability, "r", time.time(), _Context())  # type: ignore[arg-type]


def test_a_stream_resumed_on_an_engine_with_another_clock() -> None:
    first, second = engine(1, "e1", 1_000 * MS), engine(0, "e0", 7_000 * MS)
    seen = observer()
    seen.submitted({"r": first})
    at = time.time_ns() - 50 * MS  # gateway wall clock of the first token

    def output(on: EngineHandle, wall_ns: int, token: int, **fields: object) -> None:
        stamp = wall_ns - on.clock.offset  # the engine's own monotonic clock
        seen.on_event(StepOutput(EngineCoreOutput("r", [token], **fields), stamp, on))

    output(first, at, 5)
    output(first, at + 1 * MS, 6)
    output(second, at + 4 * MS, 7)  # the first engine died: resumed on the second
    output(second, at + 5 * MS, 8, finish_reason=FinishReason.LENGTH)
    timeline = seen.timeline
    assert timeline.engines == [(1, "e1"), (0, "e0")]
    assert (timeline.engine_index, timeline.engine_id) == (0, "e0")  # it ended there
    (resume,) = timeline.resumes
    assert (resume.cut_off_on, resume.taken_by) == ((1, "e1"), (0, "e0"))
    # every stamp on the first engine's clock: differences are the wall-clock ones
    assert resume.cut_ns is not None and resume.continued_ns is not None
    assert resume.continued_ns - resume.cut_ns == 3 * MS
    assert timeline.last_token_ns - timeline.first_token_ns == 5 * MS  # type: ignore[operator]
    assert timeline.clock is first.clock  # the one its stamps are on
    assert first.clock.to_wall_ns(timeline.first_token_ns) == at  # type: ignore[arg-type]
    assert timeline.num_output_tokens == 4


def test_sequences_on_two_engines_are_not_a_resume() -> None:
    # n = 2 spread over both engines at the start: each sequence stays where it was sent
    a, b = engine(0, "a", 0), engine(1, "b", 0)
    seen = observer()
    seen.submitted({"0_r": a, "1_r": b})
    now = time.time_ns() - 10 * MS
    seen.on_event(StepOutput(EngineCoreOutput("0_r", [1]), now, a))
    seen.on_event(StepOutput(EngineCoreOutput("1_r", [2]), now, b))
    seen.on_event(StepOutput(EngineCoreOutput("0_r", [3]), now + MS, a))
    assert seen.timeline.resumes == []
    assert seen.timeline.engines == [(0, "a"), (1, "b")]
