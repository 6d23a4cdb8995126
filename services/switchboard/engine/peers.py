"""The engine core's peers beyond its configured gateways: the coordinator and discovered gateways.

* Coordinator (DP > 1): a :class:`LoadReporter` thread pushes this engine's waiting/running
  counts and KV usage when they change (at most every ``load_report_interval_s``). Its address
  comes from the config (one machine) or from a gateway's handshake answer (other hosts).
* Engines on other hosts (``gateway_discovery``): a :class:`GatewayDiscovery` thread finds the
  gateways and hands each one to the I/O threads: the output thread first (a
  :class:`GatewayChange` on the output queue, so the PUSH exists before the gateway can send
  a request), then the input thread (DEALER + READY).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any

import zmq

from switchboard.config import EngineConfig
from switchboard.engine.handshake import GatewayDiscovery, GatewayEndpoint
from switchboard.engine.io_threads import GatewayChange, InputThread
from switchboard.engine.load_reporter import LoadReporter
from switchboard.wire import curve
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import GatewayHello

logger = logging.getLogger(__name__)


def engine_curve_keys(config: EngineConfig) -> tuple[CurveKeys | None, CurveKeys | None]:
    """This engine's CURVE client keys toward the gateways and toward the coordinator (None
    without ``curve_keys_dir``; then one WARNING when the wire is TCP)."""
    keys_dir = config.curve_keys_dir
    if not keys_dir:
        addresses = [
            *config.gateway_input_addresses,
            *config.gateway_output_addresses,
            config.coordinator_address,
        ]
        if config.gateway_discovery or any(a.startswith("tcp://") for a in addresses):
            curve.warn_unauthenticated(f"engine {config.data_parallel_rank}")
        return None, None
    name = curve.engine_key_name(keys_dir, config.data_parallel_rank)
    gateway = curve.client_keys(keys_dir, name, curve.GATEWAY)
    coordinator = None
    if config.coordinator_address or config.gateway_discovery:  # may come from a handshake
        if os.path.exists(os.path.join(keys_dir, f"{curve.COORDINATOR}.key")):
            coordinator = curve.client_keys(keys_dir, name, curve.COORDINATOR)
        elif config.coordinator_address:
            coordinator = curve.client_keys(keys_dir, name, curve.COORDINATOR)  # raises
    logger.info("CURVE on: this engine is %s (keys in %s)", name, keys_dir)
    return gateway, coordinator


class EnginePeers:
    def __init__(
        self,
        ctx: zmq.SyncContext,
        config: EngineConfig,
        engine_id: str,
        input_thread: InputThread,
        output_queue: queue.Queue[Any],
        *,
        curve_gateway: CurveKeys | None = None,
        curve_coordinator: CurveKeys | None = None,
    ) -> None:
        self._ctx = ctx
        self._curve_gateway = curve_gateway
        self._curve_coordinator = curve_coordinator
        self._config = config
        self._engine_id = engine_id
        self._input_thread = input_thread
        self._output_queue = output_queue
        self._lock = threading.Lock()
        self._reporter: LoadReporter | None = None
        self._discovery: GatewayDiscovery | None = None

    def start(self) -> None:
        if self._config.coordinator_address:
            self._start_reporter(self._config.coordinator_address)
        if self._config.gateway_discovery:
            self._discovery = GatewayDiscovery(
                self._ctx,
                self._config.gateway_discovery,
                GatewayHello(self._config.data_parallel_rank, self._engine_id),
                self._on_gateway_added,
                self._on_gateway_removed,
                interval_s=self._config.discovery_interval_s,
                curve=self._curve_gateway,
            )
            self._discovery.start()

    def report_load(self, num_waiting: int, num_running: int, kv_cache_usage: float) -> None:
        """Busy loop, every turn: cheap unless the numbers changed."""
        reporter = self._reporter
        if reporter is not None:
            reporter.update(num_waiting, num_running, kv_cache_usage)

    def gateway_output_addresses(self) -> list[str]:
        """Where ENGINE_CORE_DEAD must go: the configured gateways and the discovered ones."""
        addresses = list(self._config.gateway_output_addresses)
        if self._discovery is not None:
            addresses += [e.output_address for e in self._discovery.endpoints]
        return addresses

    def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.stop()
        if self._reporter is not None:
            self._reporter.stop()

    def _start_reporter(self, address: str) -> None:
        with self._lock:
            if self._reporter is not None:
                return
            self._reporter = LoadReporter(
                self._ctx,
                address,
                self._config.data_parallel_rank,
                self._engine_id,
                self._config.load_report_interval_s,
                curve=self._curve_coordinator,
            )
            self._reporter.start()

    def _on_gateway_added(self, endpoint: GatewayEndpoint) -> None:
        self._output_queue.put(GatewayChange(endpoint.client_index, endpoint.output_address))
        self._input_thread.add_gateway(endpoint.client_index, endpoint.input_address)
        if endpoint.coordinator_address:
            self._start_reporter(endpoint.coordinator_address)

    def _on_gateway_removed(self, endpoint: GatewayEndpoint) -> None:
        self._input_thread.remove_gateway(endpoint.client_index)
        self._output_queue.put(GatewayChange(endpoint.client_index, None))
