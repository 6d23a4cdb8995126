"""The keys hook: a pre-install/pre-upgrade Job runs `switchboard keys kubernetes-secret` as a
ServiceAccount whose Role allows exactly what it needs. Its rendered command is run here against
an API stub that authorizes by the rendered Role, through install, upgrades (more engines), a
rotation and a values rollback; then each role's projected files load as that role loads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchboard.cli import curve_secret, main, make_parser
from switchboard.wire import curve
from tests.chart.chart_render import NAMESPACE, argv, container, manifests
from tests.chart.curve_keys import hook, project_keys, run_keys_job
from tests.chart.kube_api_stub import KubeApiStub, rbac_allows
from tests.gateway.tls_certs import Certs, make_certs

SECRET = "demo-switchboard-curve"
HOOK_KINDS = ("ServiceAccount", "Role", "RoleBinding", "Job")


def _weight(doc: dict) -> int:
    return int(doc["metadata"]["annotations"]["helm.sh/hook-weight"])


def test_the_hook_runs_before_the_pods_with_a_role_for_that_secret_only() -> None:
    docs = manifests({"dataParallelSize": 3, "curve": {"generation": 4}})
    objects = {kind: hook(docs, kind) for kind in HOOK_KINDS}
    for doc in objects.values():
        annotations = doc["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    # Helm creates hooks by weight: the account and its rights exist before the Job starts.
    assert _weight(objects["ServiceAccount"]) <= _weight(objects["Role"])
    assert _weight(objects["Role"]) < _weight(objects["RoleBinding"]) < _weight(objects["Job"])

    role, binding = objects["Role"], objects["RoleBinding"]
    account = objects["ServiceAccount"]["metadata"]["name"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": NAMESPACE}]  # fmt: skip
    assert rbac_allows(role, "get", "secrets", SECRET)
    assert rbac_allows(role, "update", "secrets", SECRET)
    assert rbac_allows(role, "create", "secrets", None)  # RBAC cannot name a create
    for verb in ("get", "update", "patch", "delete"):
        assert not rbac_allows(role, verb, "secrets", "someone-elses-secret"), verb
    for verb in ("list", "watch", "delete", "deletecollection", "patch"):
        assert not rbac_allows(role, verb, "secrets", SECRET), verb
    assert {r for rule in role["rules"] for r in rule["resources"]} == {"secrets"}

    pod = objects["Job"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account
    assert pod["automountServiceAccountToken"] is True  # this pod only:
    assert objects["ServiceAccount"]["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never"
    keys = container(docs, "Job", "curve-keys")
    assert keys["image"] == container(docs, "Deployment", "gateway")["image"]  # no torch
    assert keys["securityContext"]["readOnlyRootFilesystem"] is True
    args = make_parser().parse_args(argv(keys))
    assert (args.command, args.action, args.target) == ("keys", "kubernetes-secret", SECRET)
    assert (args.engines, args.generation) == (3, 4)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("kube-api-certs"))


def _stub(certs: Certs, tmp_path: Path) -> KubeApiStub:
    return KubeApiStub(hook(manifests(), "Role"), certs, tmp_path)


def test_install_upgrade_rotate_and_roll_back(certs, tmp_path, monkeypatch) -> None:
    with _stub(certs, tmp_path) as api:
        assert "created" in run_keys_job(manifests(), api, monkeypatch)
        installed = api.data(SECRET)
        assert sorted(installed) == [
            "coordinator.key", "coordinator.key_secret", "engine-0.key", "engine-0.key_secret",
            "gateway.key", "gateway.key_secret",
        ]  # fmt: skip
        secret = api.secrets[SECRET]
        assert secret["metadata"]["annotations"] == {curve_secret.GENERATION_ANNOTATION: "1"}
        assert b"secret-key" in installed["gateway.key_secret"]
        assert b"secret-key" not in installed["gateway.key"]

        # An upgrade with the same values keeps every key (and writes nothing).
        out = run_keys_job(manifests(), api, monkeypatch)
        assert "kept" in out and api.data(SECRET) == installed
        assert api.calls[-1][0] == "get"

        # Scaling to DP = 3 adds two engine pairs and keeps the others.
        out = run_keys_job(manifests({"dataParallelSize": 3}), api, monkeypatch)
        assert "added engine-1.key, engine-2.key" in out
        grown = api.data(SECRET)
        assert {k: grown[k] for k in installed} == installed
        assert len(grown) == 10

        # A newer generation replaces every pair; an older one afterwards changes nothing.
        out = run_keys_job(manifests({"curve": {"generation": 2}}), api, monkeypatch)
        assert "rotated" in out
        rotated = api.data(SECRET)
        assert sorted(rotated) == sorted(installed)  # DP = 1 again: engine-0 only
        assert all(rotated[k] != installed[k] for k in installed)
        assert "kept" in run_keys_job(manifests(), api, monkeypatch)
        assert api.data(SECRET) == rotated
        annotations = api.secrets[SECRET]["metadata"]["annotations"]
        assert annotations[curve_secret.GENERATION_ANNOTATION] == "2"
        # Never a key on the output.
        assert "secret-key" not in out and "public-key" not in out
    # Refused only once: the first GET, before the Secret existed.
    assert [call for call in api.calls if call[2] >= 400] == [("get", SECRET, 404)], api.calls


def test_half_a_pair_is_replaced_and_a_broken_pair_is_refused(certs, tmp_path, monkeypatch) -> None:
    with _stub(certs, tmp_path) as api:
        run_keys_job(manifests(), api, monkeypatch)
        data = api.data(SECRET)
        partial = {k: v for k, v in data.items() if k != "engine-0.key_secret"}
        api.put_data(SECRET, partial, api.secrets[SECRET]["metadata"]["annotations"])
        assert "added engine-0.key" in run_keys_job(manifests(), api, monkeypatch)
        repaired = api.data(SECRET)
        assert repaired["engine-0.key"] != data["engine-0.key"]  # a whole new pair
        assert repaired["gateway.key_secret"] == data["gateway.key_secret"]

        swapped = dict(repaired, **{"gateway.key": repaired["coordinator.key"]})
        api.put_data(SECRET, swapped, {})
        with pytest.raises(SystemExit, match="gateway.key is not the public half"):
            run_keys_job(manifests(), api, monkeypatch)
        assert api.data(SECRET) == swapped  # left for the operator to look at


def test_refusals_say_what_is_wrong(certs, tmp_path, monkeypatch) -> None:
    docs = manifests()
    with _stub(certs, tmp_path) as api:
        api.role = {"metadata": api.role["metadata"], "rules": []}  # a Role without rights
        with pytest.raises(SystemExit, match="HTTP 403.*Role must allow get, update and create"):
            run_keys_job(docs, api, monkeypatch)
        api.token = "another-token"
        with pytest.raises(SystemExit, match="HTTP 401"):
            run_keys_job(docs, api, monkeypatch)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(SystemExit, match="not inside a Kubernetes pod"):
        main(["keys", "kubernetes-secret", SECRET])
    with pytest.raises(SystemExit, match="--generation must be at least 1"):
        main(["keys", "kubernetes-secret", SECRET, "--generation", "0"])


def _roles_load_their_keys(docs: list[dict], data: dict[str, bytes], tmp_path: Path) -> None:
    """The Secret ``data``, projected per pod as the chart's volume items say, holds what each
    role reads: a gateway its pair and the engines' allow-list, each engine rank its pair and
    the gateway's and coordinator's public keys, the coordinator its pair and both lists."""
    gateway = str(project_keys(docs, "Deployment", "gateway", data, tmp_path / "gateway"))
    engine = str(project_keys(docs, "StatefulSet", "engine", data, tmp_path / "engine"))
    coordinator = project_keys(docs, "Deployment", "coordinator", data, tmp_path / "coord")
    assert curve.server_keys(gateway, curve.GATEWAY).secret
    allowed = curve.AllowList([f"{gateway}/{curve.ALLOWED_ENGINES}"]).names()
    assert sorted(allowed.values()) == ["engine-0", "engine-1"]
    for rank in (0, 1):
        name = curve.engine_key_name(engine, rank)
        assert name == f"engine-{rank}"
        keys = curve.client_keys(engine, name, curve.GATEWAY)
        assert keys.server_public == curve.server_keys(gateway, curve.GATEWAY).public
        assert keys.public in allowed
        to_coordinator = curve.client_keys(engine, name, curve.COORDINATOR)
        assert (
            to_coordinator.server_public
            == curve.server_keys(str(coordinator), curve.COORDINATOR).public
        )
    gateways = curve.AllowList([str(coordinator / curve.ALLOWED_GATEWAYS)]).names()
    assert list(gateways.values()) == [curve.GATEWAY]
    assert not (tmp_path / "engine" / "gateway.key_secret").exists()  # no other role's secret


def test_each_role_loads_the_keys_the_job_made(certs, tmp_path, monkeypatch) -> None:
    docs = manifests({"dataParallelSize": 2})
    with _stub(certs, tmp_path) as api:
        run_keys_job(docs, api, monkeypatch)
    _roles_load_their_keys(docs, api.data(SECRET), tmp_path / "pods")


def test_each_role_loads_an_own_secret_from_keys_generate(tmp_path) -> None:
    """docs/helm.md's way to bring your own keys: `switchboard keys generate DIR`, then
    `kubectl create secret generic NAME --from-file=DIR` (the directory's regular files, its
    subdirectories skipped), then `curve.secretName: NAME`."""
    keys_dir = tmp_path / "keys"
    assert main(["keys", "generate", str(keys_dir), "--engines", "2"]) == 0
    with pytest.raises(SystemExit, match="not overwriting"):
        main(["keys", "generate", str(keys_dir)])
    data = {p.name: p.read_bytes() for p in keys_dir.iterdir() if p.is_file()}
    docs = manifests({"dataParallelSize": 2, "curve": {"secretName": "own-keys"}})
    _roles_load_their_keys(docs, data, tmp_path / "pods")
