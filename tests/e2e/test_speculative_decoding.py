"""Speculative decoding served (the default model, n-gram proposals): a copied paragraph comes
out as it does with speculation off (a request with bad words has it off automatically), the
usage says how many proposals were accepted, and a stop string ends the text and the token ids
where it matched, even inside a run of accepted proposals.

Slow: it serves the 30-layer default model on CPU.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.client_calls import scrape
from tests.e2e.server import free_port, start_server
from tests.models.test_default_model_speculation import TEXT

pytestmark = pytest.mark.slow

ROW_COST = "switchboard:spec_decode_row_cost"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


class Generated:
    def __init__(self, responses: list[pb.GenerateResponse]) -> None:
        self.text = "".join(o.text for r in responses for o in r.outputs)
        self.token_ids = [t for r in responses for o in r.outputs for t in o.token_ids]
        self.usage = responses[-1].usage
        self.stop_string = responses[-1].outputs[0].stop_string


def generate(stub, *, bad_words=(), stop=(), max_tokens=40) -> Generated:
    request = pb.GenerateRequest(text=TEXT)
    request.sampling.temperature = 0.0
    request.sampling.bad_words.extend(bad_words)
    request.stopping.max_tokens = max_tokens
    request.stopping.stop.extend(stop)
    request.output.return_token_ids = True
    return Generated(list(stub.Generate(request, timeout=300)))


def test_speculation_served(tmp_path: Path) -> None:
    metrics_port = free_port()
    server = start_server(
        None,
        tmp_path,
        "--speculative-config",
        NGRAM,
        "--metrics-port",
        str(metrics_port),
        ready_timeout=600,
    )
    try:
        with server.channel() as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            on = generate(stub)
            off = generate(stub, bad_words=["zqxjkvw"])  # bad words: speculation off
            stopped = generate(stub, stop=["Difference"])
        assert on.usage.spec_draft_tokens > 0
        assert on.usage.spec_accepted_tokens > on.usage.spec_draft_tokens // 2
        assert off.usage.spec_draft_tokens == 0
        assert on.token_ids == off.token_ids and on.text == off.text
        assert on.usage.completion_tokens == len(on.token_ids) == 40
        body = json.dumps(
            {"prompt": TEXT, "max_tokens": 40, "temperature": 0, "model": "SmolLM2-135M-Instruct"}
        ).encode()
        request = urllib.request.Request(
            f"{server.http_url}/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            completion = json.load(response)
        usage = completion["usage"]
        assert usage["speculative_decoding"]["accepted_tokens"] > 0
        assert "successor to Babbage" in completion["choices"][0]["text"]
        assert stopped.stop_string == "Difference"
        assert "Difference" not in stopped.text and stopped.text.endswith("Babbage's ")
        assert stopped.usage.completion_tokens == len(stopped.token_ids)
        assert stopped.token_ids == on.token_ids[: len(stopped.token_ids)]
        # the engine's measure of a proposed row's cost, fitted on the steps it ran
        samples = scrape(metrics_port)
        (row_cost,) = [v for (name, _), v in samples.items() if name == ROW_COST]
        assert row_cost >= 0.0
    finally:
        assert server.stop() == 0, server.log()
