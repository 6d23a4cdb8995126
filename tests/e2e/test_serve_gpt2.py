"""`switchboard serve` with a GPT-2 checkpoint: a non-Llama family end to end, and the
checkpoint's generation_config.json defaults applied to the fields a request leaves unset.

The tiny GPT-2 checkpoint's generation_config.json says temperature 0 (greedy) and
max_new_tokens 6, so a request that sets neither gets 6 greedy tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.client_calls import greedy_request, streamed_token_ids
from tests.e2e.server import RunningServer, start_server
from tests.tiny_checkpoint import make_tiny_gpt2

pytestmark = pytest.mark.slow

DEFAULT_MAX_NEW_TOKENS = 6
PROMPTS = [
    [0, 17],
    [0, *range(40, 75)],  # several KV blocks
    [0, 900, 3, 3, 3, 77, 512, 8, 1000, 64, 2],
]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_tiny_gpt2(str(tmp_path_factory.mktemp("tiny-gpt2") / "ckpt"))
    config_path = os.path.join(path, "generation_config.json")
    with open(config_path) as f:
        generation_config = json.load(f)
    generation_config.update(temperature=0.0, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    with open(config_path, "w") as f:
        json.dump(generation_config, f)
    return path


@pytest.fixture(scope="module")
def stub(gpt2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    server: RunningServer = start_server(
        gpt2_dir, tmp_path_factory.mktemp("serve-gpt2"), "--block-size", "4"
    )
    try:
        with server.channel() as channel:
            yield pb_grpc.GenerationServiceStub(channel)
    finally:
        code = server.stop()
    assert code == 0, server.log()


def reference_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=2,
    )
    return out[0, len(prompt) :].tolist()


def generate_ids(stub, request: pb.GenerateRequest) -> tuple[list[int], pb.GenerateResponse]:
    request.output.return_token_ids = True
    messages = list(stub.Generate(request, timeout=60))
    return streamed_token_ids(messages), messages[-1]


def test_concurrent_greedy_requests_match_transformers(stub, gpt2_dir: str) -> None:
    def run(prompt: list[int]) -> list[int]:
        return generate_ids(stub, greedy_request(prompt, 20))[0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outputs = list(pool.map(run, PROMPTS))
    for prompt, ids in zip(PROMPTS, outputs, strict=True):
        assert ids == reference_greedy(gpt2_dir, prompt, 20)


def test_unset_fields_take_the_generation_config_defaults(stub, gpt2_dir: str) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[2]))
    request.stopping.ignore_eos = True
    ids, last = generate_ids(stub, request)
    assert len(ids) == DEFAULT_MAX_NEW_TOKENS
    assert last.outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert ids == reference_greedy(gpt2_dir, PROMPTS[2], DEFAULT_MAX_NEW_TOKENS)
