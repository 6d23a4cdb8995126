"""``--speculative-config``: speculative decoding, configured with vLLM's JSON.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}``
proposes up to ``num_speculative_tokens`` tokens per step for each decoding request, copied from
where the last ``prompt_lookup_min..prompt_lookup_max`` tokens occurred before in its prompt or
output. As in vLLM, a lookup bound left out takes the other's value, and both default to 5.
``disable_by_batch_size`` (vLLM's key): no proposals in a step while more than this many requests
run; default ``DEFAULT_DISABLE_BY_BATCH_SIZE``, since on CPU a large batch is bound by compute,
not by reading the weights, and the proposals' extra rows then cost more than they save (at
c = 16 on 2 cores, SmolLM2: 0.76-0.92x of off with proposals, docs/benchmarks.md).
Unknown keys are refused, so a typo does not silently turn speculation off. Off when empty.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

NGRAM = "ngram"
METHODS = (NGRAM,)
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    method: str = NGRAM
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The validated config of ``--speculative-config`` (None: off). ValueError says what is
    wrong in words a person on the command line understands."""
    if not text.strip():
        return None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    if "model" in raw and "method" not in raw:
        raise ValueError(
            "--speculative-config: a draft model is not supported; use "
            '{"method": "ngram", "num_speculative_tokens": K}'
        )
    try:
        config = msgspec.convert(raw, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--speculative-config: {exc}") from None
    if config.method not in METHODS:
        raise ValueError(
            f"--speculative-config: method {config.method!r} is not supported (one of {METHODS})"
        )
    if not 1 <= config.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            "--speculative-config: num_speculative_tokens must be in "
            f"[1, {MAX_SPECULATIVE_TOKENS}], not {config.num_speculative_tokens}"
        )
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    assert low is not None and high is not None
    if not 1 <= low <= high:
        raise ValueError(
            "--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, "
            f"not {low} and {high}"
        )
    batch = config.disable_by_batch_size
    if batch is None:
        batch = DEFAULT_DISABLE_BY_BATCH_SIZE
    if batch < 1:
        raise ValueError(f"--speculative-config: disable_by_batch_size must be >= 1, not {batch}")
    return msgspec.structs.replace(
        config, prompt_lookup_min=low, prompt_lookup_max=high, disable_by_batch_size=batch
    )
