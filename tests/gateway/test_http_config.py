"""`--http-port` on serve and gateway, and the port each gateway of a machine binds."""

from __future__ import annotations

import msgspec
import pytest

from switchboard import cli
from switchboard.cli import serve
from switchboard.config import GatewayConfig, GatewayRoleConfig, ModelConfig
from switchboard.gateway.http.aiohttp_server import http_port


def _gateway_config(*flags: str) -> GatewayConfig:
    args = cli.make_parser().parse_args(["serve", "--model", "/m", *flags])
    gateway, _ = serve.build_configs(args, "/m")
    return gateway.gateway


def test_http_port_flag() -> None:
    assert _gateway_config().http_port == 8000  # as vLLM
    assert _gateway_config("--http-port", "0").http_port == 0
    assert _gateway_config("--http-port", "-1").http_port is None
    with pytest.raises(SystemExit):
        _gateway_config("--http-port", "-2")
    assert GatewayConfig().http_port is None  # a config built in code serves no HTTP


def test_gateways_of_one_machine_offset_the_port_like_metrics() -> None:
    config = GatewayRoleConfig(model=ModelConfig(model="/m"), gateway=GatewayConfig(http_port=8000))
    second = msgspec.structs.replace(config, client_index=1)
    assert (http_port(config), http_port(second)) == (8000, 8001)
    alone = msgspec.structs.replace(config, client_index=7, handshake_address="tcp://h:1")
    assert http_port(alone) == 8000  # `switchboard gateway`: its pod has the port to itself
    free = msgspec.structs.replace(second, gateway=GatewayConfig(http_port=0))
    assert http_port(free) == 0
    off = msgspec.structs.replace(config, gateway=GatewayConfig())
    assert http_port(off) is None


def test_ports_that_two_gateways_would_both_bind_are_refused_before_start(capsys) -> None:
    """Gateway i binds --http-port + i and --metrics-port + i: with two gateways, 8000 and 8001
    would give gateway 1's HTTP port to gateway 0's metrics, so serve refuses them at once."""
    parser = cli.make_parser()

    def check(*flags: str) -> None:
        args = parser.parse_args(["serve", "--model", "/m", *flags])
        gateway, engine = serve.build_configs(args, "/m")
        serve.check_gateway_ports(parser, gateway, engine)

    check("--http-port", "8000", "--metrics-port", "8001")  # one gateway: no clash
    check("-dp", "2", "--http-port", "8000", "--metrics-port", "8002")
    check("-dp", "2", "--http-port", "0", "--metrics-port", "0")  # ephemeral ports
    check("-dp", "2", "--http-port", "-1", "--metrics-port", "8000", "--port", "8002")
    for clashing in (
        ("-dp", "2", "--http-port", "8000", "--metrics-port", "8001"),
        ("--api-servers", "3", "--http-port", "8002", "--metrics-port", "8000"),
        ("--port", "8001", "-dp", "2", "--http-port", "8000"),
        ("--port", "9000", "--metrics-port", "9000"),
    ):
        with pytest.raises(SystemExit):
            check(*clashing)
        assert "overlap: gateway i serves HTTP on --http-port + i" in capsys.readouterr().err
