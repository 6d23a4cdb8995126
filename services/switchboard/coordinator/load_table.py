"""The coordinator: one table of every engine's load, published to every gateway.

Only started when DP > 1 (``switchboard::Coordinator``). Engines push an ``EngineLoad`` when
their waiting/running counts or KV usage change (at most every 100 ms each); the coordinator
keeps the latest per engine and publishes the whole table as one ``LoadReport``::

    EngineCore_DP0 ─PUSH─┐                         ┌─SUB─ Gateway_0
    EngineCore_DP1 ─PUSH─┼─> PULL  Coordinator  PUB ┼─SUB─ Gateway_1
    EngineCore_DPn ─PUSH─┘                         └─SUB─ ...

It publishes at most every ``publish_interval_s`` when something changed, and every
``keepalive_interval_s`` regardless, so a gateway that subscribed late (PUB/SUB drops what was
published before a subscriber joined) has the full table within one keep-alive. Gateways use it
for power-of-two-choices routing; nothing else depends on it, so its loss only makes routing
rely on each gateway's own in-flight counts.

The table lives in this process only. A restarted coordinator (the supervisor restarts it at the
same addresses) starts empty and rebuilds it from the engines' next reports: an engine sends its
load again when its socket reconnects, busy or idle, and the coordinator logs ``load table
complete`` once every engine has reported. Meanwhile the gateways route on their own counts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from switchboard.config import CoordinatorConfig
from switchboard.wire import curve, zmq_channel
from switchboard.wire.codec import ENGINE_LOAD, LOAD_REPORT, DecodeError
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import EngineLoad, LoadReport

logger = logging.getLogger(__name__)

POLL_MS = 100  # the longest the loop sleeps before checking whether it must stop or publish


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.loads: dict[int, EngineLoad] = {}
        self._sequence = 0
        self._changed = False
        self._last_publish = 0.0
        self._started = time.monotonic()
        self._complete = False  # every engine has reported
        self._ctx = zmq.Context()
        self._authenticator: Any = None
        keys = self._security(config)
        self._pull = zmq_channel.make_socket(
            self._ctx, zmq.PULL, config.input_address, bind=True, curve=keys
        )
        self._pub = zmq_channel.make_socket(
            self._ctx, zmq.PUB, config.publish_address, bind=True, curve=keys
        )
        self.input_address = zmq_channel.bound_address(self._pull)
        self.publish_address = zmq_channel.bound_address(self._pub)
        logger.info(
            "Coordinator: engine loads in at %s, reports out at %s",
            self.input_address,
            self.publish_address,
        )

    def _security(self, config: CoordinatorConfig) -> CurveKeys | None:
        """Server keys for both sockets and the ZAP thread admitting engines and gateways
        (None, and a WARNING on TCP, without a keys directory)."""
        keys_dir = config.curve_keys_dir
        if not keys_dir:
            addresses = (config.input_address, config.publish_address)
            if any(a.startswith("tcp://") for a in addresses):
                curve.warn_unauthenticated("coordinator")
            return None
        keys = curve.server_keys(keys_dir, curve.COORDINATOR)
        allowed = [
            os.path.join(keys_dir, d) for d in (curve.ALLOWED_ENGINES, curve.ALLOWED_GATEWAYS)
        ]
        self._authenticator = curve.start_authenticator(self._ctx, allowed)
        return keys

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Receive and publish until ``should_stop()``."""
        while not should_stop():
            if self._pull.poll(self._poll_timeout_ms()):
                self._receive_all()
            self._maybe_publish(time.monotonic())

    def _poll_timeout_ms(self) -> int:
        if not self._changed:
            return POLL_MS
        due = self._last_publish + self.config.publish_interval_s - time.monotonic()
        return max(0, min(POLL_MS, int(due * 1000)))

    def _receive_all(self) -> None:
        while True:
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                load = ENGINE_LOAD.decode(data)
            except DecodeError as exc:
                logger.warning("Dropped a bad EngineLoad: %s", exc)
                continue
            previous = self.loads.get(load.engine_index)
            if previous is None or previous.engine_id != load.engine_id:
                logger.info(
                    "First load report from engine %d (%s): %d of %d engines heard from",
                    load.engine_index,
                    load.engine_id or "?",
                    len(self.loads | {load.engine_index: load}),
                    self.config.num_engines,
                )
            if previous != load:
                self.loads[load.engine_index] = load
                self._changed = True
            if not self._complete and len(self.loads) >= self.config.num_engines:
                self._complete = True
                logger.info(
                    "Load table complete: all %d engines reported, %.1f s after the start",
                    len(self.loads),
                    time.monotonic() - self._started,
                )

    def _maybe_publish(self, now: float) -> None:
        since = now - self._last_publish
        if (self._changed and since >= self.config.publish_interval_s) or (
            since >= self.config.keepalive_interval_s
        ):
            self._sequence += 1
            report = LoadReport(self._sequence, [self.loads[i] for i in sorted(self.loads)])
            self._pub.send(LOAD_REPORT.encode(report))
            self._changed = False
            self._last_publish = now

    def close(self) -> None:
        for sock in (self._pull, self._pub):
            sock.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()
        for address in (self.input_address, self.publish_address):
            if address.startswith("ipc://") and os.path.exists(address[len("ipc://") :]):
                os.unlink(address[len("ipc://") :])
        logger.info("Coordinator closed after %d reports", self._sequence)
