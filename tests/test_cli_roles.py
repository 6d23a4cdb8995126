"""`switchboard gateway` / `switchboard engine`: the configs the one-role commands run with."""

from __future__ import annotations

import pytest

import switchboard.coordinator.__main__ as coordinator_main
import switchboard.engine.__main__ as engine_main
import switchboard.gateway.__main__ as gateway_main
from switchboard import cli
from switchboard.cli import role_commands
from switchboard.config import (
    CoordinatorConfig,
    EngineConfig,
    GatewayRoleConfig,
    decode_config,
)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    calls: dict[str, list[str]] = {}
    monkeypatch.setattr(gateway_main, "main", lambda argv: calls.setdefault("gateway", argv) and 0)
    monkeypatch.setattr(engine_main, "main", lambda argv: calls.setdefault("engine", argv) and 0)
    monkeypatch.setattr(
        coordinator_main, "main", lambda argv: calls.setdefault("coordinator", argv) and 0
    )
    monkeypatch.setattr("switchboard.checkpoint.resolve_model", lambda model: model)
    return calls


def test_gateway_command_config(captured: dict[str, list[str]]) -> None:
    cli.main(["gateway", "--model", "/m", "--port", "7000", "--engine-host", "10.0.0.5",
              "--handshake-port", "7001", "--client-index", "4", "-dp", "3",
              "--engine-heartbeat-timeout", "2.5"])  # fmt: skip
    config = decode_config(captured["gateway"][1], GatewayRoleConfig)
    assert config.client_index == 4 and config.num_engines == 3
    assert config.handshake_address == "tcp://10.0.0.5:7001"
    assert config.input_address == config.output_address == "tcp://10.0.0.5:0"
    assert not config.exit_when_engines_dead and config.heartbeat_timeout_s == 2.5
    assert config.gateway.port == 7000


def test_gateway_client_index_defaults_to_random(captured: dict[str, list[str]]) -> None:
    cli.main(["gateway", "--model", "/m", "--engine-host", "::"])
    config = decode_config(captured["gateway"][1], GatewayRoleConfig)
    assert 0 <= config.client_index < 2**31
    assert config.handshake_address == f"tcp://[::]:{role_commands.DEFAULT_HANDSHAKE_PORT}"


def test_engine_command_config(
    captured: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(role_commands.socket, "gethostname", lambda: "sb-engine-3")
    cli.main(["engine", "--model", "/m", "--gateway-address", "gw.ns.svc:7001", "-tp", "2",
              "--discovery-interval", "1.5"])  # fmt: skip
    config = decode_config(captured["engine"][1], EngineConfig)
    assert config.data_parallel_rank == 3  # the StatefulSet ordinal
    assert config.gateway_discovery == "gw.ns.svc:7001" and config.discovery_interval_s == 1.5
    assert config.parallel.tensor_parallel_size == 2
    assert config.gateway_input_addresses == []


def test_engine_command_refuses_a_bad_address(captured: dict[str, list[str]]) -> None:
    with pytest.raises(ValueError, match="NAME:PORT"):
        cli.main(["engine", "--model", "/m", "--gateway-address", "no-port"])


def test_without_a_coordinator_address_no_coordinator_is_used(
    captured: dict[str, list[str]],
) -> None:
    cli.main(["gateway", "--model", "/m"])
    cli.main(["engine", "--model", "/m", "--gateway-address", "gw:7001"])
    assert (
        decode_config(captured["gateway"][1], GatewayRoleConfig).coordinator_publish_address == ""
    )
    assert decode_config(captured["engine"][1], EngineConfig).coordinator_address == ""


def test_coordinator_command_binds_its_two_fixed_ports(captured: dict[str, list[str]]) -> None:
    cli.main(["coordinator", "--host", "10.0.0.9", "--load-port", "7100", "-dp", "4"])
    config = decode_config(captured["coordinator"][1], CoordinatorConfig)
    assert config.input_address == "tcp://10.0.0.9:7100"
    assert (
        config.publish_address == f"tcp://10.0.0.9:{role_commands.DEFAULT_COORDINATOR_REPORT_PORT}"
    )
    assert config.num_engines == 4


def test_engines_push_to_the_load_port_and_gateways_subscribe_to_the_report_port(
    captured: dict[str, list[str]],
) -> None:
    cli.main(["engine", "--model", "/m", "--gateway-address", "gw:7001",
              "--coordinator-address", "sb-coordinator.ns.svc"])  # fmt: skip
    cli.main(["gateway", "--model", "/m", "--coordinator-address", "[fd00::7]:7200"])
    engine = decode_config(captured["engine"][1], EngineConfig)
    gateway = decode_config(captured["gateway"][1], GatewayRoleConfig)
    load_port = role_commands.DEFAULT_COORDINATOR_LOAD_PORT
    assert engine.coordinator_address == f"tcp://sb-coordinator.ns.svc:{load_port}"
    assert gateway.coordinator_publish_address == "tcp://[fd00::7]:7200"


@pytest.mark.parametrize(
    ("target", "address"),
    [
        ("coord", "tcp://coord:9"),
        ("coord:7", "tcp://coord:7"),
        ("10.1.2.3", "tcp://10.1.2.3:9"),
        ("::1", "tcp://[::1]:9"),
        ("[::1]", "tcp://[::1]:9"),
        ("[::1]:7", "tcp://[::1]:7"),
    ],
)
def test_coordinator_addresses(target: str, address: str) -> None:
    assert role_commands.coordinator_tcp_address(target, 9) == address


@pytest.mark.parametrize("target", ["coord:port", ":7", "[]:7"])
def test_bad_coordinator_addresses_are_refused(target: str) -> None:
    with pytest.raises(ValueError, match="NAME\\[:PORT\\]"):
        role_commands.coordinator_tcp_address(target, 9)
