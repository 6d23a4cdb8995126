"""The rules an ``EngineCoreRequest`` must keep, for whoever sends or receives one.

The bounds on single fields are data (``field_rules.BOUNDS``), applied here and by the gateway
to the API fields that feed them; the rules here add what needs the model's numbers (token ids
in the vocabulary, lengths within max_model_len) and the rules between fields. The engine core
checks every ADD it receives against ``check_engine_request`` before any of it reaches the
scheduler or a worker, because a gateway is not the only process that can reach its socket: a
request that breaks a rule fails alone (finish reason ERROR, with the rule it broke), it never
kills the engine. Every check is cheap (list scans at C speed), so it costs microseconds per
request against the milliseconds of one step.
"""

from __future__ import annotations

from typing import Any

from switchboard.structured_output import KINDS as STRUCTURED_OUTPUT_KINDS
from switchboard.structured_output import MAX_SPEC_CHARS as MAX_STRUCTURED_SPEC_CHARS
from switchboard.wire.engine_msgs import EngineCoreRequest, PoolingParams, SamplingParams
from switchboard.wire.field_rules import (
    BOUNDS,
    MAX_ENGINE_REQUEST_ID_CHARS,
    MAX_REPETITION_PATTERN_SIZE,
)


class RequestRuleError(ValueError):
    """``field`` (a dotted path in the request) broke a rule; the message says which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_engine_request(request: EngineCoreRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise ``RequestRuleError`` for the first rule ``request`` breaks. ``vocab_size`` 0
    skips the token id range checks (a model that did not say)."""
    if not isinstance(request.request_id, str) or not 0 < len(request.request_id) <= (
        MAX_ENGINE_REQUEST_ID_CHARS
    ):
        raise RequestRuleError(
            "request_id", f"must be 1 to {MAX_ENGINE_REQUEST_ID_CHARS} characters"
        )
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
    check_bounds(request)
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


def check_bounds(request: EngineCoreRequest) -> None:
    """Every rule of ``field_rules.BOUNDS`` on the fields ``request`` sets."""
    for rule in BOUNDS:
        value = _wire_value(request, rule.wire)
        if value is None:
            continue
        if not rule.each:
            entries = [(rule.wire, value)]
        elif isinstance(value, dict):
            entries = [(f"{rule.wire}[{key}]", item) for key, item in value.items()]
        else:
            entries = [(f"{rule.wire}[{i}]", item) for i, item in enumerate(value)]
        for field, item in entries:
            why = rule.violation(item)
            if why is not None:
                raise RequestRuleError(field, why)


def _wire_value(request: EngineCoreRequest, path: str) -> Any:
    """The value at a dotted ``path`` of ``request``; None where a struct on the way is unset."""
    value: Any = request
    for name in path.split("."):
        if value is None:
            return None
        value = getattr(value, name)
    return value


def check_sampling_params(s: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """The rules that need the model's numbers, and those between fields (the bounds on single
    fields: ``check_bounds``)."""
    if not 1 <= s.max_tokens <= max_model_len:
        raise RequestRuleError(
            "sampling_params.max_tokens", f"must be in [1, {max_model_len}], got {s.max_tokens}"
        )
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise RequestRuleError(
            "sampling_params.min_tokens",
            f"must be in [0, max_tokens = {s.max_tokens}], got {s.min_tokens}",
        )
    for knob in ("stop_token_ids", "eos_token_ids", "allowed_token_ids"):
        ids = getattr(s, knob)
        if ids is not None:
            check_token_ids(f"sampling_params.{knob}", ids, vocab_size)
    if s.allowed_token_ids is not None and not s.allowed_token_ids:
        raise RequestRuleError("sampling_params.allowed_token_ids", "must not be empty")
    if s.logit_bias is not None:
        check_token_ids("sampling_params.logit_bias", list(s.logit_bias), vocab_size)
    for i, word in enumerate(s.bad_words_token_ids or ()):
        field = f"sampling_params.bad_words_token_ids[{i}]"
        if not word:
            raise RequestRuleError(field, "a bad word has at least one token")
        check_token_ids(field, word, vocab_size)
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


def check_pooling_params(p: PoolingParams) -> None:
    if p.dimensions is not None and p.dimensions < 1:
        raise RequestRuleError("pooling_params.dimensions", f"must be >= 1, got {p.dimensions}")
