"""The client install (`pip install switchboard`: grpcio, protobuf, googleapis-common-protos)
runs `switchboard generate` and imports the stubs: checked in a fresh interpreter in which every
server-only dependency is made unimportable, as it would be in such an install."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Top-level modules of the server extra (and of the test extra's heavier packages).
SERVER_ONLY = [
    "torch", "numpy", "msgspec", "zmq", "tokenizers", "safetensors", "gguf", "opentelemetry",
    "prometheus_client", "grpc_health", "grpc_reflection", "grpc_tools", "setproctitle",
    "transformers",
]  # fmt: skip
# What the client install brings: grpcio (with its dependency typing-extensions and the
# cython_runtime module its extension registers), protobuf / googleapis-common-protos, and us.
CLIENT_TOP_LEVEL = {"grpc", "cython_runtime", "typing_extensions", "google", "switchboard"}

_SCRIPT = """
import importlib.abc, io, json, sys, contextlib
BLOCKED = set({blocked!r})

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Block())
from switchboard import cli
from switchboard.cli import client
from switchboard.api.v1 import (
    admin_service_pb2, common_pb2, generation_service_pb2, generation_service_pb2_grpc,
    model_service_pb2, model_service_pb2_grpc,
)
parser = cli.make_parser()
loaded = sorted({{m.split(".")[0] for m in sys.modules}})
err = io.StringIO()
with contextlib.redirect_stderr(err):
    generate_code = cli.main(["generate", "hello", "--target", "127.0.0.1:{port}"])
    serve_code = cli.main(["serve", "--port", "1"])
    topology_code = cli.main(["topology", "-tp", "2"])
print(json.dumps({{"loaded": loaded, "generate": generate_code, "serve": serve_code,
                  "topology": topology_code, "stderr": err.getvalue()}}))
"""


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends


def test_the_client_side_runs_without_the_server_dependencies() -> None:
    script = _SCRIPT.format(blocked=SERVER_ONLY, port=_closed_port())
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    third_party = {
        name
        for name in result["loaded"]
        if name not in sys.stdlib_module_names and not name.startswith("_")
    }
    assert third_party <= CLIENT_TOP_LEVEL | {"sitecustomize", "usercustomize"}, third_party
    # generate ran and reached the (absent) server: an RPC error, not an ImportError
    assert result["generate"] == 1, result["stderr"]
    assert "UNAVAILABLE" in result["stderr"]
    # serve, and topology (its flags are the server's config fields), say what to install
    assert result["serve"] == result["topology"] == 2
    assert "switchboard topology: the server is not installed" in result["stderr"]
    assert "pip install 'switchboard[server]'" in result["stderr"]


def test_the_base_install_is_the_client_and_the_server_is_an_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {d.split("==")[0] for d in project["dependencies"]}
    assert names == {"grpcio", "protobuf", "googleapis-common-protos"}
    server = project["optional-dependencies"]["server"]
    assert "torch==2.13.0" in server  # any other torch spec may pull a multi-GB CUDA build
    assert all("==" in d for d in project["dependencies"] + server), "pin every dependency"
