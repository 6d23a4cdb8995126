"""The gateway's Prometheus series: engine-level from SchedulerStats, request-level, /metrics."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest

from switchboard.gateway.engines.types import EngineHandle, EngineState
from switchboard.gateway.observability.metrics import GatewayMetrics, tokens_buckets
from switchboard.wire.engine_msgs import ITERATION_TOKENS_BUCKETS, EngineReady, SchedulerStats


def engine(
    rank: int, stats: SchedulerStats | None, alive: bool = True, exports: bool = True
) -> EngineHandle:
    """``exports``: the engine named this gateway the exporter of its engine-level series."""
    ready = EngineReady(f"e{rank}", rank, 64, 10, 16, 160, 0, 0)
    handle = EngineHandle(
        identity=b"x", ready=ready, scheduler_stats=stats, exports_engine_stats=exports
    )
    if not alive:
        handle.state = EngineState.DEAD
    return handle


def iteration_counts(steps: dict[int, int]) -> list[int]:
    """Counts per bucket for {bucket index: steps}."""
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    for index, n in steps.items():
        counts[index] = n
    return counts


def test_engine_series_come_from_each_live_engines_stats() -> None:
    stats = SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        num_preemptions=3,
        iteration_tokens_counts=iteration_counts({0: 5, 2: 1, 13: 1}),  # 1, <=16, >16384
        iteration_tokens_sum=5 + 12 + 20000,
    )
    engines = [engine(0, stats), engine(1, SchedulerStats()), engine(2, stats, alive=False)]
    metrics = GatewayMetrics("m", 64, lambda: engines)
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("switchboard:num_requests_running", labels) == 2
    assert value("switchboard:num_requests_waiting", labels) == 1
    assert value("switchboard:kv_cache_usage_perc", labels) == 0.25
    assert value("switchboard:prefix_cache_queries_total", labels) == 100
    assert value("switchboard:prefix_cache_hits_total", labels) == 40
    assert value("switchboard:num_preemptions_total", labels) == 3
    bucket = "switchboard:iteration_tokens_total_bucket"
    assert value(bucket, {**labels, "le": "1.0"}) == 5
    assert value(bucket, {**labels, "le": "8.0"}) == 5
    assert value(bucket, {**labels, "le": "16.0"}) == 6
    assert value(bucket, {**labels, "le": "16384.0"}) == 6
    assert value(bucket, {**labels, "le": "+Inf"}) == 7
    assert value("switchboard:iteration_tokens_total_count", labels) == 7
    assert value("switchboard:iteration_tokens_total_sum", labels) == 20017
    assert value("switchboard:num_requests_running", {"model_name": "m", "engine": "1"}) == 0
    assert value("switchboard:num_requests_running", {"model_name": "m", "engine": "2"}) is None


def test_only_the_gateway_an_engine_names_has_its_engine_series() -> None:
    stats = SchedulerStats(num_running_reqs=1)
    engines = [engine(0, stats, exports=False), engine(1, stats)]
    metrics = GatewayMetrics("m", 64, lambda: engines)
    text = generate_latest(metrics.registry).decode()
    assert 'switchboard:num_requests_running{engine="0"' not in text  # another gateway's
    assert 'switchboard:num_requests_running{engine="1",model_name="m"} 1.0' in text
    assert "switchboard:time_to_first_token_seconds" in text  # request-level: every gateway


def test_request_series() -> None:
    metrics = GatewayMetrics("m", 64, list)
    requests = metrics.requests
    requests.first_token("0", 0.05, prompt=10, cached=4)
    requests.tokens("0", 1, None)
    requests.tokens("0", 2, 0.02)
    phases = {"queue": 0.01, "prefill": 0.04, "decode": 0.2, "inference": 0.24}
    requests.finished("0", ["length"], 0.3, phases, num_prompt_tokens=10, num_output_tokens=3)
    requests.gen_ai("", 0.3, 0.05, 0.1, 10, 3)
    requests.gen_ai("UNAVAILABLE", 0.1, None, None, 10, 0)
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("switchboard:prompt_tokens_total", labels) == 10
    assert value("switchboard:prompt_tokens_cached_total", labels) == 4
    assert value("switchboard:generation_tokens_total", labels) == 3
    assert value("switchboard:time_to_first_token_seconds_sum", labels) == 0.05
    assert value("switchboard:inter_token_latency_seconds_count", labels) == 1
    assert value("switchboard:request_success_total", {**labels, "finished_reason": "length"}) == 1
    assert value("switchboard:e2e_request_latency_seconds_sum", labels) == 0.3
    assert value("switchboard:request_queue_time_seconds_sum", labels) == 0.01
    assert value("switchboard:request_prefill_time_seconds_sum", labels) == 0.04
    assert value("switchboard:request_decode_time_seconds_sum", labels) == 0.2
    assert value("switchboard:request_inference_time_seconds_sum", labels) == 0.24
    assert value("switchboard:request_time_per_output_token_seconds_sum", labels) == 0.1
    assert value("switchboard:request_prompt_tokens_sum", labels) == 10
    assert value("switchboard:request_generation_tokens_sum", labels) == 3
    gen_ai = {
        "gen_ai_operation_name": "text_completion",
        "gen_ai_provider_name": "switchboard",
        "gen_ai_request_model": "m",
    }
    duration = "gen_ai_server_request_duration_seconds_count"
    assert value(duration, {**gen_ai, "error_type": ""}) == 1
    assert value(duration, {**gen_ai, "error_type": "UNAVAILABLE"}) == 1
    assert value("gen_ai_server_time_to_first_token_seconds_count", gen_ai) == 1  # OK only
    assert value("gen_ai_server_time_per_output_token_seconds_sum", gen_ai) == 0.1
    usage = "gen_ai_client_token_usage_sum"
    assert value(usage, {**gen_ai, "gen_ai_token_type": "input"}) == 20
    assert value(usage, {**gen_ai, "gen_ai_token_type": "output"}) == 3


def test_request_length_buckets_follow_1_2_5_up_to_max_model_len() -> None:
    assert tokens_buckets(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    assert tokens_buckets(64) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)


def test_metrics_are_served_over_http() -> None:
    metrics = GatewayMetrics("m", 64, lambda: [engine(0, SchedulerStats())])
    port = metrics.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert 'switchboard:num_requests_running{engine="0",model_name="m"} 0.0' in text
        assert "process_cpu_seconds_total" in text
    finally:
        metrics.stop()


def test_vllm_named_series_equal_their_switchboard_twins() -> None:
    """What inference routers scrape, under vLLM's names and labels, from the same stats."""
    busy = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5)
    engines = [engine(0, busy), engine(1, SchedulerStats()), engine(2, busy, exports=False)]
    metrics = GatewayMetrics("m", 64, lambda: engines)
    value = metrics.registry.get_sample_value
    for rank in ("0", "1"):
        labels = {"model_name": "m", "engine": rank}
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            ours = value(f"switchboard:{name}", labels)
            assert ours is not None and value(f"vllm:{name}", labels) == ours, (name, rank)
    assert value("vllm:num_requests_waiting", {"model_name": "m", "engine": "0"}) == 2
    assert value("vllm:num_requests_running", {"model_name": "m", "engine": "2"}) is None
    cache = {
        "engine": "0",
        "block_size": "16",
        "num_gpu_blocks": "10",
        "enable_prefix_caching": "True",
        "cache_dtype": "auto",
    }
    assert value("vllm:cache_config_info", cache) == 1
    assert value("vllm:cache_config_info", {**cache, "engine": "2"}) is None
    lora = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    stamped = value("vllm:lora_requests_info", lora)
    assert stamped is not None and stamped > 1.7e9  # the scrape's time, as vLLM's
