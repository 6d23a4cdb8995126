"""Topologies end to end (tiny checkpoint, CPU): process counts and titles for (A, DP, PP, TP),
data-parallel routing, and a gateway and engines started as separate commands over TCP.

These tests check the processes and the wires; the split of the arithmetic across TP/PP ranks
(and its greedy equality with TP = PP = 1) is tested with the model runner and in test_serve.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.supervisor.processes import Topology, list_processes
from switchboard.wire.shm_ring import unlink_orphaned_segments
from tests.e2e.client_calls import greedy_request
from tests.e2e.server import RunningServer, free_port, start_server, wait_until

pytestmark = pytest.mark.slow

SMALL_KV = ("--kv-cache-memory-bytes", str(8 << 20))
READINESS = "switchboard.v1.GenerationService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WAIT_S = 120.0


def greedy(max_tokens: int = 8, rank: int | None = None) -> pb.GenerateRequest:
    return greedy_request([5, 6, 7, 8], max_tokens, data_parallel_rank=rank)


def generate(target: str, request: pb.GenerateRequest) -> pb.GenerateResponse:
    """The last response of one Generate call."""
    with grpc.insecure_channel(target) as channel:
        responses = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    return responses[-1]


def wait_for(predicate, what: str) -> None:
    wait_until(predicate, what, WAIT_S, interval_s=0.2)


def ps_titles(server: RunningServer) -> list[str]:
    """What `switchboard ps --pid <server>` lists, as titles."""
    out = subprocess.run(
        [sys.executable, "-m", "switchboard.cli", "ps", "--pid", str(server.process.pid)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out[0].split() == ["ROLE", "RANK", "PID", "PPID", "CPU", "s", "CPU", "%"]
    assert out[-1] == f"{len(out) - 2} switchboard processes"
    titles = []
    for line in out[1:-1]:
        role, rank, pid, ppid, cpu_s, cpu_percent = line.split()
        assert int(pid) > 0 and int(ppid) > 0 and float(cpu_s) >= 0 and float(cpu_percent) >= 0
        titles.append(f"switchboard::{role}" + ("" if rank == "-" else f"_{rank}"))
    return titles


def check_formula(server: RunningServer, topo: Topology) -> None:
    assert sorted(ps_titles(server)) == sorted(topo.titles())
    assert len(list_processes(server.process.pid)) == topo.total


@pytest.mark.parametrize(("a", "dp", "pp", "tp"), [(1, 1, 1, 1), (1, 1, 1, 2)])
def test_ps_counts_match_the_formula(
    tiny_model: str, tmp_path: Path, a: int, dp: int, pp: int, tp: int
) -> None:
    args = ["--api-servers", str(a), "-dp", str(dp), "-pp", str(pp), "-tp", str(tp)]
    server = start_server(tiny_model, tmp_path, *args, *SMALL_KV)
    try:
        check_formula(server, Topology(a, dp, pp, tp))
        assert generate(server.target, greedy()).outputs[0].finish_reason
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def dp2_server(
    tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """(A, DP, PP, TP) = (2, 2, 1, 1): two gateways on one port, two engines, a coordinator."""
    workdir = tmp_path_factory.mktemp("dp2")
    server = start_server(tiny_model, workdir, "-dp", "2", *SMALL_KV)
    # Both gateways must know both engines before the load is measured.
    wait_for(lambda: server.log().count(") READY: max_model_len") == 4, "4 READY admissions")
    yield server
    assert server.stop() == 0, server.log()
    assert server.leftovers == [], "the run directory must be removed"


def test_ps_counts_two_gateways_two_engines(dp2_server: RunningServer) -> None:
    check_formula(dp2_server, Topology(2, 2, 1, 1))


def test_dp2_spreads_concurrent_requests_over_both_engines(dp2_server: RunningServer) -> None:
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        finals = list(pool.map(lambda _: generate(dp2_server.target, greedy(16)), range(40)))
    assert all(f.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH for f in finals)
    per_engine = collections.Counter(f.metrics.engine_id.split("-")[0] for f in finals)
    assert set(per_engine) == {"EngineCore_DP0", "EngineCore_DP1"}
    assert min(per_engine.values()) >= 10, per_engine  # neither gets less than 25%


def test_dp2_pinned_rank(dp2_server: RunningServer) -> None:
    for rank in (0, 1):
        final = generate(dp2_server.target, greedy(rank=rank))
        assert final.metrics.engine_id.startswith(f"EngineCore_DP{rank}-")
    with pytest.raises(grpc.RpcError) as error:
        generate(dp2_server.target, greedy(rank=2))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # DP = 2: ranks 0 and 1


# ---- gateway and engine as separate commands (the Kubernetes building blocks) ----------------


class Role:
    """One `switchboard gateway|engine` process, its log, and its clean stop."""

    def __init__(self, name: str, args: list[str], workdir: Path, env: dict[str, str]) -> None:
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "switchboard.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def health(target: str, service: str = READINESS) -> int:
    try:
        with grpc.insecure_channel(target) as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status
    except grpc.RpcError:
        return -1


def exports_engine_series(target: str, metrics_port: int) -> bool:
    host = target.split(":")[0]
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=30) as reply:
        return 'switchboard:num_requests_running{engine="0"' in reply.read().decode()


def test_gateways_and_engine_as_separate_commands(tiny_model: str, tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"  # stands for the headless Service's DNS records
    hosts.write_text("127.0.0.1 sb-gateways\n")
    run_base = tempfile.mkdtemp(prefix="sbtcp-")  # short: ipc:// paths have a length limit
    env = dict(
        os.environ,
        SWITCHBOARD_HOSTS_FILE=str(hosts),
        SWITCHBOARD_RPC_BASE_PATH=run_base,
        PYTHONUNBUFFERED="1",
    )
    handshake_port = free_port()
    targets = [f"127.0.0.1:{free_port()}", f"127.0.0.2:{free_port()}"]
    metrics_ports = [free_port(), free_port()]

    def gateway(i: int) -> Role:
        host, port = targets[i].split(":")
        args = ["gateway", "--model", tiny_model, "--host", host, "--port", port,
                "--engine-host", host, "--handshake-port", str(handshake_port),
                "--engine-heartbeat-timeout", "3",
                "--no-resume",  # the cut-off stream fails (resume: tests/e2e/test_resilience)
                "--metrics-port", str(metrics_ports[i]),
                "--http-port", str(free_port())]  # fmt: skip
        return Role(f"gateway{i}", args, tmp_path, env)

    def engine() -> Role:
        args = ["engine", "--model", tiny_model, "--gateway-address",
                f"sb-gateways:{handshake_port}", "--discovery-interval", "0.5",
                "--data-parallel-rank", "0", *SMALL_KV]  # fmt: skip
        return Role("engine", args, tmp_path, env)

    roles = [gateway(0), engine()]

    def serving(target: str, status: int = SERVING) -> bool:
        for role in roles:
            assert role.process.poll() is None or role is dead, role.log()
        return health(target) == status

    dead = None
    try:
        wait_for(lambda: serving(targets[0]), "gateway 0 serves")
        first_engine = generate(targets[0], greedy()).metrics.engine_id

        # The engine dies with a request in flight: UNAVAILABLE, the gateway stays up.
        dead = roles[1]
        os.kill(dead.process.pid, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(generate, targets[0], greedy(64))
            time.sleep(0.5)
            os.kill(dead.process.pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as error:
                pending.result(timeout=60)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        dead.process.wait(30)
        unlink_orphaned_segments(dead.process.pid)
        wait_for(lambda: serving(targets[0], NOT_SERVING), "gateway 0 reports NOT_SERVING")
        assert health(targets[0], "") == SERVING and roles[0].process.poll() is None

        # Restarted, it is re-admitted.
        roles[1] = engine()
        wait_for(lambda: serving(targets[0]), "the restarted engine is re-admitted")
        second_engine = generate(targets[0], greedy()).metrics.engine_id
        assert second_engine.startswith("EngineCore_DP0-") and second_engine != first_engine

        # A gateway added later is discovered through the name and serves.
        roles.append(gateway(1))
        hosts.write_text("127.0.0.1 sb-gateways\n127.0.0.2 sb-gateways\n")
        wait_for(lambda: serving(targets[1]), "gateway 1 is discovered")
        assert generate(targets[1], greedy()).metrics.engine_id == second_engine
        assert generate(targets[0], greedy()).metrics.engine_id == second_engine
        # Both gateways' client indices are random: the engine names one of them the exporter
        # of its engine-level series (in both answers' stats), so it is counted exactly once.
        exporters = [
            exports_engine_series(t, p) for t, p in zip(targets, metrics_ports, strict=True)
        ]
        assert exporters.count(True) == 1, exporters
    finally:
        codes = [role.stop() for role in reversed(roles)]
        shutil.rmtree(run_base, ignore_errors=True)
    assert codes == [0] * len(roles), "\n".join(role.log()[-3000:] for role in roles)


def test_coordinator_as_a_separate_command_feeds_the_gateway(
    tiny_model: str, tmp_path: Path
) -> None:
    """DP = 2 with every role its own command over TCP (as on Kubernetes): both engines push
    their load to `switchboard coordinator`, its reports reach the gateway, and the processes
    across the "hosts" are the formula's: 1 gateway + 2 engines + 2 workers + 1 coordinator."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 sb-gateways\n")
    run_base = tempfile.mkdtemp(prefix="sbcoord-")
    env = dict(
        os.environ,
        SWITCHBOARD_HOSTS_FILE=str(hosts),
        SWITCHBOARD_RPC_BASE_PATH=run_base,
        PYTHONUNBUFFERED="1",
    )
    handshake_port, load_port, report_port = free_port(), free_port(), free_port()
    grpc_port = free_port()
    target = f"127.0.0.1:{grpc_port}"
    coordinator = Role("coordinator", ["coordinator", "--host", "127.0.0.1", "--load-port",
                       str(load_port), "--report-port", str(report_port), "-dp", "2"],
                       tmp_path, env)  # fmt: skip
    gateway = Role("gateway", ["gateway", "--model", tiny_model, "--host", "127.0.0.1",
                   "--port", str(grpc_port), "--engine-host", "127.0.0.1", "--handshake-port",
                   str(handshake_port), "-dp", "2", "--coordinator-address",
                   f"127.0.0.1:{report_port}", "--http-port", "-1"], tmp_path, env)  # fmt: skip
    roles = [coordinator, gateway]
    for rank in (0, 1):
        args = ["engine", "--model", tiny_model, "--gateway-address",
                f"sb-gateways:{handshake_port}", "--discovery-interval", "0.5",
                "--data-parallel-rank", str(rank), "--coordinator-address",
                f"127.0.0.1:{load_port}", *SMALL_KV]  # fmt: skip
        roles.append(Role(f"engine{rank}", args, tmp_path, env))

    def logged(role: Role, text: str) -> bool:
        for each in roles:
            assert each.process.poll() is None, each.log()
        return text in role.log()

    try:
        # Idle engines report too: the table is complete before the first request.
        wait_for(lambda: logged(coordinator, "2 of 2 engines heard from"), "both engines report")
        wait_for(lambda: logged(gateway, "load reports cover engine ranks [0, 1]"), "reports")
        wait_for(lambda: gateway.log().count(") READY: max_model_len") == 2, "2 READY admissions")
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            finals = list(pool.map(lambda _: generate(target, greedy(8)), range(16)))
        assert all(f.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH for f in finals)
        engines = {f.metrics.engine_id.split("-")[0] for f in finals}
        assert engines == {"EngineCore_DP0", "EngineCore_DP1"}

        processes = [p for role in roles for p in list_processes(role.process.pid)]
        counts = collections.Counter(p.role for p in processes)
        topo = Topology(api_servers=1, data_parallel=2, pipeline_parallel=1, tensor_parallel=1)
        assert counts == {"Gateway": 1, "EngineCore": 2, "Worker": 2, "Coordinator": 1}
        assert len(processes) == topo.total

        # The coordinator is only an aid to routing: without it the gateway serves on.
        assert coordinator.stop() == 0, coordinator.log()
        roles.remove(coordinator)
        assert generate(target, greedy()).outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        codes = [role.stop() for role in reversed(roles)]
        shutil.rmtree(run_base, ignore_errors=True)
    assert codes == [0] * len(roles), "\n".join(role.log()[-3000:] for role in roles)
