"""TLS and mTLS of the gateway's two fronts (gRPC, HTTP), from ``--ssl-certfile``,
``--ssl-keyfile`` and ``--ssl-ca-certs`` (``GatewayConfig.ssl_*``).

The files are read once when the gateway starts (no hot reload: restart to rotate). With a CA
bundle every client must present a certificate it signed (mTLS); without one any client that
trusts the server's certificate may connect. Shared by the gateway (server side) and the
launcher (its readiness probe of its own gateway, client side).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from switchboard.config import GatewayConfig


def tls_enabled(gateway: GatewayConfig) -> bool:
    return bool(gateway.ssl_certfile)


def check_tls_files(gateway: GatewayConfig) -> None:
    """ValueError naming what is wrong with the TLS flags (before anything binds)."""
    if bool(gateway.ssl_certfile) != bool(gateway.ssl_keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    if gateway.ssl_ca_certs and not gateway.ssl_certfile:
        raise ValueError("--ssl-ca-certs (client certificates) needs --ssl-certfile/--ssl-keyfile")
    if tls_enabled(gateway):
        server_ssl_context(gateway)  # parses the certificate, key and CA bundle


def grpc_server_credentials(gateway: GatewayConfig) -> grpc.ServerCredentials:
    key = Path(gateway.ssl_keyfile).read_bytes()
    chain = Path(gateway.ssl_certfile).read_bytes()
    ca = Path(gateway.ssl_ca_certs).read_bytes() if gateway.ssl_ca_certs else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=ca, require_client_auth=ca is not None
    )


def server_ssl_context(gateway: GatewayConfig) -> ssl.SSLContext:
    """The HTTP front's context: TLS 1.2+, client certificates required under a CA bundle."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(gateway.ssl_certfile, gateway.ssl_keyfile)
    if gateway.ssl_ca_certs:
        context.load_verify_locations(cafile=gateway.ssl_ca_certs)
        context.verify_mode = ssl.CERT_REQUIRED
    else:
        context.verify_mode = ssl.CERT_NONE
    return context


def probe_channel(gateway: GatewayConfig, target: str) -> grpc.Channel:
    """A channel from this host to a gateway's gRPC port, as its own probes use it (the
    launcher's ready line, ``python -m switchboard.cli.probe`` in the chart's pods): plaintext,
    or TLS trusting ``--ssl-ca-certs`` (else the server's own certificate file: a leaf is
    accepted as its own anchor) and, under mTLS, showing the server's certificate as the
    client's. The name checked is the certificate's own (its first DNS name when it does not
    name the probed address), so a certificate for a Service name passes on 127.0.0.1. Where
    the handshake still fails (under mTLS a certificate not made for client use) the caller
    says so: ``tls_handshake_failed``."""
    if not tls_enabled(gateway):
        return grpc.insecure_channel(target)
    trusted = gateway.ssl_ca_certs or gateway.ssl_certfile
    root = Path(trusted).read_bytes()
    if gateway.ssl_ca_certs:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=Path(gateway.ssl_keyfile).read_bytes(),
            certificate_chain=Path(gateway.ssl_certfile).read_bytes(),
        )
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=root)
    options = []
    name = _name_for(gateway.ssl_certfile, target)
    if name:
        options.append(("grpc.ssl_target_name_override", name))
    return grpc.secure_channel(target, credentials, options=options)


def _name_for(certfile: str, target: str) -> str:
    """The name to check the certificate against when it does not name ``target``'s host."""
    host = target.rsplit(":", 1)[0].strip("[]")
    try:
        decoded = ssl._ssl._test_decode_cert(certfile)  # type: ignore[attr-defined]
    except (ssl.SSLError, OSError):
        return ""
    names = decoded.get("subjectAltName", ())
    if any(value == host for _, value in names):
        return ""
    dns = [value for kind, value in names if kind == "DNS" and "*" not in value]
    if dns:
        return str(dns[0])
    for rdn in decoded.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


def tls_handshake_failed(error: grpc.RpcError) -> bool:
    """A TLS probe that reached the gateway but could not complete the handshake (as opposed
    to a gateway not listening yet: "Connection refused"). The client's own check names it; a
    server refusing the client's certificate just closes the socket."""
    details = (error.details() if hasattr(error, "details") else "") or ""
    words = ("handshake", "certificate", "ssl", "verification", "socket closed")
    return any(word in details.lower() for word in words)
