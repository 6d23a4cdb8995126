"""Speculative decoding's counters under switchboard: and vllm: names, from SchedulerStats."""

from __future__ import annotations

from switchboard.gateway.observability.metrics import GatewayMetrics
from switchboard.wire.engine_msgs import SchedulerStats
from tests.gateway.test_metrics import engine


def test_spec_decode_counters_under_both_names() -> None:
    stats = SchedulerStats(
        spec_decode_num_drafts=10,
        spec_decode_num_draft_tokens=40,
        spec_decode_num_accepted_tokens=25,
        spec_decode_accepted_per_position=[9, 7, 5, 4],
        spec_decode_row_cost=0.25,
    )
    engines = [engine(0, stats), engine(1, SchedulerStats()), engine(2, stats, exports=False)]
    value = GatewayMetrics("m", 64, lambda: engines).registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    for prefix in ("switchboard:", "vllm:"):
        assert value(f"{prefix}spec_decode_num_drafts_total", labels) == 10
        assert value(f"{prefix}spec_decode_num_draft_tokens_total", labels) == 40
        assert value(f"{prefix}spec_decode_num_accepted_tokens_total", labels) == 25
        per_pos = f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"
        assert value(per_pos, {**labels, "position": "1"}) == 7
        idle = {"model_name": "m", "engine": "1"}
        assert value(f"{prefix}spec_decode_num_draft_tokens_total", idle) == 0
        other = {"model_name": "m", "engine": "2"}  # another gateway exports it
        assert value(f"{prefix}spec_decode_num_drafts_total", other) is None
    assert value("switchboard:spec_decode_row_cost", labels) == 0.25
    assert value("switchboard:spec_decode_row_cost", {"model_name": "m", "engine": "1"}) == 0.0
    assert value("vllm:spec_decode_row_cost", labels) is None  # no such vLLM series
