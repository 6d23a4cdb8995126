"""The wire's rules on single fields, applied to the API fields that feed them, and the API's
own rules on its fields: INVALID_ARGUMENT naming the API field.

The bounds and the fields of token ids are the engine's own data (``wire/field_rules.py``), so a
request the engine would refuse never gets past the gateway. ``check_fields`` applies every one
whose wire value is the API field as sent; one whose wire value the gateway derives (the
truncated prompt, a bad word's tokens, a constraint's spec) is applied where it is derived, with
``check_ids`` or the rule's ``api_message``. The API's alone: ``n`` (the gateway fans the
sequences out; the engine sees each alone), bad words that are empty strings, and the
repetition-detection sizes (``min_pattern_size`` 0 means 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import message

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import invalid_argument
from switchboard.wire.engine_msgs import RepetitionDetectionParams
from switchboard.wire.field_rules import (
    BOUNDS,
    MAX_REPETITION_PATTERN_SIZE,
    VOCABULARY,
    InVocabulary,
    MaxEntries,
    Range,
)

MAX_N = 64  # sequences per request (the gateway fans them out; the engine sees each alone)
# The rules on API fields as sent: (the API field, the rule), sizes first (the cheap ones,
# before any entry is read).
_BOUNDS = sorted(
    ((rule.api, rule) for rule in BOUNDS if rule.api is not None and not rule.derived),
    key=lambda pair: isinstance(pair[1], Range),
)
_VOCABULARY = [(rule.api, rule) for rule in VOCABULARY if rule.api is not None and not rule.derived]


def check_fields(request: pb.GenerateRequest, vocab_size: int) -> None:
    """Every rule of ``wire/field_rules.py`` on the API fields the request sets (an unset
    field's default keeps them)."""
    for api, rule in _BOUNDS:
        value = api_value(request, api)
        if value is None:
            continue
        if isinstance(rule, MaxEntries):
            error = rule.api_message(api, len(value))
            if error is not None:
                raise invalid_argument(api, error)
            continue
        entries = [(f"{api}[{k}]", v) for k, v in value.items()] if rule.each else [(api, value)]
        for field, item in entries:
            error = rule.api_message(field, item)
            if error is not None:
                raise invalid_argument(field, error)
    for api, ids_rule in _VOCABULARY:
        ids = api_value(request, api)
        if ids:
            check_ids(ids_rule, api, ids, vocab_size)


def check_ids(
    rule: InVocabulary, field: str, ids: Sequence[int] | Mapping[int, Any], vocab_size: int
) -> None:
    """INVALID_ARGUMENT naming the first id of ``field`` outside the vocabulary."""
    error = rule.api_error(field, ids, vocab_size)
    if error is not None:
        raise invalid_argument(*error)


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


def check_sampling(s: pb.SamplingParams) -> None:
    """The API's own rules of ``sampling`` (unset knobs are not checked: their defaults are
    valid)."""
    if s.HasField("n") and not 1 <= s.n <= MAX_N:
        raise invalid_argument(
            "sampling.n", f"sampling.n must be in [1, {MAX_N}] (unset = 1), got {s.n}"
        )
    for i, word in enumerate(s.bad_words):
        if not word:
            raise invalid_argument(
                f"sampling.bad_words[{i}]", f"sampling.bad_words[{i}] must not be empty"
            )


def check_repetition_detection(rd: pb.RepetitionDetection) -> RepetitionDetectionParams:
    """``min_pattern_size`` 0 means 1; ``max_pattern_size`` >= it (``min_count``: a bound)."""
    field = "stopping.repetition_detection"
    min_size = max(1, rd.min_pattern_size)
    if rd.max_pattern_size < min_size:
        raise invalid_argument(
            f"{field}.max_pattern_size",
            f"{field}.max_pattern_size must be in [max(1, min_pattern_size), "
            f"{MAX_REPETITION_PATTERN_SIZE}] = [{min_size}, {MAX_REPETITION_PATTERN_SIZE}], "
            f"got {rd.max_pattern_size}",
        )
    return RepetitionDetectionParams(min_size, rd.max_pattern_size, rd.min_count)
