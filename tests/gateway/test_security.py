"""TLS, mTLS and keys on the gateway's fronts (common/tls.py, gateway/auth.py), in-process
over real gRPC and HTTP with a scripted engine and certificates made for the test."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from gateway_harness import WAIT_S, gateway_config, until
from gateway_scripted_engine import ScriptedEngine
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tls_certs import Certs, make_certs

from switchboard import cli
from switchboard.api.v1 import admin_service_pb2 as admin_pb
from switchboard.api.v1 import admin_service_pb2_grpc as admin_grpc
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from switchboard.cli import probe, serve
from switchboard.config import API_KEYS_ENV, GatewayConfig
from switchboard.gateway.api_errors import status_details
from switchboard.gateway.auth import Credentials, bearer_token, identity_of
from switchboard.gateway.grpc_server import GENERATION_SERVICE, GatewayServer
from switchboard.supervisor import launcher

KEY_A, KEY_B, ADMIN = "key-a-0123456789", "key-b-9876543210", "admin-secret-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


class Gateway:
    def __init__(self, server: GatewayServer, engine: ScriptedEngine) -> None:
        self.server, self.engine = server, engine
        self.target = f"127.0.0.1:{server.port}"
        self.url = f"127.0.0.1:{server.http_port}"


StartGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def start(checkpoint_dir: Path, run_dir: str) -> AsyncIterator[StartGateway]:
    started: list[Gateway] = []

    async def start_gateway(
        credentials: Credentials | None = None, **gateway_fields: Any
    ) -> Gateway:
        gateway = GatewayConfig(host="127.0.0.1", port=0, http_port=0, enable_admin=True,
                                **gateway_fields)  # fmt: skip
        config = gateway_config(checkpoint_dir, run_dir, gateway=gateway)
        server = GatewayServer(config, credentials or Credentials())
        await server.start()
        engine = ScriptedEngine(config.input_address, config.output_address, [5, 6, 7])
        started.append(Gateway(server, engine))
        await engine.start()
        assert await server.engines.wait_until_ready(WAIT_S)
        await until(lambda: server.ready, "ready")
        return started[-1]

    yield start_gateway
    for gw in started:
        with contextlib.suppress(Exception):
            await gw.engine.close()
        await gw.server.stop()


def _request(max_tokens: int = 3, **fields: Any) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text="Hello", **fields)
    request.stopping.max_tokens = max_tokens
    return request


async def _generate(channel: grpc.aio.Channel, **kwargs: Any) -> list[pb.GenerateResponse]:
    stub = pb_grpc.GenerationServiceStub(channel)
    return [r async for r in stub.Generate(_request(), timeout=WAIT_S, **kwargs)]


def _tls(certs: Certs, client: bool) -> grpc.ChannelCredentials:
    if not client:
        return grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes(),
        certificate_chain=certs.client_cert.read_bytes(),
    )


def _tls_fields(certs: Certs, mtls: bool) -> dict[str, str]:
    fields = {"ssl_certfile": str(certs.server_cert), "ssl_keyfile": str(certs.server_key)}
    if mtls:
        fields["ssl_ca_certs"] = str(certs.ca)
    return fields


def _client_ssl(certs: Certs, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


async def _http_get(url: str, **kwargs: Any) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url, **kwargs) as response:
            return response.status, await response.json(content_type=None)


# --- TLS and mTLS -----------------------------------------------------------------------------


async def test_tls_grpc_and_http(start: StartGateway, certs: Certs) -> None:
    gw = await start(**_tls_fields(certs, mtls=False))
    async with grpc.aio.secure_channel(gw.target, _tls(certs, client=False)) as channel:
        assert len(await _generate(channel)) >= 1
    async with grpc.aio.insecure_channel(gw.target) as channel:  # plaintext to a TLS port
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _generate(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    status, body = await _http_get(f"https://{gw.url}/v1/models", ssl=_client_ssl(certs))
    assert status == 200 and body["data"][0]["id"] == "tiny"
    with pytest.raises(aiohttp.ClientError):  # plaintext HTTP to the TLS port
        await _http_get(f"http://{gw.url}/v1/models")
    with pytest.raises(aiohttp.ClientConnectorCertificateError):  # no CA: untrusted
        await _http_get(f"https://{gw.url}/v1/models")


async def test_mtls_requires_a_client_certificate(start: StartGateway, certs: Certs) -> None:
    gw = await start(**_tls_fields(certs, mtls=True))
    async with grpc.aio.secure_channel(gw.target, _tls(certs, client=True)) as channel:
        assert len(await _generate(channel)) >= 1
    async with grpc.aio.secure_channel(gw.target, _tls(certs, client=False)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _generate(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    stranger = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.stranger_key.read_bytes(),
        certificate_chain=certs.stranger_cert.read_bytes(),
    )
    async with grpc.aio.secure_channel(gw.target, stranger) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await _generate(channel)
    models = f"https://{gw.url}/v1/models"
    status, _ = await _http_get(models, ssl=_client_ssl(certs, certs.client_cert, certs.client_key))
    assert status == 200
    for context in (
        _client_ssl(certs),
        _client_ssl(certs, certs.stranger_cert, certs.stranger_key),
    ):
        with pytest.raises(aiohttp.ClientError):
            await _http_get(models, ssl=context)


async def test_openai_client_over_tls(start: StartGateway, certs: Certs) -> None:
    openai = pytest.importorskip("openai")
    gw = await start(**_tls_fields(certs, mtls=False), credentials=Credentials((KEY_A,)))
    async with openai.DefaultAsyncHttpx2Client(verify=_client_ssl(certs)) as http_client:
        client = openai.AsyncOpenAI(
            base_url=f"https://{gw.url}/v1", api_key=KEY_A, http_client=http_client
        )
        reply = await client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert reply.choices[0].finish_reason == "length"
        bad = openai.AsyncOpenAI(
            base_url=f"https://{gw.url}/v1", api_key="wrong", http_client=http_client,
            max_retries=0,
        )  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()


@pytest.mark.parametrize("mtls", [False, True])
async def test_launcher_probe_speaks_tls(start: StartGateway, certs: Certs, mtls: bool) -> None:
    gw = await start(**_tls_fields(certs, mtls=mtls), credentials=Credentials((KEY_A,)))
    config = gw.server.config
    config = type(config)(
        model=config.model,
        gateway=GatewayConfig(host="0.0.0.0", port=gw.server.port, **_tls_fields(certs, mtls)),
    )
    status = await asyncio.to_thread(_probe, config)
    assert status == health_pb2.HealthCheckResponse.SERVING


async def test_probe_checks_the_certificates_own_name(start: StartGateway, certs: Certs) -> None:
    """A certificate for a Service name (not 127.0.0.1) still passes the probe from the pod,
    also as ``python -m switchboard.cli.probe`` (the chart's exec probe)."""
    fields = {"ssl_certfile": str(certs.elsewhere_cert), "ssl_keyfile": str(certs.elsewhere_key)}
    gw = await start(**fields)
    config = gw.server.config
    config = type(config)(
        model=config.model,
        gateway=GatewayConfig(host="127.0.0.1", port=gw.server.port, **fields),
    )
    assert await asyncio.to_thread(_probe, config) == health_pb2.HealthCheckResponse.SERVING
    port = ["--port", str(gw.server.port)]
    tls = ["--ssl-certfile", fields["ssl_certfile"], "--ssl-keyfile", fields["ssl_keyfile"]]
    ready = ["--service", GENERATION_SERVICE]
    assert await asyncio.to_thread(probe.main, [*port, *ready, *tls]) == 0
    assert await asyncio.to_thread(probe.main, [*port, *tls]) == 0  # "" = the process
    assert await asyncio.to_thread(probe.main, [*port, *ready]) == 1  # plaintext to TLS


async def test_launcher_probe_gives_up_on_a_failed_handshake(
    start: StartGateway, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    """Under mTLS the probe shows the server's certificate as its own; one made for server use
    only is refused, and the probe says so (no ready line) instead of retrying for ever."""
    fields = {"ssl_certfile": str(certs.elsewhere_cert), "ssl_keyfile": str(certs.elsewhere_key),
              "ssl_ca_certs": str(certs.ca)}  # fmt: skip
    gw = await start(**fields)
    config = gw.server.config
    config = type(config)(
        model=config.model,
        gateway=GatewayConfig(host="127.0.0.1", port=gw.server.port, **fields),
    )
    with pytest.raises(grpc.RpcError) as failed:
        await asyncio.to_thread(_probe, config)
    assert launcher.tls_handshake_failed(failed.value), failed.value.details()
    # The supervisor gives up on it and logs why, instead of polling until the server stops.
    supervisor = launcher.Supervisor([config], [], run_dir="")
    with caplog.at_level(logging.WARNING, logger="switchboard.supervisor.launcher"):
        await asyncio.wait_for(asyncio.to_thread(supervisor._announce_ready), WAIT_S)
    assert "cannot verify" in caplog.text or "TLS handshake" in caplog.text


def _probe(config: Any) -> int:
    with launcher.probe_channel(config) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=GENERATION_SERVICE)
        return stub.Check(request, timeout=WAIT_S).status


# --- API keys and the admin token -----------------------------------------------------------


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _reason(error: grpc.aio.AioRpcError) -> str:
    details = status_details(error)
    assert details is not None
    info = error_details_pb2.ErrorInfo()
    assert details.details[0].Unpack(info)
    return info.reason


async def test_api_keys_on_grpc(start: StartGateway) -> None:
    gw = await start(credentials=Credentials((KEY_A, KEY_B), ADMIN))
    async with grpc.aio.insecure_channel(gw.target) as channel:
        for metadata in ((), _bearer("nope"), (("authorization", KEY_A),), _bearer(ADMIN)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _generate(channel, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _reason(refused.value) == "INVALID_API_KEY"
        for key in (KEY_A, KEY_B):
            assert len(await _generate(channel, metadata=_bearer(key))) >= 1
        models = model_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await models.ListModels(model_pb.ListModelsRequest(), timeout=WAIT_S)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = await models.ListModels(
            model_pb.ListModelsRequest(), timeout=WAIT_S, metadata=_bearer(KEY_B)
        )
        assert listed.models[0].name == "tiny" or listed.models
        # Probes and discovery stay open.
        health = health_pb2_grpc.HealthStub(channel)
        checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
        assert checked.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=WAIT_S
        )
        async for answer in answers:
            assert answer.list_services_response.service
            break


async def test_admin_token_is_separate(start: StartGateway) -> None:
    gw = await start(credentials=Credentials((KEY_A,), ADMIN))
    async with grpc.aio.insecure_channel(gw.target) as channel:
        admin = admin_grpc.AdminServiceStub(channel)
        request = admin_pb.UtilityRequest(method="reset_prefix_cache")
        for metadata in ((), _bearer(KEY_A), _bearer("nope")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin.Utility(request, timeout=WAIT_S, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _reason(refused.value) == "INVALID_ADMIN_TOKEN"
        reply = await admin.Utility(request, timeout=WAIT_S, metadata=_bearer(ADMIN))
        assert [r.engine_id for r in reply.results] == [gw.engine.engine_id]


async def test_api_keys_on_http(start: StartGateway) -> None:
    gw = await start(credentials=Credentials((KEY_A,)))
    base = f"http://{gw.url}"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY_A}):
        status, body = await _http_get(f"{base}/v1/models", headers=headers)
        assert status == 401
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "invalid_request_error"
        assert set(body["error"]) == {"message", "type", "param", "code"}
    status, _ = await _http_get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})
    assert status == 200
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        async with session.post(f"{base}/v1/completions", json=body) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"] == "Bearer"
    for path in ("/health", "/ready"):  # probes carry no key
        status, _ = await _http_get(f"{base}{path}")
        assert status == 200


async def test_abort_reaches_only_the_same_keys_requests(start: StartGateway) -> None:
    gw = await start(credentials=Credentials((KEY_A, KEY_B)))
    gw.engine.mode = "hang"  # the request stays in flight until aborted
    async with grpc.aio.insecure_channel(gw.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        call = stub.Generate(_request(request_id="mine"), metadata=_bearer(KEY_A), timeout=WAIT_S)
        await until(lambda: gw.server._calls.is_in_flight("mine"), "in flight")
        abort = pb.AbortRequest(request_ids=["mine"])
        other = await stub.Abort(abort, metadata=_bearer(KEY_B), timeout=WAIT_S)
        assert list(other.unknown_request_ids) == ["mine"] and not other.aborted_request_ids
        assert gw.engine.aborted == []
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Abort(abort, timeout=WAIT_S)  # no key at all
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        own = await stub.Abort(abort, metadata=_bearer(KEY_A), timeout=WAIT_S)
        assert list(own.aborted_request_ids) == ["mine"]
        await until(lambda: len(gw.engine.aborted) == 1, "ABORT reached the engine")
        call.cancel()


def test_credentials_parsing(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("\n  one  \n\ntwo\n")
    gateway = GatewayConfig(api_key_file=str(keys))
    loaded = Credentials.load(gateway, {API_KEYS_ENV: "zero\none", "SWITCHBOARD_ADMIN_TOKEN": "t"})
    assert loaded.api_keys == ("zero", "one", "two") and loaded.admin_token == "t"
    assert loaded.key_matches("two") and not loaded.key_matches("tw") and loaded.admin_matches("t")
    assert identity_of("one") != identity_of("two") and "one" not in identity_of("one")
    assert bearer_token([("authorization", "bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    keys.write_text("\n\n")
    with pytest.raises(ValueError, match="no key"):
        Credentials.load(gateway, {})


def test_cli_checks_security_flags(
    tmp_path: Path, certs: Certs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    parser = cli.make_parser()

    def error_of(*flags: str) -> str:
        monkeypatch.setenv(API_KEYS_ENV, "")  # recorded, so undone after the test
        monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "")
        args = parser.parse_args(["gateway", *flags])
        with pytest.raises(SystemExit):
            serve.apply_security_args(parser, args)
        return capsys.readouterr().err

    assert "go together" in error_of("--ssl-certfile", str(certs.server_cert))
    assert "no such file" in error_of("--ssl-ca-certs", str(tmp_path / "absent"))
    assert "TLS" in error_of("--ssl-certfile", str(certs.server_cert), "--ssl-keyfile",
                             str(certs.client_key))  # fmt: skip
    assert "differ" in error_of("--api-key", "k", "--admin-token", "k")
    empty = tmp_path / "empty"
    empty.write_text("")
    assert "no key" in error_of("--api-key-file", str(empty))
    monkeypatch.setenv(API_KEYS_ENV, "")
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "")
    args = parser.parse_args(["gateway", "--api-key", "k1", "--api-key", "k2"])
    serve.apply_security_args(parser, args)
    import os

    assert os.environ[API_KEYS_ENV] == "k1\nk2"  # the children's environment, not a config
    engine = parser.parse_args(["engine", "--gateway-address", "gw:1"])
    assert not hasattr(engine, "api_key")
