"""tls and auth: the gateway pods get the TLS flags and a Secret with only the certificate files,
exec probes over TLS (the kubelet's gRPC probe has no TLS), the API keys file from a Secret and
the admin token from a Secret in the environment."""

from __future__ import annotations

import pytest

from switchboard.cli import make_parser
from switchboard.cli.probe import main as probe_main
from tests.chart.chart_render import BIG_VALUES, argv, container, find, manifests, render

TLS = {"enabled": True, "secretName": "sb-tls", "clientAuth": True}
AUTH = {"apiKeys": {"secretName": "sb-keys"}, "adminToken": {"secretName": "sb-admin"}}


def _pod(docs: list[dict]) -> dict:
    return find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]


def test_gateway_serves_tls_with_keys_from_secrets() -> None:
    docs = manifests({**BIG_VALUES, "tls": TLS, "auth": AUTH})
    gateway = container(docs, "Deployment", "gateway")
    args, unknown = make_parser().parse_known_args(argv(gateway))
    assert not unknown
    assert args.ssl_certfile == "/etc/switchboard/tls/tls.crt"
    assert args.ssl_keyfile == "/etc/switchboard/tls/tls.key"
    assert args.ssl_ca_certs == "/etc/switchboard/tls/ca.crt"
    assert args.api_key_file == "/etc/switchboard/auth/api-keys"
    assert not args.api_key and not args.admin_token  # no secret on the command line
    (token,) = [e for e in gateway["env"] if e["name"] == "SWITCHBOARD_ADMIN_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "sb-admin", "key": "admin-token"}
    volumes = {v["name"]: v for v in _pod(docs)["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "sb-tls"
    assert [i["path"] for i in volumes["tls"]["secret"]["items"]] == [
        "tls.crt", "tls.key", "ca.crt"
    ]  # fmt: skip
    assert volumes["api-keys"]["secret"]["secretName"] == "sb-keys"
    mounts = {m["name"]: m for m in gateway["volumeMounts"]}
    assert mounts["tls"]["readOnly"] and mounts["api-keys"]["readOnly"]
    # Exec probes over mTLS, the same health services as the native gRPC probes.
    for probe, service in (
        ("startupProbe", ""),
        ("readinessProbe", "switchboard.v1.GenerationService"),
    ):
        command = gateway[probe]["exec"]["command"]
        assert command[:3] == ["python", "-m", "switchboard.cli.probe"]
        assert command[command.index("--service") + 1] == service
        assert command[command.index("--ssl-ca-certs") + 1] == "/etc/switchboard/tls/ca.crt"
    # The engine and coordinator pods carry none of it.
    for kind, component in (("StatefulSet", "engine"), ("Deployment", "coordinator")):
        other = container(docs, kind, component)
        assert "--ssl-certfile" not in argv(other) and "--api-key-file" not in argv(other)


def test_exec_probe_command_parses(capsys: pytest.CaptureFixture) -> None:
    """The probe's flags are the module's (nothing listens on port 1: exit 1, not 2)."""
    docs = manifests({"tls": {**TLS, "clientAuth": False}})
    command = container(docs, "Deployment", "gateway")["livenessProbe"]["exec"]["command"]
    flags = command[3:]
    flags[flags.index("--port") + 1] = "1"
    flags = [f for f in flags if not f.startswith("/etc/")]  # files absent here
    flags = [f for f in flags if not f.startswith("--ssl")]
    assert probe_main([*flags, "--timeout", "1"]) == 1
    assert "--ssl-ca-certs" not in command


def test_http_probes_over_https() -> None:
    docs = manifests({"tls": {**TLS, "clientAuth": False}, "gateway": {"probes": "http"}})
    gateway = container(docs, "Deployment", "gateway")
    assert gateway["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    with pytest.raises(Exception, match="clientAuth"):
        render({"tls": TLS, "gateway": {"probes": "http"}})


def test_tls_needs_a_secret_and_plain_stays_plain() -> None:
    with pytest.raises(Exception, match="secretName"):
        render({"tls": {"enabled": True}})
    gateway = container(manifests(), "Deployment", "gateway")
    assert "--ssl-certfile" not in argv(gateway) and "grpc" in gateway["readinessProbe"]
    assert all(e["name"] != "SWITCHBOARD_ADMIN_TOKEN" for e in gateway["env"])
