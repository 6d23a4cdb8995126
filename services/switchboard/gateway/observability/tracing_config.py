"""Whether and where to export traces: ``--otlp-traces-*`` flags first, then ``OTEL_*`` variables.

Kept apart from ``tracing`` so that deciding "off" imports nothing of OpenTelemetry.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from switchboard.config import GatewayConfig

PROTOCOLS = ("grpc", "http/protobuf")


@dataclasses.dataclass(frozen=True)
class TracingSettings:
    endpoint: str | None  # None: the exporter reads the OTEL_* endpoint variables itself
    protocol: str
    trace_content: bool


def tracing_settings(
    gateway: GatewayConfig, environ: Mapping[str, str] = os.environ
) -> TracingSettings | None:
    """What to export where, or None when tracing is off. ValueError for an unknown protocol."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    endpoint = gateway.otlp_traces_endpoint or None
    from_env = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint is None and not from_env:
        return None
    protocol = (
        gateway.otlp_traces_protocol
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP traces protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}")
    return TracingSettings(endpoint, protocol, gateway.trace_content)
