"""Prometheus metrics of one gateway, served as text on ``http(s)://<host>:<metrics port>/metrics``
(``metrics_server.py``: HTTPS when the fronts have TLS, and a bearer token when one is set).

Names and meanings are vLLM V1's under the prefix ``switchboard:`` (docs/observability.md lists
every one), plus the OpenTelemetry GenAI histograms under their Prometheus names, and the few
series inference routers read under vLLM's own ``vllm:`` names (``vllm_names.py``).

Who exports what, so that sums across gateways and engines are right:

* **request-level** series (latencies, token counts, request_success) are observed by the
  gateway that served the request, once; each carries the ``engine`` that ran it. Summing over
  gateways is correct.
* **engine-level** series (running / waiting gauges, KV usage, prefix-cache counters,
  preemptions, iteration tokens) are the engine's own numbers: counters are the engine's
  cumulative values since its start (a restart is an ordinary counter reset), gauges its latest
  state, both from the ``SchedulerStats`` every engine sends with its outputs and heartbeats.
  Each engine names one gateway, of all it talks to, as their exporter
  (``EngineCoreOutputs.exports_engine_stats``: the lowest ``client_index``, gateway 0 on one
  machine), so no engine is counted twice and none is missing, however many gateways there are.
"""

from __future__ import annotations

import logging
import math
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.observability.lora_metrics import LoraRequestsInfo
from switchboard.gateway.observability.metrics_server import CheckScrape, MetricsServer
from switchboard.gateway.observability.spec_decode_metrics import SpecDecodeMetrics
from switchboard.gateway.observability.vllm_names import VllmNamedFamilies
from switchboard.wire.engine_msgs import ITERATION_TOKENS_BUCKETS

logger = logging.getLogger(__name__)

PREFIX = "switchboard:"
LABELS = ("model_name", "engine")

# vLLM's bucket families (vllm/v1/metrics/buckets.py), so dashboards compare like with like.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
# OpenTelemetry GenAI semantic conventions' advised boundaries.
GENAI_DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
GENAI_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
GENAI_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
GENAI_TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1, 4, 16 ... 67108864
GENAI_LABELS = ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model")


def tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50 ... up to max_model_len (vLLM's request-length buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max(max_model_len, 1):
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class RequestMetrics:
    """Request-level series; every method takes the engine label of the request."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        p = PREFIX

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(p + name, doc, [*LABELS, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(p + name, doc, LABELS, registry=registry, buckets=tuple(buckets))

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed (prompt tokens).")
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens served from the prefix cache."
        )
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.resumed = counter(
            "requests_resumed",
            "Streams cut off by an engine's death and resumed, by the engine that took them "
            "(engine) and the one they were cut off on (from_engine).",
            ("from_engine",),
        )
        self.stalls = counter(
            "request_stalls",
            "Streams that got no token for longer than --stall-warn-s while their engine was "
            "alive, once per pause.",
        )
        self.request_success = counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between engine outputs of a request.", ITL_BUCKETS
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Decode time per output token after the first, per request.",
            ITL_BUCKETS,
        )
        latency = REQUEST_LATENCY_BUCKETS
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", latency)
        self.queue = histogram("request_queue_time_seconds", "Time in the WAITING phase.", latency)
        self.prefill = histogram(
            "request_prefill_time_seconds", "Time in the PREFILL phase.", latency
        )
        self.decode = histogram("request_decode_time_seconds", "Time in the DECODE phase.", latency)
        self.inference = histogram(
            "request_inference_time_seconds", "Time in the RUNNING phase.", latency
        )
        lengths = tokens_buckets(max_model_len)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.output_len = histogram(
            "request_generation_tokens", "Generated tokens per request.", lengths
        )
        self.gen_ai_duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "GenAI server request duration (time to last output token).",
            [*GENAI_LABELS, "error_type"],
            registry=registry,
            buckets=GENAI_DURATION_BUCKETS,
        )
        self.gen_ai_ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time to generate the first token, successful requests.",
            GENAI_LABELS,
            registry=registry,
            buckets=GENAI_TTFT_BUCKETS,
        )
        self.gen_ai_tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first, successful requests.",
            GENAI_LABELS,
            registry=registry,
            buckets=GENAI_TPOT_BUCKETS,
        )
        self.gen_ai_tokens = Histogram(
            "gen_ai_client_token_usage",
            "Input and output tokens per request (gen_ai.client.token.usage).",
            [*GENAI_LABELS, "gen_ai_token_type"],
            registry=registry,
            buckets=GENAI_TOKEN_BUCKETS,
        )
        self._gen_ai_labels = ("text_completion", "switchboard", model_name)
        self._token_series: dict[str, tuple[Counter, Histogram]] = {}

    def labels(self, engine: str) -> tuple[str, str]:
        return (self.model_name, engine)

    def first_token(self, engine: str, ttft_s: float, prompt: int, cached: int) -> None:
        labels = self.labels(engine)
        self.ttft.labels(*labels).observe(ttft_s)
        self.prompt_tokens.labels(*labels).inc(prompt)
        self.prompt_tokens_cached.labels(*labels).inc(cached)

    def tokens(self, engine: str, num_tokens: int, inter_token_s: float | None) -> None:
        # Once per streamed token: the labelled series are looked up once per engine, not
        # per call (``labels()`` validates and locks each time).
        series = self._token_series.get(engine)
        if series is None:
            labels = self.labels(engine)
            series = self.generation_tokens.labels(*labels), self.itl.labels(*labels)
            self._token_series[engine] = series
        generated, itl = series
        generated.inc(num_tokens)
        if inter_token_s is not None:
            itl.observe(inter_token_s)

    def finished(
        self,
        engine: str,
        finished_reasons: list[str],
        e2e_s: float,
        phases_s: dict[str, float | None],
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> None:
        """A request the engine worked on ended: one finish reason per sequence (``n``);
        ``phases_s``: queue, prefill, decode, inference (None where it never got that far)."""
        labels = self.labels(engine)
        for reason in finished_reasons:
            self.request_success.labels(*labels, reason).inc()
        self.e2e.labels(*labels).observe(e2e_s)
        for name in ("queue", "prefill", "decode", "inference"):
            value = phases_s.get(name)
            if value is not None:
                getattr(self, name).labels(*labels).observe(value)
        self.prompt_len.labels(*labels).observe(num_prompt_tokens)
        self.output_len.labels(*labels).observe(num_output_tokens)
        decode = phases_s.get("decode")
        if decode is not None and num_output_tokens > 1:
            self.tpot.labels(*labels).observe(decode / (num_output_tokens - 1))

    def gen_ai(
        self,
        error_type: str,
        duration_s: float,
        ttft_s: float | None,
        tpot_s: float | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> None:
        """The OpenTelemetry GenAI histograms (TTFT and TPOT for successful requests only)."""
        g = self._gen_ai_labels
        self.gen_ai_duration.labels(*g, error_type).observe(duration_s)
        if not error_type:
            if ttft_s is not None:
                self.gen_ai_ttft.labels(*g).observe(ttft_s)
            if tpot_s is not None:
                self.gen_ai_tpot.labels(*g).observe(tpot_s)
        self.gen_ai_tokens.labels(*g, "input").observe(num_prompt_tokens)
        self.gen_ai_tokens.labels(*g, "output").observe(num_output_tokens)


class EngineStatsCollector(Collector):
    """Engine-level series from each live engine's latest ``SchedulerStats``, at scrape time."""

    def __init__(
        self, model_name: str, engines: Callable[[], list[EngineHandle]], max_lora: int = 0
    ) -> None:
        self._model_name = model_name
        self._engines = engines
        self._max_lora = max_lora  # LoRA adapters an engine runs at once (0: LoRA off)

    def describe(self) -> Iterable[Metric]:
        lora = LoraRequestsInfo(PREFIX + "lora_requests_info", self._max_lora, LABELS)
        return [
            *self._families(),
            lora.done(),
            *VllmNamedFamilies(list(LABELS)).families(),
            *SpecDecodeMetrics(list(LABELS)).families(),
        ]

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        vllm_named = VllmNamedFamilies(list(LABELS), self._max_lora)
        spec_decode = SpecDecodeMetrics(list(LABELS))
        lora = LoraRequestsInfo(PREFIX + "lora_requests_info", self._max_lora, LABELS)
        now = time.time()
        for engine in self._engines():
            stats = engine.scheduler_stats
            if not engine.alive or stats is None or not engine.exports_engine_stats:
                continue  # another gateway exports this engine's series
            labels = [self._model_name, str(engine.ready.data_parallel_rank)]
            vllm_named.add(labels, engine.ready, stats)  # the same record: equal values
            spec_decode.add(labels, stats)
            families.running.add_metric(labels, stats.num_running_reqs)
            families.waiting.add_metric(labels, stats.num_waiting_reqs)
            families.kv.add_metric(labels, stats.kv_cache_usage)
            families.queries.add_metric(labels, stats.prefix_cache_queries)
            families.hits.add_metric(labels, stats.prefix_cache_hits)
            families.preemptions.add_metric(labels, stats.num_preemptions)
            families.stalled.add_metric(labels, 1.0 if stats.stalled_worker_rank >= 0 else 0.0)
            lora.add(stats, labels, now)
            counts = stats.iteration_tokens_counts
            if len(counts) == len(ITERATION_TOKENS_BUCKETS) + 1:
                families.iteration.add_metric(
                    labels, list(_cumulative_buckets(counts)), stats.iteration_tokens_sum
                )
        return [*families, lora.done(), *vllm_named.families(now), *spec_decode.families()]

    def _families(self) -> _EngineFamilies:
        p, labels = PREFIX, list(LABELS)
        return _EngineFamilies(
            running=GaugeMetricFamily(
                p + "num_requests_running", "Requests in model execution batches.", labels=labels
            ),
            waiting=GaugeMetricFamily(
                p + "num_requests_waiting", "Requests waiting to be processed.", labels=labels
            ),
            kv=GaugeMetricFamily(
                p + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.", labels=labels
            ),
            queries=CounterMetricFamily(
                p + "prefix_cache_queries",
                "Prefix-cache queries, in tokens.",
                labels=labels,
            ),
            hits=CounterMetricFamily(
                p + "prefix_cache_hits", "Prefix-cache hits, in tokens.", labels=labels
            ),
            preemptions=CounterMetricFamily(
                p + "num_preemptions", "Cumulative preemptions by the engine.", labels=labels
            ),
            iteration=HistogramMetricFamily(
                p + "iteration_tokens_total", "Tokens per engine step.", labels=labels
            ),
            stalled=GaugeMetricFamily(
                p + "engine_worker_stalled",
                "1 while a worker of the engine has not answered a step within --step-timeout-s "
                "(the engine takes no new requests meanwhile).",
                labels=labels,
            ),
        )


class _EngineFamilies(NamedTuple):
    """One scrape's engine-level metric families, in exposition order."""

    running: GaugeMetricFamily
    waiting: GaugeMetricFamily
    kv: GaugeMetricFamily
    queries: CounterMetricFamily
    hits: CounterMetricFamily
    preemptions: CounterMetricFamily
    iteration: HistogramMetricFamily
    stalled: GaugeMetricFamily


def _cumulative_buckets(counts: list[int]) -> Iterator[tuple[str, float]]:
    total = 0
    for bound, count in zip((*ITERATION_TOKENS_BUCKETS, math.inf), counts, strict=True):
        total += count
        yield ("+Inf" if bound == math.inf else str(float(bound)), float(total))


class GatewayMetrics:
    """The registry of one gateway, its series and its HTTP endpoint."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        engines: Callable[[], list[EngineHandle]],
        max_lora: int = 0,
    ) -> None:
        disable_created_metrics()  # no *_created series (as vLLM): they double the output
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.requests = RequestMetrics(self.registry, model_name, max_model_len)
        self.registry.register(EngineStatsCollector(model_name, engines, max_lora))
        self._server: MetricsServer | None = None
        self.port = 0

    def serve(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        check: CheckScrape | None = None,
    ) -> int:
        """Serve ``/metrics`` on daemon threads (HTTPS with ``ssl_context``; only to scrapes
        ``check`` passes); returns the bound port."""
        self._server = MetricsServer(self.registry, ssl_context, check)
        self.port = self._server.start(host, port)
        shown = f"[{host}]" if ":" in host else host
        guarded = ", bearer token required" if check is not None else ""
        scheme = self._server.scheme
        logger.info("Prometheus metrics on %s://%s:%d/metrics%s", scheme, shown, self.port, guarded)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
