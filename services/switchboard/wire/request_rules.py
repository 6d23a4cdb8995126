"""The rules an ``EngineCoreRequest`` must keep, for whoever sends or receives one.

The gateway checks the API request field by field (naming API fields in its errors) and uses
these bounds; the engine core checks every ADD it receives against ``check_engine_request``
before any of it reaches the scheduler or a worker, because a gateway is not the only process
that can reach its socket: a request that breaks a rule fails alone (finish reason ERROR, with
the rule it broke), it never kills the engine. Every check is cheap (list scans at C speed), so
it costs microseconds per request against the milliseconds of one step.

The caps bound the work one request can ask for: a top-N of logprobs is computed per token, a
bad word or a stop token id is matched per step.
"""

from __future__ import annotations

import math

from switchboard.structured_output import KINDS as STRUCTURED_OUTPUT_KINDS
from switchboard.structured_output import MAX_SPEC_CHARS as MAX_STRUCTURED_SPEC_CHARS
from switchboard.wire.engine_msgs import EngineCoreRequest, PoolingParams, SamplingParams

MAX_LOGPROBS = 20  # top-N alternatives per output / prompt token (vLLM's default cap)
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties (OpenAI)
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI
MAX_REPETITION_PATTERN_SIZE = 256
MAX_REPETITION_COUNT = 256
MAX_REQUEST_ID_CHARS = 256
MAX_TOKEN_LIST = 4096  # stop ids, allowed ids, logit-bias entries, bad words (each)
# A seed is handed to torch's generator, which takes what fits in 64 bits.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)  # the API's int32


class RequestRuleError(ValueError):
    """``field`` (a dotted path in the request) broke a rule; the message says which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_engine_request(request: EngineCoreRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise ``RequestRuleError`` for the first rule ``request`` breaks. ``vocab_size`` 0
    skips the token id range checks (a model that did not say)."""
    if not isinstance(request.request_id, str) or not 0 < len(request.request_id) <= (
        MAX_REQUEST_ID_CHARS
    ):
        raise RequestRuleError("request_id", f"must be 1 to {MAX_REQUEST_ID_CHARS} characters")
    prompt = request.prompt_token_ids
    if not 0 < len(prompt) <= max_model_len:
        raise RequestRuleError(
            "prompt_token_ids",
            f"{len(prompt)} tokens do not fit max_model_len {max_model_len} (or none given)",
        )
    check_token_ids("prompt_token_ids", prompt, vocab_size)
    output = request.output_token_ids
    if output:
        if request.sampling_params is None:
            raise RequestRuleError("output_token_ids", "only a sampling request has output")
        if len(prompt) + len(output) > max_model_len:
            raise RequestRuleError(
                "output_token_ids", f"prompt and output do not fit max_model_len {max_model_len}"
            )
        check_token_ids("output_token_ids", output, vocab_size)
    if not PRIORITY_RANGE[0] <= request.priority <= PRIORITY_RANGE[1]:
        raise RequestRuleError("priority", f"must fit a 32-bit integer, got {request.priority}")
    for unsupported in ("mm_features", "lora_request", "prompt_embeds"):
        if getattr(request, unsupported) is not None:
            raise RequestRuleError(unsupported, "is not supported by this engine")
    if request.sampling_params is not None and request.pooling_params is not None:
        raise RequestRuleError("pooling_params", "a request either samples or pools, not both")
    if request.sampling_params is not None:
        check_sampling_params(request.sampling_params, vocab_size, max_model_len)
    elif request.pooling_params is not None:
        check_pooling_params(request.pooling_params)
    else:
        raise RequestRuleError("sampling_params", "a request needs sampling or pooling params")


def check_token_ids(field: str, token_ids: list[int], vocab_size: int) -> None:
    """Every id in ``[0, vocab_size)``: the worker indexes its embedding with them."""
    if not token_ids:
        return
    low, high = min(token_ids), max(token_ids)
    if low < 0:
        raise RequestRuleError(field, f"token id {low} is negative")
    if vocab_size and high >= vocab_size:
        raise RequestRuleError(
            field, f"token id {high} is out of range: the vocabulary has {vocab_size} tokens"
        )


def check_sampling_params(s: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    _in_range("sampling_params.temperature", s.temperature, 0.0, math.inf)
    _in_range("sampling_params.top_p", s.top_p, 0.0, 1.0, low_open=True)
    _in_range("sampling_params.min_p", s.min_p, 0.0, 1.0)
    if s.top_k < -1:
        raise RequestRuleError("sampling_params.top_k", f"must be >= -1, got {s.top_k}")
    for knob in ("presence_penalty", "frequency_penalty"):
        _in_range(f"sampling_params.{knob}", getattr(s, knob), -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
    _in_range("sampling_params.repetition_penalty", s.repetition_penalty, 0.0, math.inf, True)
    if not 1 <= s.max_tokens <= max_model_len:
        raise RequestRuleError(
            "sampling_params.max_tokens", f"must be in [1, {max_model_len}], got {s.max_tokens}"
        )
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise RequestRuleError(
            "sampling_params.min_tokens",
            f"must be in [0, max_tokens = {s.max_tokens}], got {s.min_tokens}",
        )
    if s.seed is not None and not SEED_RANGE[0] <= s.seed <= SEED_RANGE[1]:
        raise RequestRuleError("sampling_params.seed", f"must fit 64 bits, got {s.seed}")
    for knob in ("stop_token_ids", "eos_token_ids", "allowed_token_ids"):
        ids = getattr(s, knob)
        if ids is not None:
            _short(f"sampling_params.{knob}", ids)
            check_token_ids(f"sampling_params.{knob}", ids, vocab_size)
    if s.allowed_token_ids is not None and not s.allowed_token_ids:
        raise RequestRuleError("sampling_params.allowed_token_ids", "must not be empty")
    if s.logit_bias is not None:
        _short("sampling_params.logit_bias", s.logit_bias)
        check_token_ids("sampling_params.logit_bias", list(s.logit_bias), vocab_size)
        for token_id, bias in s.logit_bias.items():
            _in_range(
                f"sampling_params.logit_bias[{token_id}]",
                bias,
                -MAX_ABS_LOGIT_BIAS,
                MAX_ABS_LOGIT_BIAS,
            )
    if s.bad_words_token_ids is not None:
        _short("sampling_params.bad_words_token_ids", s.bad_words_token_ids)
        for i, word in enumerate(s.bad_words_token_ids):
            field = f"sampling_params.bad_words_token_ids[{i}]"
            if not word:
                raise RequestRuleError(field, "a bad word has at least one token")
            _short(field, word)
            check_token_ids(field, word, vocab_size)
    for knob in ("logprobs", "prompt_logprobs"):
        value = getattr(s, knob)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise RequestRuleError(
                f"sampling_params.{knob}", f"must be in [0, {MAX_LOGPROBS}], got {value}"
            )
    so = s.structured_output
    if so is not None:
        field = "sampling_params.structured_output"
        if not isinstance(so.kind, str) or so.kind not in STRUCTURED_OUTPUT_KINDS:
            raise RequestRuleError(f"{field}.kind", f"must be one of {STRUCTURED_OUTPUT_KINDS}")
        if not isinstance(so.spec, str) or len(so.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise RequestRuleError(f"{field}.spec", f"at most {MAX_STRUCTURED_SPEC_CHARS} chars")
    rd = s.repetition_detection
    if rd is not None:
        field = "sampling_params.repetition_detection"
        if not 1 <= rd.min_pattern_size <= rd.max_pattern_size <= MAX_REPETITION_PATTERN_SIZE:
            raise RequestRuleError(
                field,
                f"needs 1 <= min_pattern_size <= max_pattern_size <= "
                f"{MAX_REPETITION_PATTERN_SIZE}, got {rd.min_pattern_size}..{rd.max_pattern_size}",
            )
        if not 2 <= rd.min_count <= MAX_REPETITION_COUNT:
            raise RequestRuleError(
                f"{field}.min_count",
                f"must be in [2, {MAX_REPETITION_COUNT}], got {rd.min_count}",
            )


def check_pooling_params(p: PoolingParams) -> None:
    if p.dimensions is not None and p.dimensions < 1:
        raise RequestRuleError("pooling_params.dimensions", f"must be >= 1, got {p.dimensions}")


def _in_range(field: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestRuleError(field, f"must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestRuleError(field, f"must be in {bracket}{low}, {high}], got {value}")


def _short(field: str, items: object) -> None:
    if len(items) > MAX_TOKEN_LIST:  # type: ignore[arg-type]
        raise RequestRuleError(field, f"at most {MAX_TOKEN_LIST} entries")
