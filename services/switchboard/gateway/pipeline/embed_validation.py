"""The checks of an Embed call, in the order it runs them (``embed_call.py``):
``check_input_sizes`` bounds the work first (how many inputs, each text's bytes), ``plan_embed``
checks what needs no tokens (on the event loop), ``resolve_inputs`` truncates and checks every
input's tokens (the wire's rules on the prompt: ``wire/field_rules.py``, with the API's field
names).

Each input is one engine request, so a call is at most ``MAX_EMBED_INPUTS`` of them (OpenAI's
embeddings cap): ten thousand inputs kept the gateway's event loop busy for seconds, and a
hundred thousand ran past any reasonable deadline."""

from __future__ import annotations

import dataclasses

from switchboard.api.v1 import common_pb2
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import invalid_argument, not_supported
from switchboard.gateway.model_facts import ModelFacts
from switchboard.gateway.pipeline.api_field_rules import check_ids
from switchboard.gateway.pipeline.request_bounds import check_text_bytes
from switchboard.gateway.pipeline.validation import check_model
from switchboard.gateway.text import Tokenizer
from switchboard.wire.engine_msgs import PoolingParams
from switchboard.wire.field_rules import MAX_REQUEST_ID_CHARS, PROMPT_IN_VOCABULARY

_EMBED_TASKS = (common_pb2.MODEL_TASK_UNSPECIFIED, common_pb2.MODEL_TASK_EMBED)
MAX_EMBED_INPUTS = 2048


def check_input_sizes(request: pb.EmbedRequest, max_text_bytes: int) -> None:
    """At most ``MAX_EMBED_INPUTS`` inputs; each text no longer than ``max_text_bytes`` (what
    max_model_len tokens can cover; 0: unknown, not checked)."""
    if len(request.inputs) > MAX_EMBED_INPUTS:
        raise invalid_argument(
            "inputs",
            f"inputs: at most {MAX_EMBED_INPUTS} per call, got {len(request.inputs)}",
        )
    if not max_text_bytes:
        return
    for i, item in enumerate(request.inputs):
        if item.WhichOneof("input") == "text":
            check_text_bytes(f"inputs[{i}].text", len(item.text.encode()), max_text_bytes)


@dataclasses.dataclass(frozen=True)
class EmbedPlan:
    """A checked EmbedRequest, waiting for its texts' token ids."""

    request_id: str
    inputs: list[str | list[int]]  # per input: its text, or its token ids
    pooling: PoolingParams
    truncate_prompt_tokens: int | None


def plan_embed(request: pb.EmbedRequest, request_id: str, facts: ModelFacts) -> EmbedPlan:
    check_model(request.model, facts)
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid_argument(
            "request_id", f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters"
        )
    if request.task not in _EMBED_TASKS:
        if request.task not in common_pb2.ModelTask.values():
            raise invalid_argument("task", f"task: unknown ModelTask value {request.task}")
        raise not_supported("task", common_pb2.ModelTask.Name(request.task))
    if not request.inputs:
        raise invalid_argument("inputs", "inputs must hold at least one input")
    inputs: list[str | list[int]] = []
    for i, item in enumerate(request.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise invalid_argument(f"inputs[{i}]", f"inputs[{i}] has neither text nor token_ids")
        inputs.append(item.text if kind == "text" else list(item.token_ids.ids))
    tasks = facts.tasks
    dimensions = request.dimensions if request.HasField("dimensions") else None
    if dimensions is not None and not 1 <= dimensions <= (tasks.hidden_size or dimensions):
        raise invalid_argument(
            "dimensions",
            f"dimensions must be in [1, {tasks.hidden_size}] (the model's embedding size), "
            f"got {dimensions}",
        )
    truncate = (
        request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
    )
    if truncate is not None and truncate < 1:
        raise invalid_argument(
            "truncate_prompt_tokens", f"truncate_prompt_tokens must be >= 1, got {truncate}"
        )
    normalize = request.normalize if request.HasField("normalize") else tasks.normalize
    return EmbedPlan(
        request_id=request_id,
        inputs=inputs,
        pooling=PoolingParams(tasks.pooling_type, normalize, dimensions),
        truncate_prompt_tokens=truncate,
    )


def tokenize_inputs(tokenizer: Tokenizer, inputs: list[str | list[int]]) -> list[list[int]]:
    """Runs in the tokenizer pool: texts get the checkpoint's special tokens ([CLS]/[SEP] for
    BERT, BOS for Llama), token ids are taken as they are."""
    return [tokenizer.encode(x) if isinstance(x, str) else x for x in inputs]


def resolve_inputs(
    plan: EmbedPlan, token_ids: list[list[int]], facts: ModelFacts
) -> list[list[int]]:
    """Truncate and check every input's tokens; returns what the engine gets."""
    resolved = []
    for i, (given, ids) in enumerate(zip(plan.inputs, token_ids, strict=True)):
        field = f"inputs[{i}].text" if isinstance(given, str) else f"inputs[{i}].token_ids.ids"
        if plan.truncate_prompt_tokens is not None:
            ids = ids[-plan.truncate_prompt_tokens :]
        if not ids:
            raise invalid_argument(field, f"{field}: the input has no tokens")
        if len(ids) > facts.max_model_len:
            raise invalid_argument(
                field,
                f"{field}: the input has {len(ids)} tokens but max_model_len is "
                f"{facts.max_model_len} (set truncate_prompt_tokens to keep the last N)",
                reason="PROMPT_TOO_LONG",
            )
        if not isinstance(given, str):
            check_ids(PROMPT_IN_VOCABULARY, field, ids, facts.vocab_size)
        resolved.append(ids)
    return resolved
