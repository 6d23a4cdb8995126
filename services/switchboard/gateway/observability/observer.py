"""Traces, metrics and the stats log line of one gateway, behind one small per-request API.

The request path calls, per Generate (:class:`RequestObserver`, ``request_observer.py``)::

    observer = state.observability.begin(request_id, arrival_time, context)
    observer.submitting(plan, engine_request)   # tokenized and checked; ADD about to go out
    observer.submitted(engines)                 # the engine each sequence went to
    observer.on_event(event)                    # every event of the request's channel
    observer.end(stream)                        # in ``finally``: however the call ended

Each piece costs nothing when off: no tracer without an OTLP endpoint (OpenTelemetry is not even
imported), no Prometheus registry without ``--metrics-port`` (served over TLS when the fronts
have it, behind the metrics token when there is one). What is always kept is the
request's timeline (a few integers per engine step) and two token counters for the log line.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import grpc

from switchboard.common.tls import server_ssl_context, tls_enabled
from switchboard.config import GatewayRoleConfig
from switchboard.gateway.auth import Credentials
from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.observability.request_observer import RequestObserver
from switchboard.gateway.observability.stats_log import StatsLogger, TokenCounts
from switchboard.gateway.observability.tracing_config import tracing_settings

if TYPE_CHECKING:
    from switchboard.gateway.engines.engine_client import EngineClient
    from switchboard.gateway.observability.metrics import GatewayMetrics
    from switchboard.gateway.observability.tracing import GatewayTracer
    from switchboard.gateway.text import Tokenizer

__all__ = ["Observability", "RequestObserver", "metrics_port"]


def metrics_port(config: GatewayRoleConfig) -> int | None:
    """This gateway's /metrics port: ``--metrics-port`` + client_index when the gateways of one
    machine share it (one-machine serve), the port itself for a gateway that runs alone
    (engines join it over TCP: its pod has the port to itself)."""
    port = config.gateway.metrics_port
    if port is None:
        return None
    alone = bool(config.handshake_address)
    return port if alone or port == 0 else port + config.client_index


class Observability:
    """Owned by the gateway server; ``start``/``stop`` with it."""

    def __init__(
        self,
        config: GatewayRoleConfig,
        tokenizer: Tokenizer,
        engines: EngineClient,
        credentials: Credentials | None = None,
    ) -> None:
        self.config = config
        self._credentials = credentials or Credentials()
        self.model_name = config.model.name
        self._tokenizer = tokenizer
        self._engines = engines
        self.counts = TokenCounts()
        self.tracer: GatewayTracer | None = None
        settings = tracing_settings(config.gateway)
        if settings is not None:
            from switchboard.gateway.observability.tracing import GatewayTracer

            self.tracer = GatewayTracer(
                settings, config.client_index, config.gateway.host, config.gateway.port
            )
        self.trace_content = settings is not None and settings.trace_content
        self.metrics: GatewayMetrics | None = None
        if config.gateway.metrics_port is not None:
            from switchboard.gateway.observability.metrics import GatewayMetrics

            self.metrics = GatewayMetrics(
                self.model_name,
                config.model.max_model_len or 1 << 20,
                lambda: list(engines.engines.values()),
                config.model.lora.max_loras if config.model.lora.enable_lora else 0,
            )
        self._stats_task: asyncio.Task | None = None

    def request_resumed(self, cut_off_on: EngineHandle, engine: EngineHandle) -> None:
        """A stream cut off by the death of ``cut_off_on`` was re-submitted to ``engine``."""
        if self.metrics is not None:
            requests = self.metrics.requests
            labels = requests.labels(str(engine.ready.data_parallel_rank))
            from_engine = str(cut_off_on.ready.data_parallel_rank)
            requests.resumed.labels(*labels, from_engine).inc()

    def stream_stalled(self, engine: EngineHandle) -> None:
        """A stream on ``engine`` got no token for longer than ``--stall-warn-s``."""
        if self.metrics is not None:
            requests = self.metrics.requests
            labels = requests.labels(str(engine.ready.data_parallel_rank))
            requests.stalls.labels(*labels).inc()

    def start(self) -> None:
        """Serve /metrics and start the stats log line (inside the event loop)."""
        port = metrics_port(self.config)
        if self.metrics is not None and port is not None:
            gateway, credentials = self.config.gateway, self._credentials
            self.metrics.serve(
                gateway.host,
                port,
                server_ssl_context(gateway) if tls_enabled(gateway) else None,
                credentials.check_metrics if credentials.metrics_token else None,
            )
        interval = self.config.gateway.log_stats_interval_s
        if interval > 0:
            stats = StatsLogger(
                self.config.client_index,
                interval,
                self.counts,
                lambda: list(self._engines.engines.values()),
            )
            self._stats_task = asyncio.get_running_loop().create_task(stats.run(), name="stats-log")

    async def stop(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
            self._stats_task = None
        if self.metrics is not None:
            self.metrics.stop()
        if self.tracer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.tracer.shutdown)

    def begin(
        self, request_id: str, arrival_time: float, context: grpc.aio.ServicerContext
    ) -> RequestObserver:
        return RequestObserver(self, request_id, arrival_time, context)

    def text(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, False)
