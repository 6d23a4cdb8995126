"""The gateway's LoRA side without engines: which adapter a request asks for (never a silent
fallback to the base model), and ``lora_requests_info`` from the engines' stats."""

from __future__ import annotations

import grpc
import pytest

from switchboard.config.lora import LoraConfig
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.lora_names import LoraNames
from switchboard.gateway.observability.metrics import GatewayMetrics
from switchboard.gateway.observability.stats_log import StatsLogger, TokenCounts
from switchboard.wire.engine_msgs import SchedulerStats
from tests.gateway.test_metrics import engine


def test_a_request_names_an_adapter_by_model_or_lora_adapter():
    names = LoraNames(LoraConfig(enable_lora=True, lora_modules=["sql=/a", "chat=/b"]))
    assert names.choose("", "", "base") == ""
    assert names.choose("base", "", "base") == ""
    assert names.choose("sql", "", "base") == "sql"
    assert names.choose("", "chat", "base") == "chat"
    assert names.choose("base", "chat", "base") == "chat"
    assert names.choose("chat", "chat", "base") == "chat"
    with pytest.raises(ApiError) as unknown_model:
        names.choose("nope", "", "base")
    assert unknown_model.value.code == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in unknown_model.value.message and "sql" in unknown_model.value.message
    with pytest.raises(ApiError) as unknown_adapter:
        names.choose("", "nope", "base")
    assert unknown_adapter.value.code == grpc.StatusCode.NOT_FOUND
    assert unknown_adapter.value.message == (
        "LoRA adapter 'nope' is not loaded (loaded: ['chat', 'sql'])"
    )
    with pytest.raises(ApiError) as both:
        names.choose("sql", "chat", "base")
    assert both.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_without_enable_lora_an_adapter_name_is_not_found():
    names = LoraNames(LoraConfig(lora_modules=["sql=/a"]))  # ignored without --enable-lora
    with pytest.raises(ApiError, match="without --enable-lora") as error:
        names.choose("", "sql", "base")
    assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_lora_requests_info_lists_the_running_and_waiting_adapters():
    stats = [
        SchedulerStats(running_lora_adapters=["a", "b"], waiting_lora_adapters=["c"]),
        SchedulerStats(running_lora_adapters=["b", "d"]),
    ]
    metrics = GatewayMetrics("m", 64, lambda: [engine(0, stats[0]), engine(1, stats[1])], 4)
    value = metrics.registry.get_sample_value
    together = {"max_lora": "4", "running_lora_adapters": "a,b,d", "waiting_lora_adapters": "c"}
    assert value("vllm:lora_requests_info", together) > 1.7e9  # the scrape's time
    per_engine = [
        {"running_lora_adapters": "a,b", "waiting_lora_adapters": "c"},
        {"running_lora_adapters": "b,d", "waiting_lora_adapters": ""},
    ]
    for rank, labels in enumerate(per_engine):
        series = {"model_name": "m", "engine": str(rank), "max_lora": "4", **labels}
        assert value("switchboard:lora_requests_info", series) > 1.7e9


def test_the_stats_line_names_the_adapters_in_use():
    counts = TokenCounts()
    handle = engine(0, SchedulerStats(num_running_reqs=2, running_lora_adapters=["sql"]))
    line = StatsLogger(0, 10.0, counts, lambda: [handle]).line(0.0)
    assert line is not None and line.endswith(", LoRA running sql waiting -")
    handle.scheduler_stats = SchedulerStats(num_running_reqs=1)
    assert "LoRA" not in (StatsLogger(0, 10.0, counts, lambda: [handle]).line(0.0) or "")
