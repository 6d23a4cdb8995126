"""The gateway's grpc.aio server: the switchboard.v1 services and vLLM's engine service
(``vllm.grpc.engine.VllmEngine``, ``servicers/vllm_engine/``), health, reflection, clean stop.

The OpenAI-compatible HTTP API (``gateway/http/``, ``--http-port``) runs in the same event loop
and starts and stops with the gRPC server; its /health and /ready say what the two health
services below say.

Health (grpc.health.v1, Check and Watch):
* ``""``: SERVING while the process runs (liveness);
* ``switchboard.v1.GenerationService`` and ``vllm.grpc.engine.VllmEngine`` (the same answer):
  SERVING while at least one engine core is READY and
  routable (no stalled worker) and the gateway is not stopping (readiness); under
  ``switchboard serve`` only once every engine core of the server has been READY. On a stop it
  turns NOT_SERVING first, then the server drains: in-flight calls get ``shutdown_grace_s``
  (``--shutdown-grace``) to finish, new ones are refused.

With ``exit_when_engines_dead`` (one machine) the gateway stops with a non-zero exit code when its
last engine dies (unless ``engines_restart``: the supervisor restarts engines), or when no
engine is READY within ``startup_timeout_s``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import vllm_engine_pb2_grpc

from switchboard.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    generation_service_pb2,
    generation_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
)
from switchboard.common.exit_codes import START_FAILED
from switchboard.common.log_limits import report_suppressed
from switchboard.common.tls import grpc_server_credentials, tls_enabled
from switchboard.config import GatewayConfig, GatewayRoleConfig
from switchboard.gateway.admission import Admission
from switchboard.gateway.auth import AuthInterceptor, Credentials
from switchboard.gateway.chat.template import ChatTemplate, load_chat_template
from switchboard.gateway.engines.engine_client import EngineClient
from switchboard.gateway.engines.prefix_routing import PrefixRouting
from switchboard.gateway.http.aiohttp_server import HttpServer
from switchboard.gateway.model_facts import ModelFacts
from switchboard.gateway.observability.observer import Observability
from switchboard.gateway.pipeline.generate_call import GenerateCalls
from switchboard.gateway.pipeline.request_bounds import longest_token_bytes
from switchboard.gateway.request_guard import MalformedRequestGuard
from switchboard.gateway.servicers.admin import AdminServicer
from switchboard.gateway.servicers.generation import GenerationServicer
from switchboard.gateway.servicers.model_service import ModelServicer
from switchboard.gateway.servicers.vllm_engine.servicer import (
    SERVICE_NAME as VLLM_ENGINE_SERVICE,
)
from switchboard.gateway.servicers.vllm_engine.servicer import VllmEngineServicer
from switchboard.gateway.state import GatewayState
from switchboard.gateway.text import Tokenizer

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_service_pb2.DESCRIPTOR.services_by_name[
    "GenerationService"
].full_name
# Readiness, under either name: routers of the vLLM engine contract ask for their service's.
READINESS_SERVICES = (GENERATION_SERVICE, VLLM_ENGINE_SERVICE)
EXIT_ENGINES_DEAD = 1


def _service_names(enable_admin: bool) -> list[str]:
    names = [
        GENERATION_SERVICE,
        model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
        VLLM_ENGINE_SERVICE,
    ]
    if enable_admin:
        names.append(admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name)
    return names


def _grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Long silent generations must survive client keepalive pings (as in vLLM's server).
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # Several gateways (--api-servers) bind the same port; the kernel spreads connections.
        ("grpc.so_reuseport", 1),
    ]


def _tls_words(gateway: GatewayConfig) -> str:
    if not tls_enabled(gateway):
        return "plaintext"
    return "TLS, client certificates required" if gateway.ssl_ca_certs else "TLS"


def _auth_words(credentials: Credentials) -> str:
    keys = len(credentials.api_keys)
    words = f"{keys} API key{'s' if keys != 1 else ''}" if keys else "no API keys"
    return words + (", admin token" if credentials.admin_token else "")


def _load_chat_template(config: GatewayRoleConfig) -> ChatTemplate | None:
    model = config.model
    template = load_chat_template(model.model, model.chat_template or None)
    if template is None:
        logger.info("model %r has no chat template: requests with messages are refused", model.name)
    else:
        where = model.chat_template or "the checkpoint"
        logger.info(
            "chat template from %s (bos %r, eos %r)", where, template.bos_token, template.eos_token
        )
    return template


class GatewayServer:
    def __init__(self, config: GatewayRoleConfig, credentials: Credentials | None = None) -> None:
        """``credentials``: the keys to check (default: from the config and environment,
        ``Credentials.load``)."""
        self.config = config
        self.credentials = (
            credentials if credentials is not None else Credentials.load(config.gateway)
        )
        self.port = 0
        self._exit_code: int | None = None
        self._stop_requested = asyncio.Event()
        self._health = health.aio.HealthServicer()
        self._engines = EngineClient(
            config.input_address,
            config.output_address,
            client_index=config.client_index,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            on_engines_changed=self._on_engines_changed,
            coordinator_publish_address=config.coordinator_publish_address,
            handshake_address=config.handshake_address,
            curve_keys_dir=config.curve_keys_dir,
            resume_timeout_s=config.resume_timeout_s,
            stall_warn_s=config.gateway.stall_warn_s,
            engines_restart=config.engines_restart,
            prefix_routing=_prefix_routing(config.gateway),
        )
        tokenizer = Tokenizer.from_model_dir(config.model.model)
        self.state = GatewayState(
            config=config,
            tokenizer=tokenizer,
            checkpoint_facts=ModelFacts.from_checkpoint(config.model, tokenizer.vocab_size),
            engines=self._engines,
            executor=ThreadPoolExecutor(
                max_workers=config.gateway.tokenizer_threads, thread_name_prefix="tokenizer"
            ),
            observability=Observability(config, tokenizer, self._engines, self.credentials),
            chat_template=_load_chat_template(config),
            longest_token_bytes=longest_token_bytes(tokenizer),
            admission=Admission(
                config.gateway.max_inflight_requests, config.gateway.max_queued_prompt_tokens
            ),
        )
        self._server = grpc.aio.server(
            options=_grpc_options(config.gateway.max_message_bytes),
            # The key check first: an unauthenticated request is never parsed.
            interceptors=[AuthInterceptor(self.credentials), MalformedRequestGuard()],
        )
        self._engines.on_resumed = self.state.observability.request_resumed
        self._engines.on_stream_stalled = self.state.observability.stream_stalled
        # One call path and registry for gRPC and HTTP.
        self._calls = GenerateCalls(self.state, self.credentials)
        self.ready = False  # what the readiness service says (gRPC health and HTTP /ready)
        self._http = HttpServer(self.state, self._calls, lambda: self.ready, self.credentials)
        self.http_port: int | None = None
        self._health_tasks: set[asyncio.Task] = set()
        self._stopped = False

    @property
    def engines(self) -> EngineClient:
        return self._engines

    async def start(self) -> int:
        """Bind wire 1 and the gRPC port, start serving; return the bound gRPC port."""
        gateway = self.config.gateway
        await self._engines.start()
        state = self.state
        state.observability.start()
        generation_service_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(state, self._calls), self._server
        )
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(
            ModelServicer(state), self._server
        )
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            VllmEngineServicer(state, self._calls, lambda: self.ready), self._server
        )
        if gateway.enable_admin:
            admin_service_pb2_grpc.add_AdminServiceServicer_to_server(
                AdminServicer(state), self._server
            )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        services = _service_names(gateway.enable_admin)
        reflection.enable_server_reflection(
            [*services, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
        )
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        for service in READINESS_SERVICES:
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{gateway.host}:{gateway.port}"
        if ":" in gateway.host:
            address = f"[{gateway.host}]:{gateway.port}"
        if tls_enabled(gateway):
            self.port = self._server.add_secure_port(address, grpc_server_credentials(gateway))
        else:
            self.port = self._server.add_insecure_port(address)
        await self._server.start()
        logger.info(
            "Gateway_%d listening on %s:%d (gRPC: %s; admin %s; %s; %s)",
            self.config.client_index,
            gateway.host,
            self.port,
            ", ".join(services),
            "enabled" if gateway.enable_admin else "disabled",
            _tls_words(gateway),
            _auth_words(self.credentials),
        )
        if gateway.enable_admin and not self.credentials.admin_token:
            logger.warning(
                "AdminService has no --admin-token: it is as open as the data plane%s",
                " (any API key opens it)" if self.credentials.keys_required else "",
            )
        self.http_port = await self._http.start(self.config.shutdown_grace_s)
        return self.port

    def request_stop(self, exit_code: int = 0) -> None:
        if self._exit_code is None:
            self._exit_code = exit_code
        self._stop_requested.set()

    async def run(self) -> int:
        """Serve until asked to stop (or, on one machine, until the engines are gone)."""
        watch = asyncio.create_task(self._watch_startup())
        try:
            await self._stop_requested.wait()
        finally:
            watch.cancel()
            await self.stop()
        return self._exit_code or 0

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s
        logger.info("gateway stopping: NOT_SERVING, draining for up to %.0fs", grace)
        self.ready = False
        await self._health.enter_graceful_shutdown()
        await asyncio.gather(self._server.stop(grace), self._http.stop())
        await self._engines.close()
        await self.state.observability.stop()
        self.state.executor.shutdown(wait=False, cancel_futures=True)
        report_suppressed()
        logger.info("gateway stopped")

    async def _watch_startup(self) -> None:
        timeout = self.config.gateway.startup_timeout_s
        if await self._engines.wait_until_ready(timeout):
            return
        if self.config.exit_when_engines_dead:
            logger.error("no engine core sent READY within %.0fs; exiting", timeout)
            self.request_stop(EXIT_ENGINES_DEAD)
        else:
            logger.warning("no engine core sent READY within %.0fs; still waiting", timeout)

    def _on_engines_changed(self) -> None:
        self.state.refresh_facts()
        live = self._engines.live_engines
        # One machine: ready once every engine of the server has been READY (a request pinned
        # to any rank can be served from the start); from then on, and elsewhere (engines come
        # and go), while any engine takes requests: one dead, restarting or stalled engine
        # leaves the others serving.
        needed = max(1, self.config.num_engines) if self.config.exit_when_engines_dead else 1
        routable = self._engines.routable_engines
        self.ready = (
            len(self._engines.engines) >= needed
            and bool(routable)
            and not self._stop_requested.is_set()
        )
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in READINESS_SERVICES:
            task = asyncio.get_running_loop().create_task(self._health.set(service, status))
            self._health_tasks.add(task)
            task.add_done_callback(self._health_tasks.discard)
        if (
            not live
            and self._engines.engines
            and self.config.exit_when_engines_dead
            and not self.config.engines_restart
        ):
            logger.error("every engine core is dead; the gateway exits")
            self.request_stop(EXIT_ENGINES_DEAD)


async def serve(config: GatewayRoleConfig) -> int:
    """Run one gateway until SIGINT/SIGTERM (exit code 0) or its engines die (non-zero);
    ``START_FAILED`` when it cannot start (a port in use, a bad certificate)."""
    server = GatewayServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.request_stop, 0)
    try:
        await server.start()
    except Exception:
        logger.exception("the gateway failed to start")
        return START_FAILED
    # What starting allocated lives as long as the process (the tokenizer's tables, gRPC's
    # and protobuf's modules): collections skip it from now on, as the engine core's do. Under
    # load a collection that walked all of it stopped the event loop while new calls waited to
    # be accepted and first tokens to go out (5-10 % of the gateway's samples at 32 and 64
    # streams, most inside the accept of a new call).
    gc.collect()
    gc.freeze()
    return await server.run()


def _prefix_routing(config: GatewayConfig) -> PrefixRouting | None:
    """The DP routing policy the flags ask for (None: power of two choices)."""
    if config.routing_policy != "prefix":
        return None
    return PrefixRouting(
        config.prefix_routing_min_match,
        config.prefix_routing_max_imbalance,
        config.prefix_routing_running_weight,
    )
