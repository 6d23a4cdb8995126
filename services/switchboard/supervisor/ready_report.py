"""What the supervisor tells an operator once the server is up, and how it reaches its own
gateway to find out: every address served, and how the engines run the model (the ready line).
"""

from __future__ import annotations

import grpc

from switchboard.api.v1 import model_service_pb2, model_service_pb2_grpc
from switchboard.common.tls import probe_channel as tls_probe_channel
from switchboard.common.tls import tls_enabled
from switchboard.config import EngineConfig, GatewayRoleConfig

MODEL_INFO_TRIES = 3  # the ready line's GetModelInfo, each waiting MODEL_INFO_TIMEOUT_S
MODEL_INFO_TIMEOUT_S = 10.0


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def server_addresses(gateways: list[GatewayRoleConfig]) -> list[tuple[str, str]]:
    """(what, address) for every endpoint of a one-machine server, in the order the ready line
    lists them."""
    first = gateways[0].gateway
    addresses = [("gRPC", _host_port(first.host, first.port))]
    if first.http_port:  # gateway i serves the OpenAI-compatible API on --http-port + i
        for cfg in gateways:
            port = first.http_port + cfg.client_index
            scheme = "https" if tls_enabled(first) else "http"
            addresses.append(("HTTP", f"{scheme}://{_host_port(first.host, port)}/v1"))
    if first.metrics_port:  # (0: ephemeral ports, which the gateways log themselves)
        for cfg in gateways:  # gateway i serves /metrics on --metrics-port + i
            port = first.metrics_port + cfg.client_index
            scheme = "https" if tls_enabled(first) else "http"
            addresses.append(("metrics", f"{scheme}://{_host_port(first.host, port)}/metrics"))
    return addresses


def ready_line(
    gateways: list[GatewayRoleConfig],
    engines: list[EngineConfig],
    took_s: float,
    runs_as: str = "",
) -> str:
    """``runs_as``: how the engines run the model (``served_as``), "" when unknown."""
    where = ", ".join(f"{what} {address}" for what, address in server_addresses(gateways))
    cores = len(engines)
    model = f"{gateways[0].model.name!r}" + (f" ({runs_as})" if runs_as else "")
    return (
        f"switchboard is ready to serve {model}: {where} "
        f"({cores} engine core{'s' if cores != 1 else ''}, ready in {took_s:.1f} s)"
    )


def served_as(channel: grpc.Channel) -> str:
    """What the engines resolved ``--dtype`` and ``--quantization`` to, from the gateway's
    GetModelInfo: ``dtype float32, quantization gguf Q4_1, Q8_0``; "" when it refuses (it
    wants an API key, say) or does not answer in ``MODEL_INFO_TRIES`` tries."""
    stub = model_service_pb2_grpc.ModelServiceStub(channel)  # type: ignore[no-untyped-call]
    for _ in range(MODEL_INFO_TRIES):
        try:
            info = stub.GetModelInfo(
                model_service_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S
            )
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                continue  # a busy machine: the gateway answers in a moment
            return ""
        return f"dtype {info.dtype or '?'}, quantization {info.quantization or '?'}"
    return ""


def _probe_target(gateway: GatewayRoleConfig) -> str:
    """Where the supervisor reaches its own gateway: a wildcard bind address is reached on
    loopback."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(
        gateway.gateway.host, gateway.gateway.host
    )
    return _host_port(host, gateway.gateway.port)


def probe_channel(gateway: GatewayRoleConfig) -> grpc.Channel:
    """The supervisor's channel to its own gateway (TLS when it serves TLS: ``tls.py``)."""
    return tls_probe_channel(gateway.gateway, _probe_target(gateway))
