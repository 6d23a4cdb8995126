"""`switchboard gateway`, `engine` and `coordinator` over TCP with CURVE keys (the Kubernetes
deployment, where the chart turns CURVE on by default): the real engine's client sockets
(handshake, DEALER, PUSH, load PUSH) and the gateway's coordinator SUB all authenticate, a
request is served, and an engine without keys is refused."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from switchboard.wire import curve
from tests.e2e.server import free_port
from tests.e2e.test_topologies import (
    SERVING,
    SMALL_KV,
    Role,
    generate,
    greedy,
    health,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_keyed_roles_serve_and_an_unkeyed_engine_is_refused(tiny_model: str, tmp_path: Path):
    keys = str(tmp_path / "keys")
    curve.generate(keys, engines=1)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 sb-gateways\n")
    run_base = tempfile.mkdtemp(prefix="sbcurve-")
    env = dict(os.environ, SWITCHBOARD_HOSTS_FILE=str(hosts),
               SWITCHBOARD_RPC_BASE_PATH=run_base, PYTHONUNBUFFERED="1")  # fmt: skip
    handshake, load, report, grpc_port = free_port(), free_port(), free_port(), free_port()
    target = f"127.0.0.1:{grpc_port}"
    coordinator = Role("coordinator", ["coordinator", "--host", "127.0.0.1", "--load-port",
                       str(load), "--report-port", str(report), "--curve-keys-dir", keys],
                       tmp_path, env)  # fmt: skip
    gateway = Role("gateway", ["gateway", "--model", tiny_model, "--host", "127.0.0.1",
                   "--port", str(grpc_port), "--engine-host", "127.0.0.1", "--handshake-port",
                   str(handshake), "--coordinator-address", f"127.0.0.1:{report}",
                   "--curve-keys-dir", keys, "--http-port", "-1"], tmp_path, env)  # fmt: skip
    roles = [coordinator, gateway]

    def engine(name: str, *extra: str) -> Role:
        args = ["engine", "--model", tiny_model, "--gateway-address",
                f"sb-gateways:{handshake}", "--discovery-interval", "0.5",
                "--data-parallel-rank", "0", "--coordinator-address", f"127.0.0.1:{load}",
                *SMALL_KV, *extra]  # fmt: skip
        return Role(name, args, tmp_path, env)

    try:
        # Without keys first: the gateway never answers its hellos (a NULL-mechanism peer
        # fails the CURVE handshake before ZAP is asked).
        unkeyed = engine("engine-unkeyed")
        roles.append(unkeyed)
        wait_for(lambda: "Discovering gateways" in unkeyed.log(), "the unkeyed engine runs")
        time.sleep(5)  # several discovery rounds
        assert health(target) != SERVING
        assert "Gateway Gateway_" not in unkeyed.log()  # it never met the gateway
        assert unkeyed.stop() == 0, unkeyed.log()
        roles.remove(unkeyed)

        roles.append(engine("engine-keyed", "--curve-keys-dir", keys))
        wait_for(lambda: health(target) == SERVING, "the keyed engine is admitted")
        assert generate(target, greedy()).outputs[0].finish_reason
        wait_for(lambda: "1 of 1 engines heard from" in coordinator.log(), "load over CURVE")
        wait_for(lambda: "load reports cover engine ranks [0]" in gateway.log(), "reports")
        for role in roles:
            assert "wire without CURVE keys" not in role.log(), role.log()
    finally:
        codes = [role.stop() for role in reversed(roles)]
        shutil.rmtree(run_base, ignore_errors=True)
    assert codes == [0] * len(roles), "\n".join(role.log()[-3000:] for role in roles)
