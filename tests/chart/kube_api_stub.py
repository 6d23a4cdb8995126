"""A stand-in for the Kubernetes API server's Secret endpoints, for the chart's keys hook Job
(there is no cluster here): HTTPS with a test CA, bearer-token authentication, and RBAC
authorization by the Role the chart renders, evaluated as Kubernetes does (a ``create`` has
no name, so a rule with ``resourceNames`` never matches it). Secrets keep a resourceVersion;
a PUT with a stale one gets 409, a POST of an existing name 409, a GET of a missing one 404."""

from __future__ import annotations

import base64
import binascii
import json
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.gateway.tls_certs import Certs

SECRETS_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/secrets(?:/([^/?]+))?(?:\?.*)?")
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
VERBS = {"GET": "get", "POST": "create", "PUT": "update"}


def rbac_allows(role: dict[str, Any], verb: str, resource: str, name: str | None) -> bool:
    for rule in role.get("rules", []):
        if "" not in rule.get("apiGroups", []) or resource not in rule.get("resources", []):
            continue
        if verb not in rule.get("verbs", []) and "*" not in rule.get("verbs", []):
            continue
        names = rule.get("resourceNames")
        if names and (name is None or name not in names):
            continue
        return True
    return False


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}  # fmt: skip


class KubeApiStub:
    """``with KubeApiStub(role, certs, tmp) as api:`` serves on 127.0.0.1:``api.port`` with
    ``certs.server_cert``; the service account directory a pod would have (token, namespace,
    ``certs.ca`` as ca.crt) is ``api.service_account``."""

    def __init__(
        self, role: dict[str, Any], certs: Certs, folder: Path, token: str = "hook-token"
    ) -> None:
        self.role = role
        self.namespace = role["metadata"]["namespace"]
        self.token = token
        self.secrets: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str | None, int]] = []  # verb, name, HTTP code
        self._version = 0
        self._lock = threading.Lock()
        self.service_account = folder / "serviceaccount"
        self.service_account.mkdir()
        (self.service_account / "token").write_text(token + "\n")
        (self.service_account / "namespace").write_text(self.namespace)
        (self.service_account / "ca.crt").write_bytes(certs.ca.read_bytes())
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs.server_cert, certs.server_key)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> KubeApiStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def data(self, name: str) -> dict[str, bytes]:
        """The Secret's files, decoded."""
        return {k: base64.b64decode(v) for k, v in self.secrets[name].get("data", {}).items()}

    def put_data(self, name: str, data: dict[str, bytes], annotations: dict[str, str]) -> None:
        """Make or overwrite a Secret directly (what an operator's kubectl would do)."""
        with self._lock:
            self._version += 1
            self.secrets[name] = {
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": self.namespace,
                             "annotations": annotations, "resourceVersion": str(self._version)},
                "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
            }  # fmt: skip

    def _serve(self, method: str, path: str, auth: str, body: bytes) -> tuple[int, dict]:
        match = SECRETS_PATH.fullmatch(path)
        if match is None:
            return 404, _status(404, "NotFound", f"no such path {path}")
        namespace, name = match.groups()
        if auth != f"Bearer {self.token}":
            return 401, _status(401, "Unauthorized", "Unauthorized")
        verb = VERBS[method]
        if method == "POST":
            obj = json.loads(body)
            name_checked = None  # RBAC sees no name on a create
            name = obj["metadata"]["name"]
        else:
            name_checked = name
        if namespace != self.namespace or not rbac_allows(self.role, verb, "secrets", name_checked):
            message = f'secrets "{name}" is forbidden: cannot {verb} in namespace "{namespace}"'
            return 403, _status(403, "Forbidden", message)
        with self._lock:
            current = self.secrets.get(name or "")
            if method == "GET":
                if current is None:
                    return 404, _status(404, "NotFound", f'secrets "{name}" not found')
                return 200, current
            obj = json.loads(body)
            problem = self._invalid(obj, name or "")
            if problem:
                return 422, _status(422, "Invalid", problem)
            if method == "POST" and current is not None:
                return 409, _status(409, "AlreadyExists", f'secrets "{name}" already exists')
            if method == "PUT":
                if current is None:
                    return 404, _status(404, "NotFound", f'secrets "{name}" not found')
                sent = obj["metadata"].get("resourceVersion")
                if sent and sent != current["metadata"]["resourceVersion"]:
                    return 409, _status(409, "Conflict", "the object has been modified")
            self._version += 1
            obj["metadata"]["resourceVersion"] = str(self._version)
            self.secrets[name or ""] = obj
            return (201 if method == "POST" else 200), obj

    @staticmethod
    def _invalid(obj: dict[str, Any], name: str) -> str:
        if obj.get("kind") != "Secret" or obj["metadata"].get("name") != name:
            return "not this Secret"
        for key, value in obj.get("data", {}).items():
            if not SECRET_KEY.fullmatch(key):
                return f"data[{key}]: a valid config key must consist of alphanumerics, -, _ or ."
            try:
                base64.b64decode(value, validate=True)
            except binascii.Error:
                return f"data[{key}]: illegal base64 data"
        return ""

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                code, reply = stub._serve(
                    self.command, self.path, self.headers.get("Authorization", ""), body
                )
                name = SECRETS_PATH.fullmatch(self.path)
                stub.calls.append((VERBS[self.command], name and name.group(2), code))
                payload = json.dumps(reply).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = _reply

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
