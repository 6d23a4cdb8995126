"""The series inference routers score model servers by, under vLLM's own names.

Kubernetes inference routers (the Gateway API Inference Extension's endpoint picker as llm-d
deploys it, NVIDIA Dynamo, the Shepherd Model Gateway) scrape a model server's ``/metrics`` for
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:cache_config_info`` and ``vllm:lora_requests_info``. They are served beside the
``switchboard:`` series, always: a router that does not find them does not fail, it scores the
pod as idle and keeps sending to it.

The gauges take the same ``SchedulerStats`` record as their ``switchboard:`` twins, in the same
collect (so one scrape has equal values), labelled as vLLM labels them: ``model_name`` and
``engine`` (the data-parallel rank). The two ``_info`` series are vLLM's info-style gauges:
``cache_config_info`` is 1 with the engine's KV-cache settings as labels;
``lora_requests_info`` carries the adapters as labels and the time of the scrape as its value
(routers take the newest; ``lora_metrics.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from switchboard.gateway.observability.lora_metrics import LoraRequestsInfo
from switchboard.wire.engine_msgs import EngineReady, SchedulerStats

PREFIX = "vllm:"
CACHE_CONFIG_LABELS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "num_gpu_blocks",
    "engine",
)


class VllmNamedFamilies:
    """One scrape's ``vllm:`` families, filled engine by engine beside the ``switchboard:``
    ones (``metrics.EngineStatsCollector``)."""

    def __init__(self, labels: list[str], max_lora: int = 0) -> None:
        p = PREFIX
        self.running = GaugeMetricFamily(
            p + "num_requests_running",
            "Number of requests in model execution batches.",
            labels=labels,
        )
        self.waiting = GaugeMetricFamily(
            p + "num_requests_waiting", "Number of requests waiting to be processed.", labels=labels
        )
        self.kv = GaugeMetricFamily(
            p + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels
        )
        self.cache_config = GaugeMetricFamily(
            p + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(CACHE_CONFIG_LABELS),
        )
        self.lora = LoraRequestsInfo(p + "lora_requests_info", max_lora)

    def add(self, labels: list[str], ready: EngineReady, stats: SchedulerStats) -> None:
        """One engine's series (``labels``: its model_name and engine values)."""
        self.running.add_metric(labels, stats.num_running_reqs)
        self.waiting.add_metric(labels, stats.num_waiting_reqs)
        self.kv.add_metric(labels, stats.kv_cache_usage)
        self.cache_config.add_metric(cache_config_labels(ready), 1.0)
        self.lora.add(stats, labels, 0.0)

    def families(self, now: float | None = None) -> Iterator[Metric]:
        """Every family, the LoRA one stamped ``now`` (default: the time of the scrape)."""
        lora = self.lora.done(now)
        yield from (self.running, self.waiting, self.kv, self.cache_config, lora)


def cache_config_labels(ready: EngineReady) -> list[str]:
    """vLLM's ``CacheConfig`` fields as it prints them (``str()``: ``True``, ``16``), in the
    order of ``CACHE_CONFIG_LABELS``; the KV cache is always in the model's dtype, which vLLM
    calls ``auto``."""
    return [
        str(ready.block_size),
        "auto",
        str(ready.enable_prefix_caching),
        str(ready.num_gpu_blocks),
        str(ready.data_parallel_rank),
    ]
