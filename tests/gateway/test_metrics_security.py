"""/metrics on a secured gateway: HTTPS only when the fronts have TLS (mTLS too), and with a
metrics token a scrape without it gets 401. In-process gateway over real sockets."""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gateway_harness import WAIT_S, gateway_config
from gateway_scripted_engine import ScriptedEngine
from tls_certs import Certs, make_certs

from switchboard import cli
from switchboard.cli import serve
from switchboard.config import METRICS_TOKEN_ENV, GatewayConfig, GatewayRoleConfig, ModelConfig
from switchboard.gateway.auth import Credentials
from switchboard.gateway.grpc_server import GatewayServer
from switchboard.supervisor.ready_report import server_addresses

TOKEN = "scrape-token-0123456789"
API_KEY = "api-key-0123456789"

StartGateway = Callable[..., Awaitable[GatewayServer]]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def start(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[StartGateway]:
    started: list[tuple[GatewayServer, ScriptedEngine]] = []

    async def start_gateway(credentials: Credentials, **gateway_fields: Any) -> GatewayServer:
        gateway = GatewayConfig(host="127.0.0.1", port=0, metrics_port=0, **gateway_fields)
        config = gateway_config(checkpoint_dir, run_dir, gateway=gateway)
        server = GatewayServer(config, credentials)
        await server.start()
        engine = ScriptedEngine(config.input_address, config.output_address, [5, 6, 7])
        started.append((server, engine))
        await engine.start()
        assert await server.engines.wait_until_ready(WAIT_S)
        return server

    yield start_gateway
    for server, engine in started:
        with contextlib.suppress(Exception):
            await engine.close()
        await server.stop()


def metrics_url(server: GatewayServer, scheme: str) -> str:
    metrics = server.state.observability.metrics
    assert metrics is not None and metrics.port
    return f"{scheme}://127.0.0.1:{metrics.port}/metrics"


async def scrape(url: str, token: str | None = None, **kwargs: Any) -> tuple[int, str, Any]:
    """(status, body, headers) of one GET."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url, headers=headers, **kwargs) as response:
            return response.status, await response.text(), response.headers


def client_ssl(certs: Certs, client_certificate: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client_certificate:
        context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    return context


def tls_fields(certs: Certs, mtls: bool = False) -> dict[str, str]:
    fields = {"ssl_certfile": str(certs.server_cert), "ssl_keyfile": str(certs.server_key)}
    if mtls:
        fields["ssl_ca_certs"] = str(certs.ca)
    return fields


async def test_metrics_are_https_only_when_the_fronts_have_tls(
    start: StartGateway, certs: Certs
) -> None:
    server = await start(Credentials(), **tls_fields(certs))
    status, text, _ = await scrape(metrics_url(server, "https"), ssl=client_ssl(certs))
    assert status == 200 and "switchboard:num_requests_running" in text
    with pytest.raises(aiohttp.ClientError):  # plaintext to the TLS port: no answer
        await scrape(metrics_url(server, "http"))
    with pytest.raises(aiohttp.ClientConnectorCertificateError):  # the server is not trusted
        await scrape(metrics_url(server, "https"))
    # The port still serves after refusing those.
    status, _, _ = await scrape(metrics_url(server, "https"), ssl=client_ssl(certs))
    assert status == 200


async def test_metrics_under_mtls_need_a_client_certificate(
    start: StartGateway, certs: Certs
) -> None:
    server = await start(Credentials(metrics_token=TOKEN), **tls_fields(certs, mtls=True))
    url = metrics_url(server, "https")
    with pytest.raises(aiohttp.ClientError):
        await scrape(url, TOKEN, ssl=client_ssl(certs))
    status, text, _ = await scrape(url, TOKEN, ssl=client_ssl(certs, client_certificate=True))
    assert status == 200 and "switchboard:" in text
    status, _, _ = await scrape(url, ssl=client_ssl(certs, client_certificate=True))
    assert status == 401  # the certificate does not replace the token


async def test_a_metrics_token_is_required_when_set(
    start: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start(Credentials(api_keys=(API_KEY,), metrics_token=TOKEN))
    url = metrics_url(server, "http")
    caplog.set_level(logging.DEBUG, logger="switchboard.gateway.auth")
    for token in (None, "nope", API_KEY):  # an API key opens the data plane, not /metrics
        status, text, headers = await scrape(url, token)
        assert status == 401, token
        assert headers["WWW-Authenticate"] == "Bearer"
        assert "switchboard:" not in text and "metrics token" in text
    status, text, _ = await scrape(url, TOKEN)
    assert status == 200 and "switchboard:num_requests_running" in text
    refusals = [r for r in caplog.records if r.name == "switchboard.gateway.auth"]
    assert [r.levelname for r in refusals] == ["DEBUG", "WARNING", "WARNING"]
    assert "refused /metrics from 127.0.0.1: invalid metrics token" in refusals[1].getMessage()


async def test_without_a_token_metrics_stay_open(start: StartGateway) -> None:
    server = await start(Credentials(api_keys=(API_KEY,)))
    status, text, _ = await scrape(metrics_url(server, "http"))
    assert status == 200 and "switchboard:" in text


def test_the_metrics_token_reaches_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """From --metrics-token (through the environment, never a config) or from a file."""
    parser = cli.make_parser()
    monkeypatch.setenv(METRICS_TOKEN_ENV, "")

    def error_of(*flags: str) -> str:
        args = parser.parse_args(["gateway", *flags])
        with pytest.raises(SystemExit):
            serve.apply_security_args(parser, args)
        return capsys.readouterr().err

    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    both = ("--metrics-port", "9100", "--metrics-token", "t", "--metrics-token-file")
    assert "give one" in error_of(*both, str(token_file))
    assert "need --metrics-port" in error_of("--metrics-token", "t")
    assert "no such file" in error_of("--metrics-token-file", str(tmp_path / "absent"))
    assert "must not be empty" in error_of("--metrics-port", "9100", "--metrics-token", " ")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    from_empty = ("--metrics-port", "9100", "--metrics-token-file", str(empty))
    assert "want one token" in error_of(*from_empty)

    args = parser.parse_args(["gateway", "--metrics-port", "9100", "--metrics-token", TOKEN])
    serve.apply_security_args(parser, args)
    gateway = serve.build(GatewayConfig, args)
    assert TOKEN not in str(gateway)  # the config travels on command lines: no token in it
    assert os.environ[METRICS_TOKEN_ENV] == TOKEN
    assert Credentials.load(gateway).metrics_token == TOKEN
    from_file = GatewayConfig(metrics_port=9100, metrics_token_file=str(token_file))
    assert Credentials.load(from_file, {}).metrics_token == TOKEN


def test_the_ready_line_names_https_metrics_under_tls(certs: Certs) -> None:
    gateway = GatewayConfig(host="127.0.0.1", port=1, metrics_port=9100, **tls_fields(certs))
    config = GatewayRoleConfig(model=ModelConfig(model="/m"), gateway=gateway)
    assert server_addresses([config]) == [
        ("gRPC", "127.0.0.1:1"),
        ("metrics", "https://127.0.0.1:9100/metrics"),
    ]
