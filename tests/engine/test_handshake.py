"""Gateway discovery of an engine on another host: resolve, hello, connect; restarts and leaves."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from switchboard.engine.handshake import (
    GatewayDiscovery,
    GatewayEndpoint,
    resolve_addresses,
    split_host_port,
    tcp_address,
)
from switchboard.gateway.engines.handshake_server import HandshakeServer
from switchboard.wire.engine_msgs import GatewayAddresses, GatewayHello


def test_split_host_port_and_tcp_address() -> None:
    assert split_host_port("gateways.ns.svc:50052") == ("gateways.ns.svc", 50052)
    assert split_host_port("[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError):
        split_host_port("no-port")
    assert tcp_address("::1", 7) == "tcp://[::1]:7"
    assert tcp_address("10.0.0.1", 7) == "tcp://10.0.0.1:7"


def test_hosts_file_comes_before_dns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 gateways  # two pods\n127.0.0.1 other gateways\n")
    monkeypatch.setenv("SWITCHBOARD_HOSTS_FILE", str(hosts))
    assert resolve_addresses("gateways") == ["127.0.0.1", "127.0.0.2"]
    assert resolve_addresses("localhost") == ["127.0.0.1"]  # not in the file: DNS
    assert resolve_addresses("no-such-name.invalid") == []


PORT_FREE_WAIT_S = 5.0


class FakeGateways:
    """Handshake servers (the real gateway class) on 127.0.0.x, on an asyncio thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ctx = zmq.asyncio.Context()
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, host: str, gateway_id: str, client_index: int) -> None:
        async def start() -> None:
            answer = GatewayAddresses(gateway_id, client_index, 1000 + client_index, 2000)
            # A socket closes in the background: right after stop() its port may still be taken.
            deadline = time.monotonic() + PORT_FREE_WAIT_S
            while True:
                try:
                    server = HandshakeServer(self.ctx, f"tcp://{host}:{self.port}", answer)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        raise
                await asyncio.sleep(0.05)
            self.tasks[host] = asyncio.create_task(server.run())

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def stop(self, host: str) -> None:
        async def stop() -> None:
            task = self.tasks.pop(host)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)

    def close(self) -> None:
        for host in list(self.tasks):
            self.stop(host)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.ctx.term()


@pytest.fixture
def gateways() -> Iterator[FakeGateways]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = FakeGateways(port)
    yield fake
    fake.close()


def test_discovery_follows_the_name(
    gateways: FakeGateways, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 gws\n")
    monkeypatch.setenv("SWITCHBOARD_HOSTS_FILE", str(hosts))
    added: list[GatewayEndpoint] = []
    removed: list[GatewayEndpoint] = []
    ctx = zmq.Context()
    discovery = GatewayDiscovery(
        ctx,
        f"gws:{gateways.port}",
        GatewayHello(0, "engine-0"),
        added.append,
        removed.append,
        hello_timeout_s=1.5,  # a loaded machine may take a while to answer
    )
    try:
        discovery.discover_once()  # nobody listens yet
        assert added == []
        gateways.start("127.0.0.1", "gw-a", 7)
        discovery.discover_once()
        assert added == [
            GatewayEndpoint(
                "127.0.0.1", "gw-a", 7, "tcp://127.0.0.1:1007", "tcp://127.0.0.1:2000", ""
            )
        ]
        discovery.discover_once()  # same gateway again: nothing new
        assert len(added) == 1

        hosts.write_text("127.0.0.1 gws\n127.0.0.2 gws\n")  # a second gateway pod appears
        gateways.start("127.0.0.2", "gw-b", 8)
        discovery.discover_once()
        assert [e.gateway_id for e in added] == ["gw-a", "gw-b"]
        assert added[1].input_address == "tcp://127.0.0.2:1008"

        gateways.stop("127.0.0.1")  # gw-a restarts with a new identity and index
        gateways.start("127.0.0.1", "gw-a2", 9)
        discovery.discover_once()
        assert [e.gateway_id for e in removed] == ["gw-a"]
        assert added[-1].gateway_id == "gw-a2" and added[-1].client_index == 9

        hosts.write_text("127.0.0.1 gws\n")  # gw-b's pod left the Service
        discovery.discover_once()
        assert removed[-1].gateway_id == "gw-b"
        assert {e.gateway_id for e in discovery.endpoints} == {"gw-a2"}

        gateways.stop("127.0.0.1")  # silent: dropped after two missed hellos
        discovery.discover_once()
        assert len(removed) == 2
        discovery.discover_once()
        assert removed[-1].gateway_id == "gw-a2" and discovery.endpoints == []
    finally:
        ctx.term()
