"""The rules of every sampling, stopping and logprobs knob: INVALID_ARGUMENT naming the field.

The bounds on single fields are the engine's own (``wire/field_rules.py``), applied here to the
API fields that feed them (``check_bounds``), so a request the engine would refuse never gets
past the gateway. The rest needs the model (token ids within its vocabulary) or is the
gateway's own (``MAX_N``: it fans the sequences out; the engine sees each alone).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import message

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.errors import invalid_argument
from switchboard.wire.engine_msgs import RepetitionDetectionParams
from switchboard.wire.field_rules import (
    BOUNDS,
    MAX_REPETITION_PATTERN_SIZE,
    MaxEntries,
    Range,
)

MAX_N = 64  # sequences per request (the gateway fans them out; the engine sees each alone)
# The bounds a client's fields feed (the API field, the rule), sizes first.
_API_BOUNDS = sorted(
    (
        (r.api, r)
        for r in BOUNDS
        if r.api is not None and not (isinstance(r, MaxEntries) and r.each)
    ),
    key=lambda pair: isinstance(pair[1], Range),
)


def check_bounds(request: pb.GenerateRequest) -> None:
    """Every bound of ``field_rules.BOUNDS`` on the API field that feeds it, if set (an unset
    field's default keeps them). Sizes first: they are the cheap ones, before any entry is read.
    A bad word's tokens are counted once it is tokenized (``bad_words.py``)."""
    for api, rule in _API_BOUNDS:
        value = api_value(request, api)
        if value is None:
            continue
        if isinstance(rule, MaxEntries):
            error = rule.api_message(api, len(value))
            if error is not None:
                raise invalid_argument(api, error)
            continue
        if rule.each:
            entries = [(f"{api}[{key}]", item) for key, item in value.items()]
        else:
            entries = [(api, value)]
        for field, item in entries:
            error = rule.api_message(field, item)
            if error is not None:
                raise invalid_argument(field, error)


def api_value(request: message.Message, path: str) -> Any:
    """The field at a dotted ``path`` of ``request``; None if it (or a message on the way) is
    unset. A repeated field or a map is returned as its container."""
    *parents, leaf = path.split(".")
    target = request
    for name in parents:
        if not target.HasField(name):
            return None
        target = getattr(target, name)
    field = target.DESCRIPTOR.fields_by_name[leaf]
    if field.has_presence and not target.HasField(leaf):
        return None
    return getattr(target, leaf)


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
    """The rules of ``sampling`` beyond the bounds ``check_bounds`` applies (unset knobs are not
    checked: their defaults are valid)."""
    if s.HasField("n") and not 1 <= s.n <= MAX_N:
        raise invalid_argument(
            "sampling.n", f"sampling.n must be in [1, {MAX_N}] (unset = 1), got {s.n}"
        )
    for token_id in s.logit_bias:
        if vocab_size and token_id >= vocab_size:
            field = f"sampling.logit_bias[{token_id}]"
            raise invalid_argument(
                field,
                f"{field}: token id {token_id} is out of range: the vocabulary has "
                f"{vocab_size} tokens",
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
    return RepetitionDetectionParams(min_size, rd.max_pattern_size, rd.min_count)
