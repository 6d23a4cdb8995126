"""``python -m switchboard.cli.probe``: ask a gateway's gRPC health service from its own host, over
TLS when it serves TLS (the chart's exec probes: the kubelet's native gRPC probe has no TLS).
Exit 0 when the service is SERVING, 1 otherwise (the answer, or why none came, on stderr)."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchboard.common.tls import probe_channel
from switchboard.config import GatewayConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchboard.cli.probe", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", default="", help='"" = the process; or a service name')
    parser.add_argument("--timeout", type=float, default=4.0)
    parser.add_argument("--ssl-certfile", default="")
    parser.add_argument("--ssl-keyfile", default="")
    parser.add_argument("--ssl-ca-certs", default="")
    args = parser.parse_args(argv)
    gateway = GatewayConfig(
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs
    )
    target = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
    request = health_pb2.HealthCheckRequest(service=args.service)
    try:
        with probe_channel(gateway, target) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
    except grpc.RpcError as error:
        print(f"{target}: {error.code()}: {error.details()}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    print(f"{target} {args.service or '(process)'}: {name}", file=sys.stderr)
    return 0 if status.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
