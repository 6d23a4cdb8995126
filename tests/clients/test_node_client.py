"""examples/node/: the Node.js client (@grpc/grpc-js + @grpc/proto-loader on the repository's
proto/ folder) against a live `switchboard serve` on the tiny checkpoint.

Its dependencies are installed with `npm ci` (package-lock.json) into examples/node/node_modules
when missing; the test is skipped where node or npm is not installed. The checkpoint has a chat
template, so the example's chat form (``--chat``: one user message) runs too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.server import RunningServer, served
from tests.tiny_checkpoint import TINY_CHAT_TEMPLATE, tiny_llama_dir

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def node() -> str:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("the Node.js client test needs node and npm on PATH (https://nodejs.org)")
    if not (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=EXAMPLE, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"npm ci failed in {EXAMPLE}:\n{done.stdout}{done.stderr}"
    return node


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = tiny_llama_dir(chat_template=TINY_CHAT_TEMPLATE)
    yield from served(model, tmp_path_factory.mktemp("node"))


def _run_client(node: str, server: RunningServer, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [node, "client.js", "--target", server.target, *args],
        cwd=EXAMPLE, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_node_client_streams_generate_and_tokenizes(node: str, server: RunningServer) -> None:
    prompt = "import os"
    done = _run_client(node, server, "--json", "--ignore-eos", "--max-tokens", str(MAX_TOKENS),
                       prompt)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # max_tokens honoured exactly, enums as strings (enums: String), snake_case kept (keepCase)
    assert result["completion_tokens"] == MAX_TOKENS
    assert result["usage"]["completion_tokens"] == MAX_TOKENS
    assert result["finish_reason"] == "FINISH_REASON_LENGTH"
    assert result["text"] != ""
    assert result["request_id"].startswith("req-")
    # Tokenize agrees with the Python stubs
    with server.channel() as channel:
        expected = pb_grpc.GenerationServiceStub(channel).Tokenize(
            pb.TokenizeRequest(text=prompt), timeout=30
        )
    assert result["prompt_token_ids"] == list(expected.token_ids)
    assert result["usage"]["prompt_tokens"] == len(expected.token_ids)
    assert result["max_model_len"] == expected.max_model_len
    # a refused request's google.rpc.Status details, decoded with proto/google/rpc
    refused = result["refused"]
    assert refused["code"] == "INVALID_ARGUMENT"
    kinds = {detail["type"]: detail for detail in refused["status_details"]}
    assert kinds["google.rpc.ErrorInfo"]["domain"] == "switchboard"
    violation = kinds["google.rpc.BadRequest"]["field_violations"][0]
    assert violation["field"] == "sampling.top_p"


def test_node_client_streams_text_to_the_terminal(node: str, server: RunningServer) -> None:
    done = _run_client(node, server, "--ignore-eos", "--max-tokens", "4", "def main(")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() != ""
    assert "[FINISH_REASON_LENGTH;" in done.stderr and "4 completion tokens" in done.stderr
    assert "refused as expected: INVALID_ARGUMENT" in done.stderr


def test_node_client_sends_a_chat_message(node: str, server: RunningServer) -> None:
    question = "hello there"
    done = _run_client(node, server, "--json", "--chat", "--ignore-eos", "--max-tokens", "3",
                       question)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["finish_reason"] == "FINISH_REASON_LENGTH"
    assert result["completion_tokens"] == 3
    # the template wrapped the message: more prompt tokens than the bare text has
    assert result["usage"]["prompt_tokens"] > len(result["prompt_token_ids"])
