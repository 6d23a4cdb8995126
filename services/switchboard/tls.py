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


def probe_channel_credentials(gateway: GatewayConfig) -> grpc.ChannelCredentials:
    """What the launcher's readiness probe presents to its own gateway: trusts the CA bundle
    (else the server's own certificate file, right for a self-signed one) and, under mTLS,
    shows the server's certificate as its client certificate. Where that certificate does not
    verify (another CA, no name for the probed address, no clientAuth use) the probe fails
    its handshake and the launcher says so (``launcher.Supervisor._announce_ready``)."""
    trusted = gateway.ssl_ca_certs or gateway.ssl_certfile
    root = Path(trusted).read_bytes()
    if gateway.ssl_ca_certs:
        return grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=Path(gateway.ssl_keyfile).read_bytes(),
            certificate_chain=Path(gateway.ssl_certfile).read_bytes(),
        )
    return grpc.ssl_channel_credentials(root_certificates=root)
