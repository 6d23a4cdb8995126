"""Speculative decoding with a draft model, served: a tiny model with itself as the draft gives
the tokens of the same model served without speculation, greedy and seeded with ``n = 2``, and
its usage says that the proposals were accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.server import start_server
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

PROMPT = "def tokenize(text):\n    return [t for t in text.split() if t]\n"


def request(*, n: int = 1, seed: int | None = None) -> pb.GenerateRequest:
    message = pb.GenerateRequest(text=PROMPT)
    message.sampling.temperature = 0.0 if seed is None else 0.8
    if seed is not None:
        message.sampling.seed = seed
        message.sampling.top_k = 20
    message.sampling.n = n
    message.stopping.max_tokens = 24
    message.stopping.ignore_eos = True
    message.output.return_token_ids = True
    return message


def generate(server, message: pb.GenerateRequest) -> tuple[dict[int, list[int]], pb.Usage]:
    token_ids: dict[int, list[int]] = {}
    usage = pb.Usage()
    with server.channel() as channel:
        for response in pb_grpc.GenerationServiceStub(channel).Generate(message, timeout=300):
            for output in response.outputs:
                token_ids.setdefault(output.index, []).extend(output.token_ids)
            if response.HasField("usage"):
                usage = response.usage
    return token_ids, usage


def test_a_draft_model_served_keeps_the_tokens(tmp_path: Path) -> None:
    model = tiny_llama_dir()
    draft = json.dumps({"model": model, "num_speculative_tokens": 3})
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    on = start_server(model, tmp_path / "on", "--speculative-config", draft)
    try:
        off = start_server(model, tmp_path / "off")
        try:
            for message in (request(), request(n=2, seed=11)):
                on_tokens, usage = generate(on, message)
                off_tokens, _ = generate(off, message)
                assert on_tokens == off_tokens
                assert len(on_tokens) == message.sampling.n
                assert all(len(tokens) == 24 for tokens in on_tokens.values())
                assert usage.spec_draft_tokens > 0
                if message.sampling.temperature == 0.0:
                    assert usage.spec_accepted_tokens >= usage.spec_draft_tokens // 2
        finally:
            assert off.stop() == 0, off.log()
    finally:
        assert on.stop() == 0, on.log()
