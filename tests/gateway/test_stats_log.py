"""The periodic stats line: throughput over the interval, engine state, silence when idle."""

from __future__ import annotations

from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.observability.stats_log import StatsLogger, TokenCounts
from switchboard.wire.engine_msgs import EngineReady, SchedulerStats


def test_a_line_per_busy_interval_then_one_idle_line_then_silence() -> None:
    counts = TokenCounts()
    handle = EngineHandle(identity=b"x", ready=EngineReady("e0", 0, 64, 10, 16, 160, 0, 0))
    stats_logger = StatsLogger(0, 10.0, counts, lambda: [handle])
    start = stats_logger._last_time

    counts.prompt_tokens, counts.generation_tokens, counts.requests_in_flight = 100, 50, 2
    handle.scheduler_stats = SchedulerStats(
        num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5,
        prefix_cache_queries=100, prefix_cache_hits=25, num_preemptions=1,
    )  # fmt: skip
    line = stats_logger.line(start + 10.0)
    assert line is not None
    assert "Gateway_0: prompt 10.0 tokens/s, generation 5.0 tokens/s, 2 requests in flight" in line
    assert "engine 0: running 2, waiting 1, KV cache 50.0%, prefix cache hit rate 25.0%" in line

    counts.requests_in_flight = 0
    handle.scheduler_stats = SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=25)
    idle = stats_logger.line(start + 20.0)  # the first idle interval: gauges seen back at zero
    assert idle is not None and "running 0, waiting 0" in idle and "generation 0.0" in idle
    assert stats_logger.line(start + 30.0) is None
