"""Wire 1, gateway side: talks to every engine core over ZeroMQ (``zmq.asyncio``).

The gateway binds a ROUTER (requests out) and a PULL (outputs in). An engine core connects a
DEALER and a PUSH and speaks first: its READY arrives on the ROUTER as ``[identity, body]``,
and from then on the gateway addresses it as ``[identity, type byte, body]``. Outputs of all
engines arrive on the PULL; one asyncio task reads them and hands each request's outputs to
that request's queue. An engine is dead when it says ``ENGINE_CORE_DEAD``, when a send to it
fails, or when it has been silent (no output, no heartbeat) for ``heartbeat_timeout_s``; its
pending requests are then resumed on another (or the restarted) engine within
``resume_timeout_s`` (``resume.py``), or fail with UNAVAILABLE saying how many tokens they had
delivered. A restarted engine is re-admitted by its READY (the ROUTER hands the engine's
identity over to the new connection). An engine whose stats name a stalled worker takes no new
requests until they stop naming it.

Several engines (DP > 1): ``engine_pool`` picks one per request (power of two choices, on the
coordinator's load reports when ``coordinator_publish_address`` is set). Engines on other hosts:
``handshake_address`` binds the fixed handshake port that tells them the data sockets' ports.

Sends never block: the sockets have no high-water mark, so ``send_multipart`` completes at
once, which lets ``abort`` be called from a ``finally`` block of a cancelled stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import grpc
import msgspec
import zmq
import zmq.asyncio

from switchboard.gateway.engines.handshake_server import HandshakeServer, port_of
from switchboard.gateway.engines.pool import LoadSubscriber, choose_engine
from switchboard.gateway.engines.resume import resume_plan
from switchboard.gateway.engines.types import (
    EngineHandle,
    EngineState,
    RequestAborted,
    RequestChannel,
    RequestFailed,
    StepOutput,
)
from switchboard.gateway.engines.utility_calls import PendingUtilityCalls
from switchboard.gateway.errors import ApiError, unavailable
from switchboard.wire import curve, zmq_channel
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    GatewayAddresses,
    RequestType,
    UtilityCall,
)

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.input_address = input_address
        self.resume_timeout_s = resume_timeout_s
        self.on_resumed: Callable[[EngineHandle], None] = lambda _engine: None
        self.resumed_requests = 0  # streams resumed on another engine (a metric counts them)
        self._resumes: set[asyncio.Task] = set()
        self.output_address = output_address
        self.client_index = client_index
        self.coordinator_publish_address = coordinator_publish_address
        self.handshake_address = handshake_address
        self.gateway_id = f"Gateway_{client_index}-{uuid.uuid4().hex[:8]}"
        self._rng = random.Random()
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._on_engines_changed = on_engines_changed or (lambda: None)
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self.engines: dict[int, EngineHandle] = {}  # by data-parallel rank
        self._requests: dict[str, RequestChannel] = {}
        self._utility_calls = PendingUtilityCalls()
        self._any_ready = asyncio.Event()
        self._ipc_paths: list[str] = []
        self.curve_keys_dir = curve_keys_dir
        self._authenticator: Any = None  # the ZAP thread when CURVE is on
        self._key_warnings: set[tuple[str, str]] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    def _security(self) -> tuple[CurveKeys | None, CurveKeys | None]:
        """(the data and handshake sockets' server keys, the coordinator SUB's client keys);
        both None without a keys directory. Starts the ZAP thread when there is one."""
        addresses = (self.input_address, self.output_address, self.handshake_address)
        tcp = any(a.startswith("tcp://") for a in addresses)
        if not self.curve_keys_dir:
            if tcp or self.coordinator_publish_address.startswith("tcp://"):
                curve.warn_unauthenticated("gateway")
            return None, None
        keys_dir = self.curve_keys_dir
        server = curve.server_keys(keys_dir, curve.GATEWAY)
        subscriber = None
        if self.coordinator_publish_address:
            subscriber = curve.client_keys(keys_dir, curve.GATEWAY, curve.COORDINATOR)
        assert self._ctx is not None
        allowed = os.path.join(keys_dir, curve.ALLOWED_ENGINES)
        self._authenticator = curve.start_authenticator(self._ctx, [allowed])
        return server, subscriber

    async def start(self) -> None:
        for address in (self.input_address, self.output_address):
            if address.startswith("ipc://"):
                zmq_channel.check_private_dir(os.path.dirname(address.removeprefix("ipc://")))
        self._ctx = zmq.asyncio.Context()
        server, subscriber = self._security()
        self._router = zmq_channel.make_socket(
            self._ctx, zmq.ROUTER, self.input_address, bind=True, curve=server
        )
        # Sending to a peer that is gone raises instead of dropping the message silently.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted engine reconnects with the identity of its dead predecessor (its DP rank):
        # the new connection takes the identity over instead of being refused. With CURVE an
        # engine's identity is new at each start, and a second peer claiming one in use (another
        # admitted key) is refused rather than handed the engine's requests.
        if server is None:
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._pull = zmq_channel.make_socket(
            self._ctx, zmq.PULL, self.output_address, bind=True, curve=server
        )
        self.input_address = zmq_channel.bound_address(self._router)
        self.output_address = zmq_channel.bound_address(self._pull)
        self._ipc_paths = [
            a.removeprefix("ipc://")
            for a in (self.input_address, self.output_address)
            if a.startswith("ipc://")
        ]
        self._tasks = [
            asyncio.create_task(self._ready_loop(), name="engine-ready-loop"),
            asyncio.create_task(self._output_loop(), name="engine-output-loop"),
            asyncio.create_task(self._heartbeat_watchdog(), name="engine-heartbeat-watchdog"),
        ]
        if self.coordinator_publish_address:
            loads = LoadSubscriber(
                self._ctx, self.coordinator_publish_address, lambda: self.engines, curve=subscriber
            )
            self._tasks.append(asyncio.create_task(loads.run(), name="engine-load-subscriber"))
        if self.handshake_address:
            answer = GatewayAddresses(
                gateway_id=self.gateway_id,
                client_index=self.client_index,
                input_port=port_of(self.input_address),
                output_port=port_of(self.output_address),
            )
            handshake = HandshakeServer(self._ctx, self.handshake_address, answer, curve=server)
            self.handshake_address = handshake.address
            self._tasks.append(asyncio.create_task(handshake.run(), name="engine-handshake"))
        logger.info(
            "wire 1: ROUTER bound at %s, PULL bound at %s; waiting for engine READY",
            self.input_address,
            self.output_address,
        )

    async def close(self) -> None:
        for task in [*self._tasks, *self._resumes]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._resumes, return_exceptions=True)
        self._tasks = []
        for channel in list(self._requests.values()):
            channel.put(RequestFailed(unavailable("the gateway is shutting down")))
        self._requests.clear()
        self._utility_calls.fail(unavailable("the gateway is shutting down"))
        for sock in (self._router, self._pull):
            if sock is not None:
                sock.close(linger=0)
        for path in self._ipc_paths:  # libzmq leaves the socket files it bound behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._ipc_paths = []
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._ctx is not None:
            self._ctx.term()
        self._router = self._pull = self._ctx = None
        logger.info("wire 1: sockets closed")

    async def wait_until_ready(self, timeout_s: float | None = None) -> bool:
        """True once at least one engine sent READY (False on timeout)."""
        try:
            await asyncio.wait_for(self._any_ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    @property
    def live_engines(self) -> list[EngineHandle]:
        return [e for e in self.engines.values() if e.alive]

    @property
    def routable_engines(self) -> list[EngineHandle]:
        """Live engines that take new requests (none of their workers stalled)."""
        return [e for e in self.engines.values() if e.routable]

    def check_routable(self) -> None:
        """Raise UNAVAILABLE (saying why) unless some engine takes new requests."""
        choose_engine(self.engines, None, self._rng)

    @property
    def restart_expected(self) -> bool:
        """No engine takes new requests, but one that did has died and may be restarted (its
        supervisor restarts it and its READY re-admits it); with resume off, nothing waits."""
        return (
            self.resume_timeout_s > 0
            and not self.routable_engines
            and any(not e.alive for e in self.engines.values())
        )

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

    # -- requests ------------------------------------------------------------------------------

    def is_live(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(self, request: EngineCoreRequest) -> RequestChannel:
        """Send ADD to the engine ``engine_pool`` picks (or the pinned ``data_parallel_rank``);
        outputs arrive on the returned channel."""
        if request.request_id in self._requests:
            raise ApiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request.request_id!r} is already in flight",
                reason="DUPLICATE_REQUEST_ID",
                field="request_id",
            )
        engine = choose_engine(self.engines, request.data_parallel_rank, self._rng)
        channel = RequestChannel(request.request_id, engine, request)
        self._requests[request.request_id] = channel
        engine.num_requests += 1
        engine.added_since_load += 1
        # A failed send marks the engine dead, which fails its requests over, this one too:
        # it is then sent to the next engine that takes it, as a stream cut off is (resume).
        self._send(engine, RequestType.ADD, request)
        return channel

    def abort(self, request_ids: list[str], reason: str = "aborted") -> list[str]:
        """Abort in-flight requests: ABORT to their engines, RequestAborted to their channels.
        Returns the ids that were in flight; unknown ids are ignored (aborting is idempotent)."""
        by_engine: dict[int, tuple[EngineHandle, list[str]]] = {}
        aborted = []
        for request_id in request_ids:
            channel = self._forget(request_id)
            if channel is None:
                continue
            aborted.append(request_id)
            channel.put(RequestAborted(reason))
            rank = channel.engine.ready.data_parallel_rank
            by_engine.setdefault(rank, (channel.engine, []))[1].append(request_id)
        for engine, ids in by_engine.values():
            if engine.alive:
                self._send(engine, RequestType.ABORT, ids)
        if aborted:
            logger.debug("aborted %d request(s) (%s): %s", len(aborted), reason, aborted)
        return aborted

    def _forget(self, request_id: str) -> RequestChannel | None:
        channel = self._requests.pop(request_id, None)
        if channel is not None and channel.counted:
            channel.engine.num_requests -= 1
            channel.counted = False
        return channel

    # -- utility calls -------------------------------------------------------------------------

    async def call_utility(
        self, engine: EngineHandle, method: str, args: list[Any], timeout_s: float = 30.0
    ) -> Any:
        """Call an engine-core utility method; raise ApiError if the engine reports failure."""
        if not engine.alive:
            raise unavailable(f"engine {engine.engine_id} is not ready")
        call_id, future = self._utility_calls.open(engine)
        try:
            call = UtilityCall(self.client_index, call_id, method, args)
            if not self._send(engine, RequestType.UTILITY, call):
                raise unavailable(f"engine {engine.engine_id} is unreachable")
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise ApiError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"engine {engine.engine_id} did not answer {method} within {timeout_s}s",
            ) from None
        finally:
            self._utility_calls.close(call_id)

    # -- sockets -------------------------------------------------------------------------------

    def _send(self, engine: EngineHandle, request_type: RequestType, body: Any) -> bool:
        """Send one request frame; False (and the engine is marked dead) if it cannot go out."""
        assert self._router is not None
        frames = [engine.identity, *zmq_channel.request_frames(request_type, body)]
        # A Future (pyzmq's stubs say only Awaitable): done at once unless the send is queued.
        sent = cast("asyncio.Future[Any]", self._router.send_multipart(frames, copy=False))
        if not sent.done():  # queued behind an earlier send (never with HWM 0): check later
            sent.add_done_callback(lambda f: self._check_late_send(f, engine))
            return True
        if sent.exception() is not None:
            self._mark_dead(engine, f"a send to it failed ({sent.exception()})")
            return False
        return True

    def _check_late_send(self, sent: asyncio.Future, engine: EngineHandle) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            self._mark_dead(engine, f"a send to it failed ({sent.exception()})")

    async def _ready_loop(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart(copy=False)
            if len(frames) != 2:
                logger.warning("dropped a ROUTER message of %d frames (want 2: READY)", len(frames))
                continue
            identity, body = frames[0].bytes, frames[1]
            try:
                ready = zmq_channel.parse_ready(body.buffer)
            except zmq_channel.BadFrame as exc:
                logger.warning("dropped a bad READY from %r: %s", identity, exc)
                continue
            if self.curve_keys_dir and not self._key_may_be(
                body, ready.data_parallel_rank, "READY"
            ):
                continue
            self._admit(identity, ready)

    def _key_may_be(self, frame: zmq.Frame, rank: int | None, what: str) -> bool:
        """CURVE on: a key named for a rank (``engine-<r>``) speaks for that rank only (a
        message naming no rank, the one-frame ENGINE_CORE_DEAD, needs a key named for none)."""
        try:
            user_id = str(frame.get("User-Id"))
        except zmq.ZMQError:
            user_id = ""
        key_rank = curve.rank_of_key(user_id)
        if key_rank is None or key_rank == rank:
            return True
        if (user_id, what) not in self._key_warnings:  # once: outputs come every step
            self._key_warnings.add((user_id, what))
            logger.warning(
                "dropped %s for DP rank %s from the key %s (that key is rank %d's)",
                what,
                rank,
                user_id,
                key_rank,
            )
        return False

    def _admit(self, identity: bytes, ready: EngineReady) -> None:
        previous = self.engines.get(ready.data_parallel_rank)
        if previous is not None and previous.alive:
            self._mark_dead(previous, "it sent READY again (restarted)")
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
        self._on_engines_changed()

    async def _output_loop(self) -> None:
        assert self._pull is not None
        while True:
            received = await self._pull.recv_multipart(copy=False)
            frames = [frame.buffer for frame in received]
            try:
                outputs, _ = zmq_channel.parse_output_frames(frames)
            except zmq_channel.BadFrame as exc:
                logger.warning("dropped a bad output frame: %s", exc)
                continue
            if outputs is None:
                dead = zmq_channel.parse_engine_dead(frames)
                rank = None if dead is None else dead.engine_index
                if self.curve_keys_dir and not self._key_may_be(
                    received[0], rank, "ENGINE_CORE_DEAD"
                ):
                    continue
                self._on_engine_dead_message(dead)
            else:
                if self.curve_keys_dir and not self._key_may_be(
                    received[0], outputs.engine_index, "outputs"
                ):
                    continue
                self._dispatch(outputs)

    def _on_engine_dead_message(self, dead: EngineDead | None) -> None:
        if dead is not None:
            engine = self.engines.get(dead.engine_index)
            if engine is None or (dead.engine_id and dead.engine_id != engine.engine_id):
                logger.info(
                    "ENGINE_CORE_DEAD from engine %s (DP rank %d), which is not ready here",
                    dead.engine_id,
                    dead.engine_index,
                )
                return
            self._mark_dead(engine, "it sent ENGINE_CORE_DEAD")
            return
        live = self.live_engines
        if len(live) == 1:
            self._mark_dead(live[0], "it sent ENGINE_CORE_DEAD")
        else:
            # The PULL socket does not say which peer sent a frame: the silent one is found by
            # the heartbeat watchdog.
            logger.error(
                "an engine core sent ENGINE_CORE_DEAD; %d engines are live, the dead one will "
                "be found by its missing heartbeats",
                len(live),
            )

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        engine = self.engines.get(outputs.engine_index)
        if engine is None or not engine.alive:
            logger.warning("dropped outputs from engine index %d: not ready", outputs.engine_index)
            return
        engine.last_seen = time.monotonic()
        if outputs.scheduler_stats is not None:
            was_stalled = engine.stalled
            engine.scheduler_stats = outputs.scheduler_stats
            engine.exports_engine_stats = outputs.exports_engine_stats
            if engine.stalled != was_stalled:
                self._on_stall_changed(engine)
        if outputs.utility_output is not None:
            self._utility_calls.resolve(outputs.utility_output)
        # Requests' first tokens are handed on before the other streams' next ones: each
        # stream's task runs in the order it is woken, so a new request's first token would
        # otherwise wait for every other stream of the step to go through this loop and gRPC.
        later: list[tuple[RequestChannel, EngineCoreOutput]] = []
        for output in outputs.outputs:
            channel = self._requests.get(output.request_id)
            if channel is None or channel.engine is not engine:
                continue  # finished, aborted or failed here already, or resumed elsewhere
            if channel.delivered:
                later.append((channel, output))
            else:
                self._deliver(channel, output, outputs.timestamp_ns)
        for channel, output in later:
            self._deliver(channel, output, outputs.timestamp_ns)

    def _deliver(
        self, channel: RequestChannel, output: EngineCoreOutput, timestamp_ns: int
    ) -> None:
        if channel.resumes and output.num_cached_tokens:  # a hit on its own output
            output = msgspec.structs.replace(output, num_cached_tokens=0)
        channel.delivered += output.new_token_ids
        channel.put(StepOutput(output, timestamp_ns))
        if output.finish_reason is not None:
            self._forget(output.request_id)

    # -- resume --------------------------------------------------------------------------------

    def _fail_over(self, channel: RequestChannel, why: str) -> None:
        """The engine of ``channel`` died: resume the request elsewhere, or fail it."""
        resumed, not_resumable = resume_plan(channel.request, channel.delivered)
        if self.resume_timeout_s <= 0:
            not_resumable = "resume is off (--no-resume)"
        if resumed is None or not_resumable:
            self._fail(channel, f"{why}; not resumed: {not_resumable}")
            return
        if channel.counted:  # it waits on no engine
            channel.engine.num_requests -= 1
            channel.counted = False
        task = asyncio.get_running_loop().create_task(self._resume(channel, resumed, why))
        self._resumes.add(task)
        task.add_done_callback(self._resumes.discard)

    def _fail(self, channel: RequestChannel, why: str) -> None:
        self._forget(channel.request_id)
        delivered = len(channel.delivered)
        channel.put(RequestFailed(unavailable(f"{why} ({delivered} tokens were delivered)")))

    async def _resume(self, channel: RequestChannel, request: EngineCoreRequest, why: str) -> None:
        """Send ``request`` (the cut-off one, continued) to the first engine that takes it
        within ``resume_timeout_s``; fail the stream if none does."""
        deadline = time.monotonic() + self.resume_timeout_s
        while self._requests.get(channel.request_id) is channel:  # not aborted meanwhile
            try:
                engine = choose_engine(self.engines, request.data_parallel_rank, self._rng)
            except ApiError:
                if time.monotonic() >= deadline:
                    self._fail(
                        channel,
                        f"{why}; not resumed: no engine core was ready within "
                        f"{self.resume_timeout_s:g}s",
                    )
                    return
                await asyncio.sleep(0.05)
                continue
            channel.engine = engine
            channel.counted = True
            channel.resumes += 1
            engine.num_requests += 1
            engine.added_since_load += 1
            self.resumed_requests += 1
            logger.warning(
                "request %s resumed on engine %s (DP rank %d) after %d tokens (%s)",
                channel.request_id,
                engine.engine_id,
                engine.ready.data_parallel_rank,
                len(channel.delivered),
                why,
            )
            self.on_resumed(engine)
            self._send(engine, RequestType.ADD, request)  # a failed send fails it over again
            return

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
        self._on_engines_changed()

    async def _heartbeat_watchdog(self) -> None:
        period = max(0.05, min(1.0, self._heartbeat_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for engine in self.live_engines:
                silence = now - engine.last_seen
                if silence > self._heartbeat_timeout_s:
                    self._mark_dead(engine, f"no output or heartbeat for {silence:.1f}s")

    def _mark_dead(self, engine: EngineHandle, why: str) -> None:
        if not engine.alive:
            return
        engine.state = EngineState.DEAD
        failed = [c for c in self._requests.values() if c.engine is engine]
        logger.error(
            "engine %s (DP rank %d) is dead: %s; failing its %d in-flight request(s)",
            engine.engine_id,
            engine.ready.data_parallel_rank,
            why,
            len(failed),
        )
        for channel in failed:
            self._fail_over(channel, f"engine {engine.engine_id} died: {why}")
        self._utility_calls.fail(unavailable(f"engine {engine.engine_id} died: {why}"), engine)
        self._on_engines_changed()
