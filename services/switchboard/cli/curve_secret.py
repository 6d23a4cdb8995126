"""CURVE keys kept in a Kubernetes Secret, written from inside the cluster
(``switchboard keys kubernetes-secret NAME``; the Helm chart's pre-install/pre-upgrade hook Job).

The Secret holds the top-level files of ``switchboard keys generate`` (wire/curve.py): one pair
per role, ``gateway``, ``coordinator`` and ``engine-<r>``, as ``NAME.key`` and
``NAME.key_secret``; the chart lays each pod's allow-list directories out from them. Running
the command again is safe and is what every ``helm upgrade`` does:

- no Secret: it is created with fresh pairs;
- a Secret that lacks some pairs (more engines than before): the missing pairs are added, the
  others kept as they are;
- a Secret made for an older ``--generation`` (an annotation on it): every pair is replaced
  (rotation); a newer or equal generation is never rotated backwards.

It speaks to the API server with the pod's service account (token and CA under
``/var/run/secrets/kubernetes.io/serviceaccount``) over HTTPS, and needs only ``get`` and
``update`` on that one Secret and ``create`` on Secrets. Keys are never printed or logged.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.auth

from switchboard.wire import curve

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
GENERATION_ANNOTATION = "switchboard.io/curve-generation"
FIELD_MANAGER = "switchboard-keys"
LABELS = {"app.kubernetes.io/part-of": "switchboard", "app.kubernetes.io/managed-by": FIELD_MANAGER}
TIMEOUT_S = 30.0


class KeysSecretError(RuntimeError):
    """The API server refused or could not be reached, or the Secret holds something that is
    not a usable key pair; the message says which and what to do."""


@dataclass(frozen=True)
class KubeApi:
    """The few Secret calls the keys need, as the pod's service account."""

    base_url: str
    token: str
    namespace: str
    ssl_context: ssl.SSLContext

    @classmethod
    def in_cluster(cls, service_account_dir: str | None = None) -> KubeApi:
        sa_dir = Path(service_account_dir or SERVICE_ACCOUNT_DIR)
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KeysSecretError(
                "not inside a Kubernetes pod ($KUBERNETES_SERVICE_HOST is unset): use "
                "`switchboard keys generate DIR` and `kubectl create secret generic`"
            )
        try:
            token = (sa_dir / "token").read_text().strip()
            namespace = (sa_dir / "namespace").read_text().strip()
            context = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
        except OSError as exc:
            raise KeysSecretError(
                f"no service account token in {sa_dir} ({exc}): the pod needs "
                "automountServiceAccountToken: true"
            ) from None
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", token, namespace, context)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.base_url}/api/v1/namespaces/{self.namespace}/secrets{path}"
        if method != "GET":
            url += f"?fieldManager={FIELD_MANAGER}"
        request = urllib.request.Request(
            url,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {self.token}",
                "Accept": "application/json",
                "Content-Type": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(
                request, context=self.ssl_context, timeout=TIMEOUT_S
            ) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method == "GET":
                return None
            raise KeysSecretError(_refusal(method, url, exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise KeysSecretError(f"cannot reach the Kubernetes API at {url}: {exc}") from None

    def get_secret(self, name: str) -> dict[str, Any] | None:
        """The Secret, or None when there is none of that name."""
        found: dict[str, Any] | None = self._call("GET", f"/{name}")
        return found

    def create_secret(self, secret: dict[str, Any]) -> None:
        self._call("POST", "", secret)

    def replace_secret(self, secret: dict[str, Any]) -> None:
        """PUT with the resourceVersion read: a concurrent change fails (409) instead of being
        overwritten."""
        self._call("PUT", f"/{secret['metadata']['name']}", secret)


def _refusal(method: str, url: str, exc: urllib.error.HTTPError) -> str:
    try:
        message = json.loads(exc.read()).get("message", "")
    except (ValueError, OSError, AttributeError):
        message = ""
    hint = ""
    if exc.code == 403:
        hint = " (the service account's Role must allow get, update and create on this Secret)"
    return f"{method} {url}: HTTP {exc.code} {message or exc.reason}{hint}"


def pair_names(engines: int) -> list[str]:
    return [curve.GATEWAY, curve.COORDINATOR, *(f"engine-{r}" for r in range(engines))]


def pair_files(name: str) -> tuple[str, str]:
    return f"{name}.key", f"{name}.key_secret"


def fresh_keys(engines: int) -> dict[str, bytes]:
    """A new keys directory's top-level files (file name -> content), made by curve.generate
    in a temporary directory that is removed again."""
    with tempfile.TemporaryDirectory(prefix="switchboard-keys-") as tmp:
        keys_dir = Path(tmp) / "keys"
        curve.generate(str(keys_dir), engines)
        return {path.name: path.read_bytes() for path in keys_dir.iterdir() if path.is_file()}


def merge_keys(
    existing: dict[str, bytes], fresh: dict[str, bytes], engines: int
) -> dict[str, bytes]:
    """``existing`` plus the pairs of ``fresh`` it lacks; a pair is kept only when both of its
    files are there (half a pair is replaced whole). Entries beyond ``engines`` stay."""
    merged = dict(existing)
    for name in pair_names(engines):
        files = pair_files(name)
        if not all(f in existing for f in files):
            merged.update({f: fresh[f] for f in files})
    return merged


def check_pairs(secret_name: str, data: dict[str, bytes], engines: int) -> None:
    """Every pair parses and its ``.key`` is the public half of its ``.key_secret``."""
    with tempfile.TemporaryDirectory(prefix="switchboard-keys-") as tmp:
        for name in pair_names(engines):
            public_file, secret_file = (Path(tmp) / f for f in pair_files(name))
            public_file.write_bytes(data[public_file.name])
            secret_file.write_bytes(data[secret_file.name])
            try:
                public, _ = zmq.auth.load_certificate(public_file)
                paired, secret = zmq.auth.load_certificate(secret_file)
            except (OSError, ValueError) as exc:
                raise KeysSecretError(
                    f"Secret {secret_name}: {name} is not a CURVE key pair ({exc}); delete "
                    "the Secret or rotate (a newer --generation) to make new keys"
                ) from None
            if not secret or paired != public:
                raise KeysSecretError(
                    f"Secret {secret_name}: {public_file.name} is not the public half of "
                    f"{secret_file.name}; delete the Secret or rotate to make new keys"
                )


def _generation(secret: dict[str, Any]) -> int | None:
    text = (secret.get("metadata", {}).get("annotations") or {}).get(GENERATION_ANNOTATION)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise KeysSecretError(
            f"Secret {secret['metadata'].get('name')}: annotation {GENERATION_ANNOTATION}="
            f"{text!r} is not a number"
        ) from None


def _encode(data: dict[str, bytes]) -> dict[str, str]:
    return {name: base64.b64encode(content).decode() for name, content in sorted(data.items())}


def _decode(data: dict[str, str] | None) -> dict[str, bytes]:
    return {name: base64.b64decode(content) for name, content in (data or {}).items()}


def store_keys(api: KubeApi, name: str, engines: int, generation: int) -> str:
    """Create, complete or rotate the Secret ``name`` (see the module docstring); returns one
    line saying which, without a key in it."""
    fresh = fresh_keys(engines)
    secret = api.get_secret(name)
    if secret is None:
        api.create_secret(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {
                    "name": name,
                    "namespace": api.namespace,
                    "labels": LABELS,
                    "annotations": {GENERATION_ANNOTATION: str(generation)},
                },
                "data": _encode(fresh),
            }
        )
        return f"Secret {name}: created (generation {generation}, {engines} engine pair(s))"
    stored = _generation(secret)
    existing = _decode(secret.get("data"))
    metadata = secret.setdefault("metadata", {})
    annotations = metadata.get("annotations") or {}
    if stored is not None and stored < generation:
        data, outcome = fresh, f"rotated: every pair replaced (generation {stored} -> {generation})"
        annotations[GENERATION_ANNOTATION] = str(generation)
    else:
        data = merge_keys(existing, fresh, engines)
        check_pairs(name, data, engines)
        added = sorted(f for f in data if f not in existing or data[f] != existing[f])
        if not added:
            return f"Secret {name}: kept (every pair for {engines} engine(s) is there)"
        outcome = "added " + ", ".join(f for f in added if not f.endswith("_secret"))
        annotations.setdefault(GENERATION_ANNOTATION, str(generation))
    metadata["annotations"] = annotations
    secret["data"] = _encode(data)
    api.replace_secret(secret)
    return f"Secret {name}: {outcome}"
