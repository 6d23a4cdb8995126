"""`switchboard gateway` / `switchboard engine`: the configs the one-role commands run with."""

from __future__ import annotations

import pytest

import switchboard.engine.__main__ as engine_main
import switchboard.gateway.__main__ as gateway_main
from switchboard import cli, cli_roles
from switchboard.config import EngineConfig, GatewayRoleConfig, decode_config


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    calls: dict[str, list[str]] = {}
    monkeypatch.setattr(gateway_main, "main", lambda argv: calls.setdefault("gateway", argv) and 0)
    monkeypatch.setattr(engine_main, "main", lambda argv: calls.setdefault("engine", argv) and 0)
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
    assert config.handshake_address == f"tcp://[::]:{cli_roles.DEFAULT_HANDSHAKE_PORT}"


def test_engine_command_config(
    captured: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_roles.socket, "gethostname", lambda: "sb-engine-3")
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
