"""The rules of every sampling, stopping and logprobs knob: INVALID_ARGUMENT naming the field.

Ranges follow vLLM and OpenAI where they have one (penalties in [-2, 2], logit bias in
[-100, 100], at most 20 logprobs); the caps that are ours (``MAX_N``, the repetition-detection
sizes) bound the work one request can ask of the engine.
"""

from __future__ import annotations

import math

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.errors import invalid_argument
from switchboard.wire.engine_msgs import RepetitionDetectionParams
from switchboard.wire.request_rules import (  # the bounds the engine enforces too
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGPROBS,
    MAX_REPETITION_COUNT,
    MAX_REPETITION_PATTERN_SIZE,
)

MAX_N = 64  # sequences per request (the gateway fans them out; the engine sees each alone)


def finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise invalid_argument(field, f"{field} must be a finite number, got {value}")
    return value


def check_token_ids(field: str, token_ids: list[int], vocab_size: int) -> None:
    if not vocab_size:
        return
    for i, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise invalid_argument(
                f"{field}[{i}]",
                f"{field}[{i}] = {token_id} is out of range: the vocabulary has {vocab_size} "
                "tokens",
            )


def check_sampling(s: pb.SamplingParams, vocab_size: int) -> None:
    """Every rule of ``sampling`` (unset knobs are not checked: their defaults are valid)."""
    if s.HasField("temperature") and finite("sampling.temperature", s.temperature) < 0:
        raise invalid_argument(
            "sampling.temperature", f"sampling.temperature must be >= 0, got {s.temperature}"
        )
    if s.HasField("top_p") and not 0 < finite("sampling.top_p", s.top_p) <= 1:
        raise invalid_argument("sampling.top_p", f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.HasField("top_k") and s.top_k < -1:
        raise invalid_argument(
            "sampling.top_k", f"sampling.top_k must be >= -1 (0 or -1 = off), got {s.top_k}"
        )
    if s.HasField("min_p") and not 0 <= finite("sampling.min_p", s.min_p) <= 1:
        raise invalid_argument("sampling.min_p", f"sampling.min_p must be in [0, 1], got {s.min_p}")
    for knob in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, knob)
        if s.HasField(knob) and abs(finite(f"sampling.{knob}", value)) > MAX_ABS_PENALTY:
            raise invalid_argument(
                f"sampling.{knob}",
                f"sampling.{knob} must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value}",
            )
    if (
        s.HasField("repetition_penalty")
        and finite("sampling.repetition_penalty", s.repetition_penalty) <= 0
    ):
        raise invalid_argument(
            "sampling.repetition_penalty",
            f"sampling.repetition_penalty must be > 0 (1 = off), got {s.repetition_penalty}",
        )
    if s.HasField("n") and not 1 <= s.n <= MAX_N:
        raise invalid_argument(
            "sampling.n", f"sampling.n must be in [1, {MAX_N}] (unset = 1), got {s.n}"
        )
    for token_id, bias in s.logit_bias.items():
        field = f"sampling.logit_bias[{token_id}]"
        if vocab_size and token_id >= vocab_size:
            raise invalid_argument(
                field,
                f"{field}: token id {token_id} is out of range: the vocabulary has "
                f"{vocab_size} tokens",
            )
        if abs(finite(field, bias)) > MAX_ABS_LOGIT_BIAS:
            raise invalid_argument(
                field,
                f"{field} must be in [-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}], got {bias}",
            )
    check_token_ids("sampling.allowed_token_ids", list(s.allowed_token_ids), vocab_size)
    for i, word in enumerate(s.bad_words):
        if not word:
            raise invalid_argument(
                f"sampling.bad_words[{i}]", f"sampling.bad_words[{i}] must not be empty"
            )


def check_repetition_detection(
    rd: pb.RepetitionDetection,
) -> RepetitionDetectionParams:
    """``min_pattern_size`` 0 means 1; ``max_pattern_size`` >= it; ``min_count`` >= 2."""
    field = "stopping.repetition_detection"
    min_size = max(1, rd.min_pattern_size)
    if not min_size <= rd.max_pattern_size <= MAX_REPETITION_PATTERN_SIZE:
        raise invalid_argument(
            f"{field}.max_pattern_size",
            f"{field}.max_pattern_size must be in [max(1, min_pattern_size), "
            f"{MAX_REPETITION_PATTERN_SIZE}] = [{min_size}, {MAX_REPETITION_PATTERN_SIZE}], "
            f"got {rd.max_pattern_size}",
        )
    if not 2 <= rd.min_count <= MAX_REPETITION_COUNT:
        raise invalid_argument(
            f"{field}.min_count",
            f"{field}.min_count must be in [2, {MAX_REPETITION_COUNT}], got {rd.min_count}",
        )
    return RepetitionDetectionParams(min_size, rd.max_pattern_size, rd.min_count)


def check_logprobs(o: pb.OutputOptions) -> None:
    for knob in ("logprobs", "prompt_logprobs"):
        if o.HasField(knob) and getattr(o, knob) > MAX_LOGPROBS:
            raise invalid_argument(
                f"output.{knob}",
                f"output.{knob} must be at most {MAX_LOGPROBS}, got {getattr(o, knob)}",
            )
