"""One-machine launcher: starts every process of a server, watches them, stops them together.

`switchboard serve` is a supervisor, not a server: it resolves the model, creates a private run
directory for the ipc:// sockets, starts the gateways (which bind) and the engine cores (which
connect and start their own workers), and then waits. The fate rule (docs/architecture.md) for
one machine: no single death but the supervisor's stops the server. A child that exits on its
own is started again after a backoff, at the same addresses (``RestartPolicy`` "always", the
default; each process has its own budget, kept by ``restarts.py``):

* an engine core: the supervisor first tells the gateways (ENGINE_CORE_DEAD on its behalf, so
  they route around it and resume its streams elsewhere) and removes its ring; the gateways
  re-admit it on READY;
* a gateway: its clients' streams ended with its connections; the engines see its connection
  drop, abort its requests, and send READY again when the restarted gateway binds (with
  ``--api-servers N`` the others share the gRPC port and are untouched);
* the coordinator: the gateways route on their own counts until it publishes again; it
  rebuilds its table from the engines' next reports.

More than ``max_restarts`` within ``window_s``, policy "never", or a process whose first start
failed (exit code ``START_FAILED``: a bad model or configuration would fail every restart the
same way): the whole server goes down with a non-zero exit code. SIGINT/SIGTERM stops
everything cleanly with exit code 0, the gateways first (they drain their streams for
``--shutdown-grace``). The run directory is removed at exit.

Children are started as fresh interpreters (``python -m switchboard.<role>``), which is what the
``spawn`` start method means: nothing of the supervisor's state is inherited, and no role imports
another role's module. Each child is in its own session so that a terminal's Ctrl-C reaches only
the supervisor, which then stops the children in order (gateways first, so that they report
NOT_SERVING before their engines go away).

Once the gateways report SERVING for generation (every engine core has sent READY), the
supervisor logs one line with every address the server serves (``server_addresses``) and how
the engines run the model (its dtype and quantization, as GetModelInfo reports them): the "you
can start now" line of a first start.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Any, TypeVar

import grpc
import msgspec
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchboard.common.tls import tls_enabled, tls_handshake_failed
from switchboard.config import (
    CoordinatorConfig,
    EngineConfig,
    GatewayRoleConfig,
    encode_config,
    ipc_address,
    new_run_dir,
)
from switchboard.supervisor.ready_report import (
    probe_channel,
    ready_line,
    served_as,
)
from switchboard.supervisor.restarts import Child, RestartPolicy, Restarts
from switchboard.supervisor.routing_events import with_routing_events
from switchboard.supervisor.start_method import require_main_process
from switchboard.wire import zmq_channel
from switchboard.wire.shm_ring import unlink_orphaned_segments

logger = logging.getLogger("switchboard.supervisor.launcher")

__all__ = ["Child", "RestartPolicy", "Supervisor", "plan_coordinator", "plan_server", "serve"]

STOP_GRACE_S = 15.0  # engines and the coordinator, after the gateways stopped
GATEWAY_STOP_MARGIN_S = 10.0  # on top of the gateways' own --shutdown-grace
READINESS_SERVICE = "switchboard.v1.GenerationService"  # the gateway's readiness health name
READY_POLL_S = 0.25
PROBE_TLS_FAILURES = 8  # failed TLS handshakes in a row before the ready probe gives up


def plan_coordinator(engine: EngineConfig, run_dir: str) -> CoordinatorConfig | None:
    """The coordinator of a one-machine server: only when DP > 1."""
    num_engines = engine.parallel.data_parallel_size
    if num_engines <= 1:
        return None
    return CoordinatorConfig(
        input_address=ipc_address(run_dir, "coordinator-input"),
        publish_address=ipc_address(run_dir, "coordinator-publish"),
        num_engines=num_engines,
    )


def plan_server(
    gateway: GatewayRoleConfig, engine: EngineConfig, run_dir: str
) -> tuple[list[GatewayRoleConfig], list[EngineConfig]]:
    """The per-process configs of a one-machine server: A gateways, DP engine cores (each
    connected to every gateway, and to the coordinator when DP > 1)."""
    parallel = engine.parallel
    coordinator = plan_coordinator(engine, run_dir)
    engine = with_routing_events(gateway, engine, run_dir)
    gateways = [
        _replace(
            gateway,
            client_index=i,
            input_address=ipc_address(run_dir, f"gateway{i}-input"),
            output_address=ipc_address(run_dir, f"gateway{i}-output"),
            num_engines=parallel.data_parallel_size,
            coordinator_publish_address=coordinator.publish_address if coordinator else "",
        )
        for i in range(parallel.api_servers)
    ]
    engines = [
        _replace(
            engine,
            data_parallel_rank=rank,
            gateway_input_addresses=[g.input_address for g in gateways],
            gateway_output_addresses=[g.output_address for g in gateways],
            run_dir=run_dir,
            coordinator_address=coordinator.input_address if coordinator else "",
            first_device_index=rank * parallel.world_size,  # each engine its own devices
            worker=_replace(
                engine.worker,
                workers_on_host=parallel.data_parallel_size * parallel.world_size,
            ),
        )
        for rank in range(parallel.data_parallel_size)
    ]
    return gateways, engines


S = TypeVar("S", bound=msgspec.Struct)


def _replace(config: S, **changes: Any) -> S:
    return msgspec.structs.replace(config, **changes)


def _start(role: str, module: str, config_json: str) -> Child:
    cmd = [sys.executable, "-m", module, "--config-json", config_json]
    process = subprocess.Popen(cmd, start_new_session=True)
    logger.info("started %s (pid %d)", role, process.pid)
    return Child(role, process, module, config_json)


class Supervisor:
    def __init__(
        self,
        gateways: list[GatewayRoleConfig],
        engines: list[EngineConfig],
        run_dir: str,
        coordinator: CoordinatorConfig | None = None,
        restart: RestartPolicy | None = None,
    ):
        self._restarts = Restarts(restart or RestartPolicy())
        self._dead_pids: list[tuple[str, int]] = []  # engines that died (their rings)
        self._gateways = gateways
        self._engines = engines
        self._coordinator = coordinator
        self._run_dir = run_dir
        self._children: list[Child] = []
        self._stop_requested = threading.Event()
        self._started = time.monotonic()

    def run(self) -> int:
        """Start everything and wait; returns the exit code."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            if self._coordinator is not None:  # binds first: engines and gateways connect
                self._children.append(
                    _start(
                        "Coordinator", "switchboard.coordinator", encode_config(self._coordinator)
                    )
                )
            for cfg in self._gateways:
                self._children.append(
                    _start(f"Gateway_{cfg.client_index}", "switchboard.gateway", encode_config(cfg))
                )
            for engine in self._engines:
                self._children.append(
                    _start(
                        f"EngineCore_DP{engine.data_parallel_rank}",
                        "switchboard.engine",
                        encode_config(engine),
                    )
                )
            threading.Thread(target=self._announce_ready, name="ready", daemon=True).start()
            failed = self._wait_for_first_exit()
            if failed is not None:
                logger.error(
                    "%s (pid %d) exited with code %s: stopping the server",
                    failed.role,
                    failed.process.pid,
                    failed.process.returncode,
                )
            return 0 if failed is None else 1
        finally:
            self._stop_all()
            self._remove_orphaned_rings()
            shutil.rmtree(self._run_dir, ignore_errors=True)
            logger.info("removed run directory %s", self._run_dir)

    def _announce_ready(self) -> None:
        """Log the ready line once the gateway's readiness health is SERVING (it turns so when
        every engine core has sent READY); give up silently when the server stops first."""
        if not self._gateways or self._gateways[0].gateway.port == 0:
            return  # an ephemeral port: nothing to probe, nothing useful to print
        request = health_pb2.HealthCheckRequest(service=READINESS_SERVICE)
        tls_failures = 0  # in a row, TLS on: the probe's certificate or trust is wrong
        with probe_channel(self._gateways[0]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop_requested.is_set():
                try:
                    status = stub.Check(request, timeout=1.0).status
                except grpc.RpcError as error:
                    status = None
                    failed_tls = tls_enabled(self._gateways[0].gateway) and tls_handshake_failed(
                        error
                    )
                    tls_failures = tls_failures + 1 if failed_tls else 0
                    if tls_failures >= PROBE_TLS_FAILURES:
                        logger.warning(
                            "the readiness probe cannot complete a TLS handshake with its "
                            "gateway (%s): no ready line; the server serves regardless. It "
                            "trusts --ssl-ca-certs (else the certificate itself) and, under "
                            "mTLS, shows the server's certificate, which must allow client use",
                            error.details(),
                        )
                        return
                if status == health_pb2.HealthCheckResponse.SERVING:
                    if not self._stop_requested.is_set():
                        took = time.monotonic() - self._started
                        line = ready_line(self._gateways, self._engines, took, served_as(channel))
                        logger.info("%s", line)
                    return
                self._stop_requested.wait(READY_POLL_S)

    def _remove_orphaned_rings(self) -> None:
        """An engine killed with -9 cannot unlink its shared-memory ring: do it for it."""
        engines = [(c.role, c.process.pid) for c in self._children if c.role.startswith("Engine")]
        for role, pid in engines + self._dead_pids:
            for name in unlink_orphaned_segments(pid):
                logger.warning("removed shared-memory ring %s left by %s", name, role)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s: stopping", signal.Signals(signum).name)
        # Not set() here: the handler runs on the main thread between two bytecodes, possibly
        # inside _stop_requested.wait() while that holds the event's lock, and set() would wait
        # for that lock forever (seen: a SIGTERM 0.5 s after the ready line never stopped the
        # server). A thread of its own takes the lock once the main thread lets go of it.
        threading.Thread(target=self._stop_requested.set, name="stop", daemon=True).start()

    def _wait_for_first_exit(self) -> Child | None:
        """Block until a stop is requested (None) or a child exits on its own and is not
        restarted (that child)."""
        while not self._stop_requested.is_set():
            for child in list(self._children):
                if child.process.poll() is not None:
                    if self._stop_requested.is_set():
                        return None
                    if not self._schedule_restart(child):
                        return child
            self._restarts.note_engine_workers(self._children, time.monotonic())
            for dead in self._restarts.take_due(time.monotonic()):
                self._children.append(_start(dead.role, dead.module, dead.config_json))
            self._stop_requested.wait(0.1)
        return None

    def _schedule_restart(self, child: Child) -> bool:
        """A child exited on its own: restart it after a backoff if the policy and its restart
        budget allow (True); False: the server stops. A dead engine core is first reported to
        the gateways, its ring removed and its workers awaited; a gateway or the coordinator
        needs nothing but the restart (their peers reconnect to the same addresses)."""
        if not self._restarts.schedule(child, time.monotonic()):
            return False
        self._children.remove(child)
        if child.role.startswith("EngineCore"):
            self._dead_pids.append((child.role, child.process.pid))
            self._tell_gateways_engine_dead(child)
            self._remove_orphaned_rings()
        return True

    def _tell_gateways_engine_dead(self, child: Child) -> None:
        """ENGINE_CORE_DEAD on the dead engine's behalf (one killed with -9 says nothing): the
        gateways fail over its requests now rather than after the heartbeat timeout."""
        rank = int(child.role.removeprefix("EngineCore_DP"))
        frames = zmq_channel.engine_dead_frames(rank)
        ctx = zmq.Context()
        try:
            for cfg in self._gateways:
                sock = zmq_channel.make_socket(
                    ctx, zmq.PUSH, cfg.output_address, bind=False, linger_ms=1000
                )
                sock.send_multipart(frames)
                sock.close()
        finally:
            ctx.term()

    def _stop_all(self) -> None:
        # Gateways first, and wait for them: they report NOT_SERVING and drain their streams
        # while the engines are still there to finish them.
        gateways = [c for c in self._children if c.role.startswith("Gateway")]
        others = [c for c in self._children if not c.role.startswith("Gateway")]
        grace = max((g.shutdown_grace_s for g in self._gateways), default=0.0)
        for group, wait_s in ((gateways, grace + GATEWAY_STOP_MARGIN_S), (others, STOP_GRACE_S)):
            deadline = time.monotonic() + wait_s
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            for child in group:
                self._wait_or_kill(child, deadline)

    @staticmethod
    def _wait_or_kill(child: Child, deadline: float) -> None:
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) did not stop: killing", child.role, child.process.pid)
            child.process.kill()
            child.process.wait()


def serve(
    gateway: GatewayRoleConfig,
    engine: EngineConfig,
    run_dir_base: str | None = None,
    restart: RestartPolicy | None = None,
) -> int:
    """Run a whole server on this machine until SIGINT/SIGTERM (0) or a child's death that is
    not restarted (1).

    Library use: call it under ``if __name__ == "__main__":`` (see ``start_method``); it
    raises ``MissingMainGuard`` when called from a multiprocessing child instead."""
    require_main_process()
    run_dir = new_run_dir(run_dir_base)
    logger.info("run directory %s (pid %d)", run_dir, os.getpid())
    restart = restart or RestartPolicy()
    if restart.restarts:  # the gateways wait for a restarted engine instead of exiting
        gateway = _replace(gateway, engines_restart=True)
        engine = _replace(engine, exit_after_frozen_s=gateway.heartbeat_timeout_s)
    gateways, engines = plan_server(gateway, engine, run_dir)
    coordinator = plan_coordinator(engine, run_dir)
    return Supervisor(gateways, engines, run_dir, coordinator, restart).run()
