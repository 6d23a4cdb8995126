"""The NetworkPolicies, on by default: each selects exactly one component's pods of this
release, and evaluated as Kubernetes evaluates ingress rules they admit what the topology needs
(engines -> gateways on any port, engines and gateways -> the coordinator's own port, clients
-> the gateways' gRPC and HTTP ports, Prometheus -> metrics) and nothing else: not other pods,
not another release's pods, not other namespaces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import helm_python
import pytest

from tests.chart.chart_render import BIG_VALUES, NAMESPACE, RELEASE, container, manifests, render

WORKLOADS = {"Deployment", "StatefulSet", "Job"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
EPHEMERAL_PORT = 41234  # where a gateway's data sockets land (bound on port 0)


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    namespace: str = NAMESPACE
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.namespace_labels.setdefault("kubernetes.io/metadata.name", self.namespace)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector ({} selects everything)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        present = key in labels
        ok = {
            "In": present and labels.get(key) in (values or []),
            "NotIn": not present or labels.get(key) not in (values or []),
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not ok:
            return False
    return True


def _peer_admits(peer: dict[str, Any], policy_namespace: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pod-to-pod traffic only here
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], source.namespace_labels)
    else:
        in_namespace = source.namespace == policy_namespace
    return in_namespace and selects(peer.get("podSelector", {}), source.labels)


def admitted(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    """Whether ``source`` may open a TCP connection to ``target``:``port``."""
    isolating = [p for p in policies if p["metadata"]["namespace"] == target.namespace
                 and "Ingress" in p["spec"]["policyTypes"]
                 and selects(p["spec"]["podSelector"], target.labels)]  # fmt: skip
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from", [])
            if peers and not any(
                _peer_admits(peer, policy["metadata"]["namespace"], source) for peer in peers
            ):
                continue
            ports = rule.get("ports", [])
            if not ports or any(
                p.get("protocol", "TCP") == "TCP"
                and p["port"] <= port <= p.get("endPort", p["port"])
                for p in ports
            ):
                return True
    return False


def _policies(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def _pods(docs: list[dict]) -> dict[str, Pod]:
    """component -> a pod of its workload (its template's labels)."""
    return {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: Pod(
            d["spec"]["template"]["metadata"]["labels"]
        )
        for d in docs
        if d["kind"] in WORKLOADS
    }


def _ports(docs: list[dict], kind: str, component: str) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(docs, kind, component)["ports"]}


@pytest.mark.parametrize("values", [{}, BIG_VALUES], ids=["defaults", "dp2-metrics"])
def test_each_policy_selects_exactly_one_components_pods(values: dict) -> None:
    docs = manifests(values)
    pods = _pods(docs)
    expected = {"gateway", "engine"} | ({"coordinator"} if "coordinator" in pods else set())
    selected: dict[str, list[str]] = {}
    for policy in _policies(docs):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        chosen = [
            c for c, pod in pods.items() if selects(policy["spec"]["podSelector"], pod.labels)
        ]
        selected[policy["metadata"]["name"]] = chosen
    assert selected == {f"demo-switchboard-{c}": [c] for c in expected}
    # The keys hook Job's pod is not isolated: it listens on nothing and lives for seconds.
    assert "curve-keys" in pods and all("curve-keys" not in c for c in selected.values())
    # Another release's pods in the same namespace are none of this release's policies' business.
    other_pods = _pods(manifests(values, release="other"))
    for policy in _policies(docs):
        for pod in other_pods.values():
            assert not selects(policy["spec"]["podSelector"], pod.labels)


def test_who_reaches_what_by_default() -> None:
    docs = manifests({**BIG_VALUES, "gateway": {"service": {"type": "ClusterIP"}}})
    policies, pods = _policies(docs), _pods(docs)
    gateway, engine, coordinator = pods["gateway"], pods["engine"], pods["coordinator"]
    gw = _ports(docs, "Deployment", "gateway")
    co = _ports(docs, "Deployment", "coordinator")
    neighbour = Pod({"app": "something-else"})  # any pod of the namespace
    stranger = Pod({"app": "x"}, namespace="elsewhere")
    prometheus = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    other_release = {c: Pod({**p.labels, "app.kubernetes.io/instance": "other"})
                     for c, p in pods.items()}  # fmt: skip

    def reach(source: Pod, target: Pod, port: int) -> bool:
        return admitted(policies, source, target, port)

    # The wire between the release's own pods.
    for port in (gw["handshake"], EPHEMERAL_PORT):
        assert reach(engine, gateway, port)
        assert not reach(neighbour, gateway, port)
        assert not reach(other_release["engine"], gateway, port)
        assert not reach(gateway, gateway, port)
    assert reach(engine, coordinator, co["load"]) and not reach(engine, coordinator, co["report"])
    assert reach(gateway, coordinator, co["report"]) and not reach(gateway, coordinator, co["load"])
    for source in (neighbour, stranger, prometheus, other_release["engine"]):
        assert not reach(source, coordinator, co["load"])
        assert not reach(source, coordinator, co["report"])
    # Engines listen on nothing and admit nothing.
    for source in (gateway, coordinator, neighbour, prometheus):
        assert not reach(source, engine, EPHEMERAL_PORT)
    # Clients: the namespace, on the gRPC and HTTP ports only.
    for port in (gw["grpc"], gw["http"]):
        assert reach(neighbour, gateway, port) and not reach(stranger, gateway, port)
    # Metrics: the monitoring namespace, on the metrics port only.
    assert reach(prometheus, gateway, gw["metrics"])
    assert not reach(prometheus, gateway, gw["grpc"]) and not reach(
        neighbour, gateway, gw["metrics"]
    )


def test_ingress_values_widen_only_the_client_ports() -> None:
    everyone = [{"namespaceSelector": {}}, {"ipBlock": {"cidr": "0.0.0.0/0"}}]
    docs = manifests(
        {"networkPolicy": {"ingress": everyone}, "gateway": {"http": {"enabled": False}}}
    )
    policies, pods = _policies(docs), _pods(docs)
    gw = _ports(docs, "Deployment", "gateway")
    stranger = Pod({"app": "x"}, namespace="elsewhere")
    assert admitted(policies, stranger, pods["gateway"], gw["grpc"])
    assert not admitted(policies, stranger, pods["gateway"], gw["handshake"])
    assert not admitted(policies, stranger, pods["gateway"], 8000)  # HTTP off: no rule for it
    (client_rule,) = [r for r in _policies(docs)[0]["spec"]["ingress"] if "ports" in r]
    assert client_rule["from"] == everyone


def test_off_renders_none_and_the_notes_warn() -> None:
    values = {"networkPolicy": {"enabled": False}}
    assert _policies(manifests(values)) == []
    assert (
        "WARNING: networkPolicy.enabled=false" in render(values)["switchboard/templates/NOTES.txt"]
    )
    lb = render({"gateway": {"service": {"type": "LoadBalancer"}}})
    assert "e.g. an ipBlock" in lb["switchboard/templates/NOTES.txt"]


@pytest.mark.parametrize(
    ("network_policy", "where"),
    [
        ({"enabled": "yes"}, "/networkPolicy/enabled"),
        ({"ingress": []}, "/networkPolicy/ingress"),  # nobody? everybody? say which
        ({"ingress": "everyone"}, "/networkPolicy/ingress"),
        ({"ingress": [{}]}, "/networkPolicy/ingress/0"),
        ({"ingress": [{"podSelectr": {}}]}, "/networkPolicy/ingress/0"),
        ({"ingress": [{"ipBlock": {"except": ["10.0.0.0/8"]}}]},
         "/networkPolicy/ingress/0/ipBlock"),
        ({"metricsIngress": [{"namespaceSelector": {"matchLabels": {"a": 1}}}]},
         "/networkPolicy/metricsIngress/0/namespaceSelector/matchLabels/a"),
    ],
)  # fmt: skip
def test_schema_rejects_bad_policy_values(network_policy: dict, where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as error:
        render({"networkPolicy": network_policy})
    assert where in str(error.value)


def test_release_name_is_in_every_selector() -> None:
    for policy in _policies(manifests(BIG_VALUES)):
        labels = policy["spec"]["podSelector"]["matchLabels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if peer.get("podSelector", {}).get("matchLabels"):
                    assert (
                        peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
                    )
