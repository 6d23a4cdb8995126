"""`switchboard serve -tp 2` and `-pp 2` end to end: concurrent greedy requests through the real
gateway, engine core and split workers give transformers' tokens exactly.

The checkpoint ties its embeddings and has three layers, so the pipeline's stages are uneven and
its last stage holds its own copy of the tied LM head.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import grpc
import pytest
import torch

from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.client_calls import greedy_request, streamed_token_ids
from tests.e2e.server import start_server
from tests.tiny_checkpoint import make_tiny_llama

pytestmark = pytest.mark.slow

PROMPTS = [[0, 17, 250, 3], [0, *range(40, 70)], [0, 900, 3, 3, 3, 77, 512, 8]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(
        str(tmp_path_factory.mktemp("tiny-llama")), num_layers=3, tie_word_embeddings=True
    )


@pytest.fixture(scope="module")
def expected(tiny_model: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def greedy_tokens(target: str, prompt: list[int]) -> list[int]:
    request = greedy_request(prompt, MAX_TOKENS, return_token_ids=True)
    with grpc.insecure_channel(target) as channel:
        responses = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
        return streamed_token_ids(responses)


@pytest.mark.parametrize("topology", [("-tp", "2"), ("-pp", "2")], ids=["tp2", "pp2"])
def test_split_workers_serve_transformers_tokens(
    tiny_model: str, expected: list[list[int]], tmp_path: Path, topology: tuple[str, str]
) -> None:
    server = start_server(tiny_model, tmp_path, *topology, "--kv-cache-memory-bytes", str(8 << 20))
    try:
        workers = [t for t in server.titled_processes() if t.startswith("switchboard::Worker")]
        assert len(workers) == 2, server.titled_processes()
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: greedy_tokens(server.target, p), PROMPTS))
        assert got == expected
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert server.leftovers == [], "the run directory (rendezvous file included) must be removed"
