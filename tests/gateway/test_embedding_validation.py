"""EmbedRequest -> pooling plan and engine prompts, or INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from switchboard.api.v1 import common_pb2
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.common.model_tasks import ModelTasks
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.model_facts import ModelFacts
from switchboard.gateway.pipeline.embed_validation import (
    MAX_EMBED_INPUTS,
    check_input_sizes,
    plan_embed,
    resolve_inputs,
    tokenize_inputs,
)
from switchboard.gateway.text import Tokenizer
from switchboard.wire.engine_msgs import PoolingParams, PoolingType

FACTS = ModelFacts(
    name="mini",
    model_path="/models/mini",
    max_model_len=8,
    vocab_size=300,
    eos_token_ids=(),
    bos_token_id=None,
    dtype="float32",
    generation_config={},
    sampling_defaults={},
    tasks=ModelTasks(encoder_only=True, pooling_type=PoolingType.MEAN, hidden_size=32),
)


def request(*inputs: str | list[int], **fields) -> pb.EmbedRequest:
    items = [
        pb.EmbedInput(text=x) if isinstance(x, str) else pb.EmbedInput(token_ids=pb.TokenIds(ids=x))
        for x in inputs
    ]
    return pb.EmbedRequest(inputs=items, **fields)


def rejected(build, field: str) -> ApiError:
    with pytest.raises(ApiError) as caught:
        build()
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.field == field, caught.value.message
    return caught.value


def test_defaults_come_from_the_checkpoint() -> None:
    plan = plan_embed(request("hello", [5, 6]), "r", FACTS)
    assert plan.pooling == PoolingParams(PoolingType.MEAN, normalize=True, dimensions=None)
    assert plan.inputs == ["hello", [5, 6]]


def test_explicit_normalize_and_dimensions_reach_the_engine() -> None:
    plan = plan_embed(request("x", normalize=False, dimensions=16), "r", FACTS)
    assert plan.pooling == PoolingParams(PoolingType.MEAN, normalize=False, dimensions=16)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": 33}, "dimensions"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"task": common_pb2.MODEL_TASK_CLASSIFY}, "task"),
        ({"task": 99}, "task"),
    ],
)
def test_bad_knobs_are_invalid_argument(fields: dict, field: str) -> None:
    rejected(lambda: plan_embed(request("x", **fields), "r", FACTS), field)


def test_an_empty_batch_and_an_empty_input_are_refused() -> None:
    rejected(lambda: plan_embed(request(), "r", FACTS), "inputs")
    empty = pb.EmbedRequest(inputs=[pb.EmbedInput(text="x"), pb.EmbedInput()])
    rejected(lambda: plan_embed(empty, "r", FACTS), "inputs[1]")


def test_unknown_model_is_not_found() -> None:
    with pytest.raises(ApiError) as caught:
        plan_embed(request("x", model="other"), "r", FACTS)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_inputs_are_truncated_and_checked_in_order() -> None:
    plan = plan_embed(request([1, 2, 3, 4, 5], [9], truncate_prompt_tokens=3), "r", FACTS)
    assert resolve_inputs(plan, [[1, 2, 3, 4, 5], [9]], FACTS) == [[3, 4, 5], [9]]


def test_too_long_out_of_vocabulary_and_empty_inputs_are_refused() -> None:
    plan = plan_embed(request("x", list(range(9))), "r", FACTS)
    error = rejected(
        lambda: resolve_inputs(plan, [[1], list(range(9))], FACTS), "inputs[1].token_ids.ids"
    )
    assert error.reason == "PROMPT_TOO_LONG"
    plan = plan_embed(request([1, 300]), "r", FACTS)
    rejected(lambda: resolve_inputs(plan, [[1, 300]], FACTS), "inputs[0].token_ids.ids[1]")
    plan = plan_embed(request(""), "r", FACTS)
    rejected(lambda: resolve_inputs(plan, [[]], FACTS), "inputs[0].text")


def test_texts_get_the_tokenizers_special_tokens(tmp_path) -> None:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4}
    hf = HfTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    # Like all-MiniLM-L6-v2's tokenizer.json: padding and truncation switched on in the file.
    hf.enable_padding(length=8, pad_id=0, pad_token="[UNK]")
    hf.enable_truncation(max_length=3)
    tokenizer = Tokenizer(hf)
    assert tokenize_inputs(tokenizer, ["hello world", [4, 4]]) == [[1, 3, 4, 2], [4, 4]]


def test_the_inputs_of_one_call_are_bounded() -> None:
    check_input_sizes(request(*["a"] * MAX_EMBED_INPUTS), 0)
    too_many = request(*["a"] * (MAX_EMBED_INPUTS + 1))
    error = rejected(lambda: check_input_sizes(too_many, 0), "inputs")
    assert f"at most {MAX_EMBED_INPUTS}" in error.message
    rejected(lambda: check_input_sizes(request("a", "b" * 65), 64), "inputs[1].text")
