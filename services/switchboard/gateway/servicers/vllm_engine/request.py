"""vLLM's ``GenerateRequest`` -> ``switchboard.v1.GenerateRequest``, which the shared pipeline
(``pipeline/generate_call.py``) checks and runs as it does every other front's.

Only the shape changes here: proto3 zeros that mean "unset" in vLLM's servicer (``top_p`` 0,
``repetition_penalty`` 0, ``n`` 0) are left unset, vLLM's -1 for ``truncate_prompt_tokens``
becomes the model's length. Every value rule is the pipeline's; its errors name vLLM's fields
(``renamed``). What the engine cannot honour is refused with INVALID_ARGUMENT naming the field:
multimodal inputs, KV transfer (prefill/decode disaggregation), logprobs of the whole
vocabulary (-1). ``spaces_between_special_tokens`` is taken either way: the gateway detokenizes
with the fast tokenizer, which never puts spaces between special tokens (as vLLM's own fast
detokenizer); text only matters here for matching stop strings. ``grammar_from_first_token``
is taken either way: a constraint always starts at the first generated token.
"""

from __future__ import annotations

import re

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vllm_pb

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError, invalid_argument, not_supported

_CONSTRAINTS = ("json_schema", "regex", "grammar", "structural_tag", "json_object", "choice")
# switchboard.v1 field paths (prefixes) -> vLLM's, for the pipeline's errors.
_FIELD_PREFIXES = (
    ("structured_output.choice.values", "sampling_params.choice.choices"),
    ("token_ids.ids", "tokenized.input_ids"),
    ("truncate_prompt_tokens", "sampling_params.truncate_prompt_tokens"),
    ("structured_output.", "sampling_params."),
    ("sampling.", "sampling_params."),
    ("stopping.", "sampling_params."),
    ("output.", "sampling_params."),
)


def to_generate_request(
    request: vllm_pb.GenerateRequest, request_id: str, max_model_len: int
) -> pb.GenerateRequest:
    """The switchboard.v1 request for ``request``; ``ApiError`` for a field it cannot honour."""
    _refuse_unsupported(request)
    params = request.sampling_params
    out = pb.GenerateRequest(request_id=request_id)
    which = request.WhichOneof("input")
    if which == "text":
        out.text = request.text
    elif which == "tokenized":
        out.token_ids.ids.extend(request.tokenized.input_ids)
    # neither: the pipeline refuses a request without a prompt
    if request.HasField("data_parallel_rank"):
        if request.data_parallel_rank < 0:
            raise invalid_argument(
                "data_parallel_rank",
                f"data_parallel_rank must be >= 0, got {request.data_parallel_rank}",
            )
        out.data_parallel_rank = request.data_parallel_rank
    if params.HasField("truncate_prompt_tokens"):
        out.truncate_prompt_tokens = _truncation(params.truncate_prompt_tokens, max_model_len)
    _sampling(params, out.sampling)
    _stopping(params, out.stopping)
    _structured_output(params, out.structured_output)
    out.output.kind = pb.OUTPUT_KIND_DELTA if request.stream else pb.OUTPUT_KIND_FINAL_ONLY
    out.output.return_token_ids = True
    # Text is made only where it is needed: to match stop strings (the router detokenizes).
    out.output.detokenize = bool(params.stop)
    out.output.skip_special_tokens = params.skip_special_tokens
    if params.HasField("logprobs"):
        out.output.logprobs = _count("logprobs", params.logprobs)
    if params.HasField("prompt_logprobs"):
        out.output.prompt_logprobs = _count("prompt_logprobs", params.prompt_logprobs)
    return out


def renamed(error: ApiError) -> ApiError:
    """``error`` naming vLLM's field where the pipeline named its own."""
    for ours, theirs in _FIELD_PREFIXES:
        if error.field.startswith(ours):
            field = theirs + error.field[len(ours) :]
            message = re.sub(rf"(?<![\w.]){re.escape(error.field)}(?!\w)", field, error.message)
            return ApiError(
                error.code,
                message,
                reason=error.reason,
                field=field,
                retry_after_s=error.retry_after_s,
            )
    return error


def _refuse_unsupported(request: vllm_pb.GenerateRequest) -> None:
    for field in ("mm_inputs", "media_refs"):
        if request.HasField(field):
            raise not_supported(field, "multimodal input (this server's models are text-only)")
    if request.extra_mm_inputs:
        raise not_supported(
            "extra_mm_inputs", "multimodal input (this server's models are text-only)"
        )
    for field in ("kv_transfer_params", "kv_transfer_params_json"):
        if request.HasField(field):
            raise not_supported(field, "KV transfer (prefill/decode disaggregation)")


def _count(field: str, value: int) -> int:
    if value < 0:
        raise invalid_argument(
            f"sampling_params.{field}",
            f"sampling_params.{field}: {value} (every token of the vocabulary) is not "
            "supported; ask for the top N (0 to 20)",
        )
    return value


def _truncation(value: int, max_model_len: int) -> int:
    if value == -1:
        return max_model_len  # vLLM's -1: as many as the model takes
    if value < 1:
        raise invalid_argument(
            "sampling_params.truncate_prompt_tokens",
            f"sampling_params.truncate_prompt_tokens must be -1 or >= 1, got {value}",
        )
    return value


def _sampling(params: vllm_pb.SamplingParams, out: pb.SamplingParams) -> None:
    if params.HasField("temperature"):
        out.temperature = params.temperature
    if params.top_p:
        out.top_p = params.top_p
    if params.top_k:
        out.top_k = params.top_k
    if params.min_p:
        out.min_p = params.min_p
    if params.frequency_penalty:
        out.frequency_penalty = params.frequency_penalty
    if params.presence_penalty:
        out.presence_penalty = params.presence_penalty
    if params.repetition_penalty:
        out.repetition_penalty = params.repetition_penalty
    if params.HasField("seed"):
        out.seed = params.seed
    if params.n:
        out.n = params.n
    for token_id, bias in params.logit_bias.items():
        if token_id < 0:
            raise invalid_argument(
                "sampling_params.logit_bias",
                f"sampling_params.logit_bias: token id {token_id} is negative",
            )
        out.logit_bias[token_id] = bias


def _stopping(params: vllm_pb.SamplingParams, out: pb.StoppingCriteria) -> None:
    if params.HasField("max_tokens"):
        out.max_tokens = params.max_tokens
    out.min_tokens = params.min_tokens
    out.stop.extend(params.stop)
    out.stop_token_ids.extend(params.stop_token_ids)
    out.include_stop_str_in_output = params.include_stop_str_in_output
    out.ignore_eos = params.ignore_eos


def _structured_output(params: vllm_pb.SamplingParams, out: pb.StructuredOutput) -> None:
    which = params.WhichOneof("constraint")
    if which is None:
        return
    assert which in _CONSTRAINTS, which
    if which == "choice":
        out.choice.values.extend(params.choice.choices)
    elif which == "json_object":
        if not params.json_object:
            raise invalid_argument(
                "sampling_params.json_object", "sampling_params.json_object must be true if set"
            )
        out.json_object = True
    else:
        setattr(out, which, getattr(params, which))


def unimplemented(what: str) -> ApiError:
    return ApiError(grpc.StatusCode.UNIMPLEMENTED, what, reason="NOT_IMPLEMENTED")
