"""Which engine cores this gateway has, and whether each is alive and takes new requests.

An engine joins by its READY; a restarted engine is re-admitted by its READY (the ROUTER hands
the engine's identity over to the new connection). An engine is dead when it says
``ENGINE_CORE_DEAD``, when a send to it fails, or when it has been silent (no output, no
heartbeat) for ``heartbeat_timeout_s``; ``on_dead`` then fails its requests over. An engine
whose stats name a stalled worker takes no new requests until they stop naming it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from switchboard.common.log_limits import WarningLimit
from switchboard.gateway.api_errors import ApiError, unavailable
from switchboard.gateway.engines.pool import choose_engine
from switchboard.gateway.engines.prefix_routing import PrefixRouting
from switchboard.gateway.engines.types import EngineHandle, EngineState
from switchboard.wire.engine_msgs import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
)

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)


class EngineMembership:
    def __init__(
        self,
        *,
        heartbeat_timeout_s: float,
        resume_timeout_s: float,
        on_changed: Callable[[], None],
        on_dead: Callable[[EngineHandle, str], None],
        engines_restart: bool = False,
        prefix_routing: PrefixRouting | None = None,
    ) -> None:
        self._prefix_routing = prefix_routing  # None: power of two choices
        self.engines: dict[int, EngineHandle] = {}  # by data-parallel rank
        self.resume_timeout_s = resume_timeout_s
        self._engines_restart = engines_restart
        self._unknown_senders: set[int] = set()  # engines heard from before their READY
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._on_changed = on_changed
        self._on_dead = on_dead
        self._rng = random.Random()
        self._any_ready = asyncio.Event()

    # -- who is there --------------------------------------------------------------------------

    @property
    def live_engines(self) -> list[EngineHandle]:
        return [e for e in self.engines.values() if e.alive]

    @property
    def routable_engines(self) -> list[EngineHandle]:
        """Live engines that take new requests (none of their workers stalled)."""
        return [e for e in self.engines.values() if e.routable]

    def choose(
        self, pinned_rank: int | None, request: EngineCoreRequest | None = None
    ) -> EngineHandle:
        """The engine for one request (``pool.choose_engine``; by its prompt's cached prefix
        with prefix routing on); raises UNAVAILABLE if none."""
        routing = self._prefix_routing
        if routing is None or request is None:
            return choose_engine(self.engines, pinned_rank, self._rng)
        engine = choose_engine(
            self.engines,
            pinned_rank,
            self._rng,
            lambda live: routing.choose(live, request, self._rng),
        )
        if pinned_rank is not None:  # the engine will cache it all the same
            routing.record(engine, request)
        return engine

    def check_routable(self) -> None:
        """Raise UNAVAILABLE (saying why) unless some engine takes new requests."""
        self.choose(None)

    @property
    def restart_expected(self) -> bool:
        """No engine takes new requests, but one that did has died and may be restarted (its
        supervisor restarts it and its READY re-admits it), or, with ``engines_restart`` (one
        machine), none has sent READY yet: this gateway was restarted and its engines, which
        are up, send READY again within moments. With resume off, nothing waits."""
        if self.resume_timeout_s <= 0 or self.routable_engines:
            return False
        if self._engines_restart and not self.engines:
            return True
        return any(not e.alive for e in self.engines.values())

    async def wait_until_ready(self, timeout_s: float | None = None) -> bool:
        """True once at least one engine sent READY (False on timeout)."""
        try:
            await asyncio.wait_for(self._any_ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def wait_until_routable(self, time_remaining: float | None) -> None:
        """Return once some engine takes new requests. While none does because an engine died
        (``restart_expected``), wait for it to come back — at most ``resume_timeout_s`` and the
        call's ``time_remaining`` (None: no deadline); otherwise, and after that, raise
        UNAVAILABLE saying why. A stalled worker is refused at once: its engine is alive and
        may stay stalled for good."""
        if self.routable_engines:  # the usual case: add_request makes the one choice
            return
        started = time.monotonic()
        bound = self.resume_timeout_s
        if time_remaining is not None:
            bound = min(bound, max(0.0, time_remaining))
        deadline = started + bound
        while self.restart_expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            self.check_routable()
        except ApiError as exc:
            waited = time.monotonic() - started
            if waited < 0.05:
                raise
            raise unavailable(
                f"{exc.message} (waited {waited:.1f}s for an engine to restart)"
            ) from None

    # -- joining -------------------------------------------------------------------------------

    def admit(self, identity: bytes, ready: EngineReady) -> None:
        previous = self.engines.get(ready.data_parallel_rank)
        if previous is not None and previous.alive:
            self.mark_dead(previous, "it sent READY again (restarted)")
        self.engines[ready.data_parallel_rank] = EngineHandle(
            identity=identity, ready=ready, last_seen=time.monotonic()
        )
        logger.info(
            "engine %s (DP rank %d) READY: max_model_len=%d, vocab_size=%d, %d KV blocks of %d "
            "tokens (%d tokens), TP=%d PP=%d",
            ready.engine_id,
            ready.data_parallel_rank,
            ready.max_model_len,
            ready.vocab_size,
            ready.num_gpu_blocks,
            ready.block_size,
            ready.kv_capacity_tokens,
            ready.tensor_parallel_size,
            ready.pipeline_parallel_size,
        )
        self._any_ready.set()
        self._on_changed()

    # -- health --------------------------------------------------------------------------------

    def heard_from(self, outputs: EngineCoreOutputs) -> EngineHandle | None:
        """The engine that sent ``outputs``, its last sign of life and its stats noted; None
        (the outputs are dropped) unless it is ready here."""
        engine = self.engines.get(outputs.engine_index)
        if engine is None:
            # Once per engine: after this gateway's restart an engine's socket delivers what it
            # had queued for the dead one (heartbeats, outputs) before its READY comes again.
            if outputs.engine_index not in self._unknown_senders:
                self._unknown_senders.add(outputs.engine_index)
                logger.info(
                    "dropped outputs from engine index %d: it has not sent READY here (yet)",
                    outputs.engine_index,
                )
            return None
        if not engine.alive:
            limited.warning(
                "outputs of an engine not ready",
                "dropped outputs from engine index %d: not ready",
                outputs.engine_index,
            )
            return None
        engine.last_seen = time.monotonic()
        if outputs.scheduler_stats is not None:
            was_stalled = engine.stalled
            engine.scheduler_stats = outputs.scheduler_stats
            engine.exports_engine_stats = outputs.exports_engine_stats
            if engine.stalled != was_stalled:
                self._on_stall_changed(engine)
        return engine

    def _on_stall_changed(self, engine: EngineHandle) -> None:
        stats = engine.scheduler_stats
        assert stats is not None
        rank = engine.ready.data_parallel_rank
        if engine.stalled:
            logger.error(
                "engine %s (DP rank %d): worker rank %d (pid %d) has not answered a step for "
                "%.1fs; no new requests go to it until it answers",
                engine.engine_id,
                rank,
                stats.stalled_worker_rank,
                stats.stalled_worker_pid,
                stats.stalled_for_s,
            )
        else:
            logger.warning(
                "engine %s (DP rank %d): stall over, routable again", engine.engine_id, rank
            )
        self._on_changed()

    def engine_said_dead(self, dead: EngineDead | None) -> None:
        """An ENGINE_CORE_DEAD arrived (None: one that names no engine)."""
        if dead is not None:
            engine = self.engines.get(dead.engine_index)
            if engine is None or (dead.engine_id and dead.engine_id != engine.engine_id):
                logger.info(
                    "ENGINE_CORE_DEAD from engine %s (DP rank %d), which is not ready here",
                    dead.engine_id,
                    dead.engine_index,
                )
                return
            self.mark_dead(engine, "it sent ENGINE_CORE_DEAD")
            return
        live = self.live_engines
        if len(live) == 1:
            self.mark_dead(live[0], "it sent ENGINE_CORE_DEAD")
        else:
            # The PULL socket does not say which peer sent a frame: the silent one is found by
            # the heartbeat watchdog.
            logger.error(
                "an engine core sent ENGINE_CORE_DEAD; %d engines are live, the dead one will "
                "be found by its missing heartbeats",
                len(live),
            )

    async def watch_heartbeats(self) -> None:
        period = max(0.05, min(1.0, self._heartbeat_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for engine in self.live_engines:
                silence = now - engine.last_seen
                if silence > self._heartbeat_timeout_s:
                    self.mark_dead(engine, f"no output or heartbeat for {silence:.1f}s")

    def mark_dead(self, engine: EngineHandle, why: str) -> None:
        if not engine.alive:
            return
        engine.state = EngineState.DEAD
        self._on_dead(engine, why)
        self._on_changed()
