"""metrics.token and TLS: the gateways get the metrics token from a Secret in their environment,
and the ServiceMonitor scrapes with it (``bearerTokenSecret``), over HTTPS when tls.enabled."""

from __future__ import annotations

from typing import Any

import jsonschema

from switchboard.cli import make_parser
from switchboard.config import METRICS_TOKEN_ENV
from tests.chart.chart_render import BIG_VALUES, argv, container, find, manifests

TLS = {"enabled": True, "secretName": "sb-tls"}
TOKEN = {"secretName": "sb-metrics", "key": "token"}

_SECRET_KEY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "key"],
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}},
}
_SECRET_OR_CONFIG_MAP = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"secret": _SECRET_KEY, "configMap": _SECRET_KEY},
}
# The fields of prometheus-operator's ServiceMonitor endpoint (monitoring.coreos.com/v1) the
# chart may write: a misspelt one fails here, as the CRD's validation would fail the install.
ENDPOINT_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
        "scheme": {"enum": ["http", "https"]},
        "bearerTokenSecret": _SECRET_KEY,
        "tlsConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "ca": _SECRET_OR_CONFIG_MAP,
                "cert": _SECRET_OR_CONFIG_MAP,
                "keySecret": _SECRET_KEY,
                "serverName": {"type": "string"},
                "insecureSkipVerify": {"type": "boolean"},
            },
        },
    },
}


def endpoint(values: dict[str, Any]) -> dict[str, Any]:
    monitor = find(manifests(values), "ServiceMonitor", "gateway")
    assert monitor is not None
    (only,) = monitor["spec"]["endpoints"]
    jsonschema.validate(only, ENDPOINT_SCHEMA)
    return only


def token_env(values: dict[str, Any]) -> list[dict[str, Any]]:
    gateway = container(manifests(values), "Deployment", "gateway")
    return [e for e in gateway["env"] if e["name"] == METRICS_TOKEN_ENV]


def test_plain_metrics_are_scraped_over_http_without_a_token() -> None:
    assert endpoint(BIG_VALUES) == {"port": "metrics", "path": "/metrics", "interval": "30s"}
    assert token_env(BIG_VALUES) == []


def test_the_token_reaches_the_gateways_and_the_service_monitor() -> None:
    values = {**BIG_VALUES, "metrics": {**BIG_VALUES["metrics"], "token": TOKEN}}
    (env,) = token_env(values)
    assert env["valueFrom"]["secretKeyRef"] == {"name": "sb-metrics", "key": "token"}
    gateway = container(manifests(values), "Deployment", "gateway")
    args, unknown = make_parser().parse_known_args(argv(gateway))
    assert not unknown and not args.metrics_token  # not on the command line
    assert endpoint(values)["bearerTokenSecret"] == {"name": "sb-metrics", "key": "token"}
    # No metrics, no token in the pods.
    assert token_env({"metrics": {"enabled": False, "token": TOKEN}}) == []


def test_with_tls_the_service_monitor_scrapes_https_verifying_the_gateways() -> None:
    values = {**BIG_VALUES, "tls": TLS, "metrics": {**BIG_VALUES["metrics"], "token": TOKEN}}
    scraped = endpoint(values)
    assert scraped["scheme"] == "https"
    assert scraped["tlsConfig"] == {
        "ca": {"secret": {"name": "sb-tls", "key": "ca.crt"}},
        "serverName": "demo-switchboard-gateway.llm.svc",
    }
    assert scraped["bearerTokenSecret"]["name"] == "sb-metrics"
    gateway = container(manifests(values), "Deployment", "gateway")
    args, _ = make_parser().parse_known_args(argv(gateway))
    assert args.ssl_certfile and args.metrics_port == 9100  # /metrics serves TLS with them


def test_under_client_auth_the_service_monitor_shows_a_certificate() -> None:
    values = {**BIG_VALUES, "tls": {**TLS, "clientAuth": True}}
    tls_config = endpoint(values)["tlsConfig"]
    assert tls_config["cert"] == {"secret": {"name": "sb-tls", "key": "tls.crt"}}
    assert tls_config["keySecret"] == {"name": "sb-tls", "key": "tls.key"}


def test_an_own_tls_config_replaces_the_default() -> None:
    own = {"ca": {"configMap": {"name": "corp-ca", "key": "ca.pem"}}, "serverName": "gw.corp"}
    monitor_values = {**BIG_VALUES["metrics"]["serviceMonitor"], "tlsConfig": own}
    values = {
        **BIG_VALUES,
        "tls": TLS,
        "metrics": {**BIG_VALUES["metrics"], "serviceMonitor": monitor_values},
    }
    assert endpoint(values)["tlsConfig"] == own
