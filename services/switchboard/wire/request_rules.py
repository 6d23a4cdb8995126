"""The rules an ``EngineCoreRequest`` must keep, for whoever sends or receives one.

The rules on single fields are data (``field_rules.py``: the bounds, and the fields of token
ids), applied here and by the gateway to the API fields that feed them; the rules here add
those between fields and the request's shape. The engine core checks every ADD it receives
against ``check_engine_request`` before any of it reaches the scheduler or a worker, because a
gateway is not the only process that can reach its socket: a request that breaks a rule fails
alone (finish reason ERROR, with the rule it broke), it never kills the engine. Every check is
cheap (list scans at C speed), so it costs microseconds per request against the milliseconds
of one step.
"""

from __future__ import annotations

from typing import Any

from switchboard.common.constraint_grammar import KINDS as STRUCTURED_OUTPUT_KINDS
from switchboard.wire.engine_msgs import EngineCoreRequest, PoolingParams, SamplingParams
from switchboard.wire.field_rules import (
    BOUNDS,
    MAX_ENGINE_REQUEST_ID_CHARS,
    MAX_REPETITION_PATTERN_SIZE,
    VOCABULARY,
)
from switchboard.wire.lora import check_lora_request


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
    prompt, output = request.prompt_token_ids, request.output_token_ids
    if not 0 < len(prompt) <= max_model_len:
        raise RequestRuleError(
            "prompt_token_ids",
            f"{len(prompt)} tokens do not fit max_model_len {max_model_len} (or none given)",
        )
    if output and request.sampling_params is None:
        raise RequestRuleError("output_token_ids", "only a sampling request has output")
    if len(prompt) + len(output) > max_model_len:
        raise RequestRuleError(
            "output_token_ids", f"prompt and output do not fit max_model_len {max_model_len}"
        )
    for unsupported in ("mm_features", "prompt_embeds"):
        if getattr(request, unsupported) is not None:
            raise RequestRuleError(unsupported, "is not supported by this engine")
    if request.lora_request is not None:
        try:
            check_lora_request(request.lora_request)
        except ValueError as exc:
            raise RequestRuleError("lora_request", str(exc)) from None
    if request.sampling_params is not None and request.pooling_params is not None:
        raise RequestRuleError("pooling_params", "a request either samples or pools, not both")
    if request.sampling_params is None and request.pooling_params is None:
        raise RequestRuleError("sampling_params", "a request needs sampling or pooling params")
    check_fields(request, vocab_size)
    if request.sampling_params is not None:
        check_sampling_params(request.sampling_params, max_model_len)
    if request.pooling_params is not None:
        check_pooling_params(request.pooling_params)


def check_fields(request: EngineCoreRequest, vocab_size: int) -> None:
    """Every rule of ``field_rules`` on the fields ``request`` sets: the bounds, then the
    token ids."""
    for rule in BOUNDS:
        for field, value in _wire_values(request, rule.wire, rule.each):
            why = rule.violation(value)
            if why is not None:
                raise RequestRuleError(field, why)
    for ids_rule in VOCABULARY:
        for field, ids in _wire_values(request, ids_rule.wire, ids_rule.each):
            why = ids_rule.violation(ids, vocab_size)
            if why is not None:
                raise RequestRuleError(field, why)


def _wire_values(request: EngineCoreRequest, path: str, each: bool) -> list[tuple[str, Any]]:
    """(field, value) at a dotted ``path`` of ``request``: none where it (or a struct on the
    way) is unset; with ``each``, one per entry (a mapping's values, named by key)."""
    value: Any = request
    for name in path.split("."):
        if value is None:
            return []
        value = getattr(value, name)
    if value is None:
        return []
    if not each:
        return [(path, value)]
    if isinstance(value, dict):
        return [(f"{path}[{key}]", item) for key, item in value.items()]
    return [(f"{path}[{i}]", item) for i, item in enumerate(value)]


def check_sampling_params(s: SamplingParams, max_model_len: int) -> None:
    """The rules between fields, and what a list must hold."""
    if s.max_tokens > max_model_len:
        raise RequestRuleError(
            "sampling_params.max_tokens", f"must be in [1, {max_model_len}], got {s.max_tokens}"
        )
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise RequestRuleError(
            "sampling_params.min_tokens",
            f"must be in [0, max_tokens = {s.max_tokens}], got {s.min_tokens}",
        )
    if s.allowed_token_ids is not None and not s.allowed_token_ids:
        raise RequestRuleError("sampling_params.allowed_token_ids", "must not be empty")
    for i, word in enumerate(s.bad_words_token_ids or ()):
        if not word:
            raise RequestRuleError(
                f"sampling_params.bad_words_token_ids[{i}]", "a bad word has at least one token"
            )
    so = s.structured_output
    if so is not None and so.kind not in STRUCTURED_OUTPUT_KINDS:
        raise RequestRuleError(
            "sampling_params.structured_output.kind", f"must be one of {STRUCTURED_OUTPUT_KINDS}"
        )
    rd = s.repetition_detection
    if rd is not None and not 1 <= rd.min_pattern_size <= rd.max_pattern_size:
        raise RequestRuleError(
            "sampling_params.repetition_detection",
            f"needs 1 <= min_pattern_size <= max_pattern_size <= "
            f"{MAX_REPETITION_PATTERN_SIZE}, got {rd.min_pattern_size}..{rd.max_pattern_size}",
        )


def check_pooling_params(p: PoolingParams) -> None:
    if p.dimensions is not None and p.dimensions < 1:
        raise RequestRuleError("pooling_params.dimensions", f"must be >= 1, got {p.dimensions}")
