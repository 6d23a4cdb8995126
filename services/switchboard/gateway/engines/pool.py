"""Which engine core gets a request (DP > 1), and the load reports that decision reads.

Power of two choices (``--routing-policy power-of-two``, and what prefix-aware routing falls
back to, ``prefix_routing.py``): draw two live engines at random and send the request to the
less loaded one. It spreads a burst (a plain "least loaded" would send the whole burst to the
same engine until the next report arrives, and every gateway would pick the same one), and it
needs only two scores per request.

An engine's score is the larger of
* this gateway's own requests in flight on it (exact, and current), and
* the coordinator's last count of its waiting + running requests (all gateways' requests, but
  up to ~100 ms old) plus the requests this gateway sent it since that report,
plus a penalty when the engine has requests waiting while its KV cache is more than half full
(as vLLM does: those will wait for blocks). Without a coordinator (DP = 1, or a gateway not
given one), from the moment its connection drops (it died or is restarting) until it publishes
again, or while its reports have stopped (``REPORTS_STALE_S``: it hangs or is unreachable),
the first term alone decides; so it does for an engine the latest report does not cover (a
restarted coordinator rebuilds its table from the engines' next reports).

A request may pin a data-parallel rank (``EngineCoreRequest.data_parallel_rank``): it goes to
that engine if it is ready, and fails with UNAVAILABLE otherwise. An engine whose worker is
stalled (``EngineHandle.routable``) gets no new request.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import zmq
import zmq.asyncio

from switchboard.gateway.api_errors import unavailable
from switchboard.gateway.engines.types import EngineHandle
from switchboard.wire import zmq_channel
from switchboard.wire.codec import LOAD_REPORT, DecodeError
from switchboard.wire.connection_events import ConnectionEvents, PeerChange
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import LoadReport

logger = logging.getLogger(__name__)

KV_PRESSURE_WEIGHT = 6.0  # per waiting request, per unit of KV usage above one half
# The coordinator publishes at least every 5 s; three missed keep-alives make its counts stale
# (kept, they would only grow by ``added_since_load`` and skew the choice for good).
REPORTS_STALE_S = 15.0


def engine_score(engine: EngineHandle, running_weight: float = 1.0) -> float:
    """The engine's load: its last report (waiting and running requests, plus those sent since)
    and, while requests wait, the pressure on its KV cache; at ``running_weight`` 1 never below
    the requests this gateway has in flight there. Below 1 (the prefix rule) each running request
    counts that much and the report alone decides."""
    score = float(engine.num_requests)
    load = engine.load
    if load is not None:
        waiting = load.num_waiting_reqs + engine.added_since_load
        reported = waiting + running_weight * load.num_running_reqs
        score = max(score, float(reported)) if running_weight == 1 else float(reported)
        if load.num_waiting_reqs:
            pressure = max(0.0, load.kv_cache_usage - 0.5)
            score += load.num_waiting_reqs * KV_PRESSURE_WEIGHT * pressure
    return score


def choose_engine(
    engines: dict[int, EngineHandle],
    pinned_rank: int | None,
    rng: random.Random,
    pick: Callable[[list[EngineHandle]], EngineHandle] | None = None,
) -> EngineHandle:
    """The engine for one request (see the module docstring); raises UNAVAILABLE if none.
    ``pick`` chooses among two or more routable engines (None: power of two choices)."""
    if pinned_rank is not None:
        engine = engines.get(pinned_rank)
        if engine is None or not engine.routable:
            ready = sorted(r for r, e in engines.items() if e.routable)
            raise unavailable(
                f"data_parallel_rank {pinned_rank}: that engine core is not ready "
                f"(ready ranks: {ready})"
            )
        return engine
    live = [e for e in engines.values() if e.routable]
    if not live:
        stalled = [e for e in engines.values() if e.alive and e.stalled]
        if stalled:
            raise unavailable(
                "no engine core is ready: "
                + "; ".join(
                    f"engine {e.engine_id}: worker rank {_stall(e)} has not answered a step"
                    for e in stalled
                )
            )
        raise unavailable("no engine core is ready")
    if len(live) == 1:
        return live[0]
    return power_of_two(live, rng) if pick is None else pick(live)


def power_of_two(live: list[EngineHandle], rng: random.Random) -> EngineHandle:
    """The less loaded of two engines drawn at random from ``live`` (two or more)."""
    first, second = rng.sample(live, 2)
    return second if engine_score(second) < engine_score(first) else first


def _stall(engine: EngineHandle) -> str:
    stats = engine.scheduler_stats
    assert stats is not None
    return f"{stats.stalled_worker_rank} (pid {stats.stalled_worker_pid})"


class LoadSubscriber:
    """Keeps ``EngineHandle.load`` fresh from the coordinator's LoadReport publications, and
    forgets every load when the coordinator goes away (its connection drops: it died or
    stopped) or no report came for ``stale_after_s`` (it hangs, or is unreachable)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        publish_address: str,
        engines: Callable[[], dict[int, EngineHandle]],
        stale_after_s: float = REPORTS_STALE_S,
        curve: CurveKeys | None = None,
    ) -> None:
        self._engines = engines
        self._stale_after_ms = int(stale_after_s * 1000)
        events: ConnectionEvents[zmq.asyncio.Socket] = ConnectionEvents()
        try:
            self._sock = zmq_channel.make_socket(
                ctx, zmq.SUB, publish_address, bind=False, curve=curve, before_connect=events.watch
            )
        except BaseException:
            events.close()  # an open monitor would hold the context's term() forever
            raise
        self._events = events
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.fresh = False  # a report came within stale_after_s, from a connected coordinator
        self.reported_ranks: list[int] = []  # the engines the latest report covered
        logger.info("subscribed to engine load reports at %s", publish_address)

    async def run(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._events.monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll(self._stale_after_ms))
                if not ready:
                    self._forget_loads(
                        f"no load report from the coordinator for {self._stale_after_ms / 1000:g} s"
                    )
                    continue
                if self._sock in ready:
                    await self._receive()
                if self._events.monitor in ready:
                    frames = await self._events.monitor.recv_multipart()
                    if self._events.change(frames) is PeerChange.LOST:
                        while await self._sock.poll(0):  # what it sent before it went
                            await self._receive()
                        self._forget_loads("the coordinator went away")
        except asyncio.CancelledError:
            self._events.close()
            self._sock.close(linger=0)
            raise

    async def _receive(self) -> None:
        data = await self._sock.recv()
        try:
            report = LOAD_REPORT.decode(data)
        except DecodeError as exc:
            logger.warning("dropped a bad load report: %s", exc)
            return
        self._note(report)
        apply_load_report(self._engines(), report)

    def _note(self, report: LoadReport) -> None:
        ranks = [load.engine_index for load in report.engines]
        if not self.fresh:
            logger.info("load reports from the coordinator arrive (report %d)", report.sequence)
        if ranks != self.reported_ranks:
            logger.info("load reports cover engine ranks %s", ranks)
        self.fresh = True
        self.reported_ranks = ranks

    def _forget_loads(self, why: str) -> None:
        if self.fresh:
            logger.warning(
                "%s: routing on this gateway's own in-flight counts until reports resume", why
            )
        self.fresh = False
        self.reported_ranks = []
        for engine in self._engines().values():
            engine.load = None
            engine.added_since_load = 0


def apply_load_report(engines: dict[int, EngineHandle], report: LoadReport) -> None:
    """The report's loads onto the engines it covers; an engine it does not cover (a restarted
    coordinator that has not heard from it yet) is scored on this gateway's counts alone."""
    covered = set()
    for load in report.engines:
        engine = engines.get(load.engine_index)
        if engine is None or (load.engine_id and load.engine_id != engine.engine_id):
            continue  # not ready here yet, or a report about its previous incarnation
        engine.load = load
        engine.added_since_load = 0
        covered.add(load.engine_index)
    for rank, engine in engines.items():
        if rank not in covered:
            engine.load = None
