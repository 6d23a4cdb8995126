"""Wire 1, gateway side, as the one object the gateway holds: it starts and stops the parts and
passes what arrives to the part it is for.

* ``sockets.py``: the ROUTER and PULL (CURVE, the handshake port, the coordinator's load reports);
* ``membership.py``: READY admission, the heartbeat watchdog, stalls, deaths, readiness;
* ``routing.py``: ADD (to the engine ``pool.py`` picks), ABORT, outputs to the requests' channels;
* ``resume.py``: a dead engine's requests resumed on another (or the restarted) engine, or failed;
* ``stream_stalls.py``: streams that got no token for a while from an engine that is alive;
* ``utility_calls.py``: utility calls and their replies;
* ``cache_events.py``: with prefix routing, each engine's KV events into its prefix table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from switchboard.gateway.api_errors import unavailable
from switchboard.gateway.engines.cache_events import CacheEventFollower
from switchboard.gateway.engines.membership import EngineMembership
from switchboard.gateway.engines.prefix_routing import PrefixRouting
from switchboard.gateway.engines.resume import Failover
from switchboard.gateway.engines.routing import RequestRouter
from switchboard.gateway.engines.sockets import EngineSockets
from switchboard.gateway.engines.stream_stalls import StreamStalls
from switchboard.gateway.engines.types import EngineHandle, RequestChannel
from switchboard.gateway.engines.utility_calls import UtilityCalls
from switchboard.wire.engine_msgs import EngineCoreOutputs, EngineCoreRequest, EngineReady

# Utilities after which an engine's prefix cache is empty (when they succeed).
_EMPTY_THE_CACHE = frozenset({"reset_prefix_cache", "sleep"})


class EngineClient:
    def __init__(
        self,
        input_address: str,
        output_address: str,
        *,
        client_index: int = 0,
        heartbeat_timeout_s: float = 10.0,
        on_engines_changed: Callable[[], None] | None = None,
        coordinator_publish_address: str = "",
        handshake_address: str = "",
        curve_keys_dir: str = "",
        resume_timeout_s: float = 0.0,
        stall_warn_s: float = 0.0,
        engines_restart: bool = False,
        prefix_routing: PrefixRouting | None = None,
    ) -> None:
        self._membership = EngineMembership(
            heartbeat_timeout_s=heartbeat_timeout_s,
            resume_timeout_s=resume_timeout_s,
            on_changed=on_engines_changed or (lambda: None),
            on_dead=self._engine_died,
            engines_restart=engines_restart,
            prefix_routing=prefix_routing,
        )
        self._sockets = EngineSockets(
            input_address,
            output_address,
            client_index=client_index,
            coordinator_publish_address=coordinator_publish_address,
            handshake_address=handshake_address,
            curve_keys_dir=curve_keys_dir,
            on_send_failed=self._membership.mark_dead,
        )
        self._router = RequestRouter(self._membership, self._sockets.send)
        self._failover = Failover(
            self._membership, self._router, self._sockets.send, resume_timeout_s
        )
        self._utility_calls = UtilityCalls(self._sockets.send, client_index)
        self._stalls = StreamStalls(stall_warn_s, self._router.channels)
        self._cache_events = (
            CacheEventFollower(self.call_utility) if prefix_routing is not None else None
        )
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        membership, sockets = self._membership, self._sockets
        self._tasks = [
            *sockets.bind(lambda: membership.engines),
            asyncio.create_task(sockets.receive_ready(self._admit), name="engine-ready-loop"),
            asyncio.create_task(
                sockets.receive_outputs(self._on_outputs, membership.engine_said_dead),
                name="engine-output-loop",
            ),
            asyncio.create_task(membership.watch_heartbeats(), name="engine-heartbeat-watchdog"),
            asyncio.create_task(self._stalls.run(), name="stream-stall-watch"),
        ]

    async def close(self) -> None:
        tasks = [*self._tasks, *self._failover.resuming]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        if self._cache_events is not None:
            await self._cache_events.close()
        self._router.fail_all("the gateway is shutting down")
        self._utility_calls.fail(unavailable("the gateway is shutting down"))
        self._sockets.close()

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        engine = self._membership.heard_from(outputs)
        if engine is None:
            return
        if outputs.utility_output is not None:
            self._utility_calls.resolve(outputs.utility_output)
        self._router.deliver(engine, outputs)

    def _admit(self, identity: bytes, ready: EngineReady) -> None:
        self._membership.admit(identity, ready)
        if self._cache_events is not None:
            self._cache_events.follow(self._membership.engines[ready.data_parallel_rank])

    def _engine_died(self, engine: EngineHandle, why: str) -> None:
        if self._cache_events is not None:
            self._cache_events.forget(engine)
        self._failover.engine_died(engine, why)
        self._utility_calls.fail(unavailable(f"engine {engine.engine_id} died: {why}"), engine)

    # -- addresses (bound ones once started) ---------------------------------------------------

    @property
    def input_address(self) -> str:
        return self._sockets.input_address

    @property
    def output_address(self) -> str:
        return self._sockets.output_address

    @property
    def handshake_address(self) -> str:
        return self._sockets.handshake_address

    @property
    def gateway_id(self) -> str:
        return self._sockets.gateway_id

    # -- engines -------------------------------------------------------------------------------

    @property
    def engines(self) -> dict[int, EngineHandle]:
        """Every engine that sent READY, by data-parallel rank (dead ones too)."""
        return self._membership.engines

    @property
    def live_engines(self) -> list[EngineHandle]:
        return self._membership.live_engines

    @property
    def routable_engines(self) -> list[EngineHandle]:
        return self._membership.routable_engines

    @property
    def restart_expected(self) -> bool:
        return self._membership.restart_expected

    def check_routable(self) -> None:
        self._membership.check_routable()

    async def wait_until_ready(self, timeout_s: float | None = None) -> bool:
        return await self._membership.wait_until_ready(timeout_s)

    async def wait_until_routable(self, time_remaining: float | None) -> None:
        await self._membership.wait_until_routable(time_remaining)

    # -- requests ------------------------------------------------------------------------------

    def is_live(self, request_id: str) -> bool:
        return self._router.is_live(request_id)

    def add_request(self, request: EngineCoreRequest) -> RequestChannel:
        return self._router.add_request(request)

    def abort(self, request_ids: list[str], reason: str = "aborted") -> list[str]:
        return self._router.abort(request_ids, reason)

    @property
    def on_resumed(self) -> Callable[[EngineHandle, EngineHandle], None]:
        """Called each time a cut-off request resumes: (the engine it was cut off on, the
        engine that took it)."""
        return self._failover.on_resumed

    @on_resumed.setter
    def on_resumed(self, on_resumed: Callable[[EngineHandle, EngineHandle], None]) -> None:
        self._failover.on_resumed = on_resumed

    @property
    def on_stream_stalled(self) -> Callable[[EngineHandle], None]:
        """Called with the engine each time one of its streams pauses (``stream_stalls.py``)."""
        return self._stalls.on_stalled

    @on_stream_stalled.setter
    def on_stream_stalled(self, on_stalled: Callable[[EngineHandle], None]) -> None:
        self._stalls.on_stalled = on_stalled

    async def call_utility(
        self, engine: EngineHandle, method: str, args: list[Any], timeout_s: float = 30.0
    ) -> Any:
        """Call an engine-core utility method; raise ApiError if the engine reports failure."""
        result = await self._utility_calls.call(engine, method, args, timeout_s)
        if method in _EMPTY_THE_CACHE and result is not False:
            # Without KV events nothing else would tell the router the cache is gone.
            engine.prefix_table.clear()
            if self._cache_events is not None:
                self._cache_events.refollow(engine)
        return result
