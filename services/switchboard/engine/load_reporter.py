"""Reports this engine's load to the coordinator (DP > 1): waiting and running counts, KV usage.

The busy loop calls :meth:`LoadReporter.update` after every turn; that only compares and stores
numbers (no socket, no encoding), so the loop stays socket-free. A thread of its own sends the
latest value when it changed, at most once per ``interval_s``: a burst of changes costs one
message per interval, and the last change is always sent, even if the engine then goes idle.
When the coordinator comes back after a restart (the socket connects again) the latest load is
sent again, so that the new coordinator's table has this engine even if it stays idle.
"""

from __future__ import annotations

import logging
import threading

import zmq

from switchboard.wire import zmq_channel
from switchboard.wire.codec import ENGINE_LOAD
from switchboard.wire.connection_events import ConnectionEvents, PeerChange
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import EngineLoad

logger = logging.getLogger(__name__)

SEND_LINGER_MS = 1000
PEER_CHECK_S = 0.5  # how often an idle reporter looks whether the coordinator came back


class LoadReporter(threading.Thread):
    def __init__(
        self,
        ctx: zmq.SyncContext,
        coordinator_address: str,
        engine_index: int,
        engine_id: str,
        interval_s: float = 0.1,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(name="EngineLoadReporter", daemon=True)
        self._ctx = ctx
        self._curve = curve
        self._address = coordinator_address
        self._engine_index = engine_index
        self._engine_id = engine_id
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop_event = threading.Event()
        self._latest: EngineLoad | None = None
        self.num_sent = 0

    def update(self, num_waiting: int, num_running: int, kv_cache_usage: float) -> None:
        """Busy loop: record the current load; cheap when nothing changed."""
        latest = self._latest
        if (
            latest is not None
            and latest.num_waiting_reqs == num_waiting
            and latest.num_running_reqs == num_running
            and latest.kv_cache_usage == kv_cache_usage
        ):
            return
        load = EngineLoad(
            self._engine_index, num_waiting, num_running, kv_cache_usage, self._engine_id
        )
        with self._lock:
            self._latest = load
        self._changed.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop_event.set()
        self._changed.set()
        if self.is_alive():
            self.join(timeout_s)

    def run(self) -> None:
        events: ConnectionEvents[zmq.SyncSocket] = ConnectionEvents()
        try:
            sock = zmq_channel.make_socket(
                self._ctx,
                zmq.PUSH,
                self._address,
                bind=False,
                linger_ms=SEND_LINGER_MS,
                curve=self._curve,
                before_connect=events.watch,
            )
        except BaseException:
            events.close()  # an open monitor would hold the context's term() forever
            raise
        logger.info("Reporting load to the coordinator at %s", self._address)
        try:
            while not self._stop_event.is_set():
                if not self._changed.wait(PEER_CHECK_S):
                    if self._coordinator_back(events):
                        self._changed.set()  # the same load again, for the new coordinator
                    continue
                if self._stop_event.is_set():
                    return
                self._changed.clear()
                with self._lock:
                    load = self._latest
                if load is None:  # set only after a first update; stop() returned above
                    continue
                self.num_sent += 1  # before the send: a receiver never sees a stale count
                sock.send(ENGINE_LOAD.encode(load))
                # Changes during the pause are merged into the next send.
                self._stop_event.wait(self._interval_s)
        except Exception:
            logger.exception("Load reporter failed; the coordinator will not hear from us")
        finally:
            events.close()
            sock.close()

    @staticmethod
    def _coordinator_back(events: ConnectionEvents[zmq.SyncSocket]) -> bool:
        back = False
        while events.monitor.poll(0):
            if events.change(events.monitor.recv_multipart()) is PeerChange.BACK:
                logger.info("The coordinator is back: sending it this engine's load again")
                back = True
        return back
