"""The chart's topology, run here: the rendered coordinator, gateway and engine commands (DP =
2) as local processes, with the cluster's names rewritten to 127.0.0.1, the model to the tiny
checkpoint and every port to a free one, and CURVE on as by default: the rendered keys hook Job
makes the Secret (against tests/chart/kube_api_stub.py) and each process gets the files its
pod's Secret volume projects; one Generate call through the gateway."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.chart.chart_render import RELEASE, argv, container, manifests
from tests.chart.curve_keys import hook, project_keys, run_keys_job
from tests.chart.kube_api_stub import KubeApiStub
from tests.e2e.client_calls import greedy_request
from tests.e2e.server import free_port, wait_until
from tests.gateway.tls_certs import make_certs
from tests.tiny_checkpoint import tiny_llama_dir

READINESS = "switchboard.v1.GenerationService"
CLUSTER_SUFFIX = ".svc"  # every in-cluster name the chart renders ends so


def local_argv(rendered: list[str], model_dir: str, keys_dir: str) -> list[str]:
    """``rendered`` with in-cluster names and 0.0.0.0 turned into 127.0.0.1, the model
    directory into ``model_dir`` and the CURVE keys' mount into ``keys_dir``."""
    out = []
    for previous, arg in zip(["", *rendered], rendered, strict=False):
        if previous == "--model":
            arg = model_dir
        elif previous == "--curve-keys-dir":
            arg = keys_dir
        elif arg == "0.0.0.0":
            arg = "127.0.0.1"
        elif CLUSTER_SUFFIX + ":" in arg:
            arg = "127.0.0.1:" + arg.rsplit(":", 1)[1]
        out.append(arg)
    return out


class Process:
    def __init__(self, name: str, args: list[str], env: dict[str, str], workdir: Path) -> None:
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "switchboard.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
            return None


def serving(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as channel:
            request = health_pb2.HealthCheckRequest(service=READINESS)
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


@pytest.mark.slow
def test_rendered_topology_serves_a_generate_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grpc_port, handshake_port = free_port(), free_port()
    load_port, report_port = free_port(), free_port()
    values = {
        "dataParallelSize": 2,
        "gateway": {"port": grpc_port, "handshakePort": handshake_port},
        "coordinator": {"loadPort": load_port, "reportPort": report_port},
        "engine": {"kvCacheMemoryBytes": 8 << 20, "discoveryIntervalSeconds": 0.5},
    }
    docs = manifests(values)
    role = hook(docs, "Role")
    with KubeApiStub(role, make_certs(tmp_path / "certs"), tmp_path) as api:
        run_keys_job(docs, api, monkeypatch)
    keys = api.data(f"{RELEASE}-switchboard-curve")
    model_dir = tiny_llama_dir()
    run_base = tempfile.mkdtemp(prefix="sbchart-")  # short: ipc:// paths have a length limit
    env = dict(os.environ, SWITCHBOARD_RPC_BASE_PATH=run_base)

    def start(name: str, kind: str, component: str, *extra: str) -> Process:
        spec = container(docs, kind, component)
        env.update({e["name"]: e["value"] for e in spec.get("env", [])})
        keys_dir = project_keys(docs, kind, component, keys, tmp_path / "keys" / name)
        args = local_argv(argv(spec), model_dir, str(keys_dir))
        return Process(name, [*args, *extra], dict(env), tmp_path)

    processes = [start("coordinator", "Deployment", "coordinator")]
    processes.append(start("gateway", "Deployment", "gateway"))
    # In the StatefulSet the rank is the ordinal ending the pod's host name.
    for rank in (0, 1):
        processes.append(
            start(f"engine{rank}", "StatefulSet", "engine", "--data-parallel-rank", str(rank))
        )
    target = f"127.0.0.1:{grpc_port}"

    def up_and_serving() -> bool:
        for process in processes:
            assert process.popen.poll() is None, process.log()
        return serving(target)

    try:
        wait_until(up_and_serving, "the gateway serves", timeout_s=120, interval_s=0.2)
        # The engine pods' exec probe passes (the engine cores and workers run here).
        probe = container(docs, "StatefulSet", "engine")["livenessProbe"]["exec"]["command"]
        assert probe[0] == "python"
        subprocess.run([sys.executable, *probe[1:]], check=True, timeout=30)
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            request = greedy_request("Hello", 4, final_only=True)
            (final,) = list(stub.Generate(request, timeout=60))
        assert final.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert final.metrics.engine_id.startswith("EngineCore_DP")
    finally:
        codes = [process.stop() for process in reversed(processes)]
        shutil.rmtree(run_base, ignore_errors=True)
    assert codes == [0] * len(processes), "\n".join(p.log() for p in processes)
    # Every socket between them ran CURVE: the binding sides admitted the rendered keys.
    logs = {p.log_path.stem: p.log_path.read_text(errors="replace") for p in processes}
    assert "CURVE on: admitting 2 client key(s)" in logs["gateway"]
    assert "CURVE on: admitting 3 client key(s)" in logs["coordinator"]  # 2 engines, 1 gateway
    assert not any("without CURVE keys" in log or "CURVE: refused" in log for log in logs.values())
