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

``{"model": DIR, "num_speculative_tokens": 4}`` (or ``"method": "draft_model"``) proposes with a
smaller checkpoint that shares the served model's tokenizer, run greedily in the same worker
(``worker/draft_model.py``); the prompt lookup bounds do not apply to it.
:func:`check_draft_model` refuses, before anything loads, a draft whose vocabulary differs from
the served model's, one that is not a decoder family the workers run, and tensor or pipeline
parallelism (the draft runs whole in one worker).
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
METHODS = (NGRAM, DRAFT_MODEL)
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given
MAX_SPECULATIVE_TOKENS = 32
# The decoder families a draft may be (models/loader.py's, less the encoder; a test keeps the
# two in step), by architecture and by model_type for a config without "architectures".
DRAFT_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "GPT2LMHeadModel": "gpt2",
}
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    method: str = NGRAM
    model: str | None = None  # the draft model's checkpoint directory (draft_model)
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
        raw = {**raw, "method": DRAFT_MODEL}  # vLLM's form: a model means a draft model
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
    if config.method == DRAFT_MODEL:
        _check_draft_keys(config)
    elif config.model is not None:
        raise ValueError(
            f"--speculative-config: method {config.method!r} takes no model "
            f'(a draft model: "method": "{DRAFT_MODEL}")'
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


def _check_draft_keys(config: SpeculativeConfig) -> None:
    if not config.model:
        raise ValueError(
            f'--speculative-config: method "{DRAFT_MODEL}" needs "model": a checkpoint directory'
        )
    if config.prompt_lookup_min is not None or config.prompt_lookup_max is not None:
        raise ValueError(
            "--speculative-config: prompt_lookup_min and prompt_lookup_max are for the ngram "
            "method, not a draft model"
        )


def check_draft_model(
    config: SpeculativeConfig,
    target_dir: str,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_model_len: int | None = None,
) -> None:
    """Refuse a draft model that cannot propose for the served model at ``target_dir``
    (ValueError), from the checkpoints' JSON files alone: nothing is loaded."""
    if config.method != DRAFT_MODEL:
        return
    draft_dir = config.model or ""
    if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
        raise ValueError(
            "--speculative-config: a draft model runs in one worker; use -tp 1 -pp 1 "
            "(or the ngram method)"
        )
    draft = _read_config_json(draft_dir, "the draft model")
    target = _read_config_json(target_dir, "the model")
    architecture = (draft.get("architectures") or [""])[0]
    if architecture not in DRAFT_ARCHITECTURES and (
        architecture or draft.get("model_type") not in DRAFT_ARCHITECTURES.values()
    ):
        raise ValueError(
            f"--speculative-config: the draft model {draft_dir!r} "
            f"({architecture or draft.get('model_type')}) is not a decoder that can draft; "
            f"one of {', '.join(DRAFT_ARCHITECTURES)}"
        )
    draft_vocab, target_vocab = draft.get("vocab_size"), target.get("vocab_size")
    if draft_vocab != target_vocab:
        raise ValueError(
            f"--speculative-config: the draft model's vocabulary has {draft_vocab} tokens, "
            f"the model's {target_vocab}: a draft must share the model's tokenizer"
        )
    positions = max_model_len or _positions(target)
    if positions and _positions(draft) and _positions(draft) < positions:
        raise ValueError(
            f"--speculative-config: the draft model {draft_dir!r} has {_positions(draft)} "
            f"positions, fewer than the {positions} a request may reach: set --max-model-len "
            f"{_positions(draft)} or less"
        )
    draft_vocab_map = _tokenizer_vocab(draft_dir)
    target_vocab_map = _tokenizer_vocab(target_dir)
    if draft_vocab_map is not None and target_vocab_map is not None:
        if draft_vocab_map != target_vocab_map:
            raise ValueError(
                f"--speculative-config: the draft model {draft_dir!r} has another tokenizer "
                "than the model (tokenizer.json vocabularies differ): a draft must share it"
            )


def _positions(config: dict[str, Any]) -> int:
    """A checkpoint's positions (0: its config.json does not say)."""
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 0)


def _read_config_json(model_dir: str, what: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--speculative-config: {what}'s {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--speculative-config: {what}'s {path} is not a JSON object")
    return raw


def _tokenizer_vocab(model_dir: str) -> Any:
    """The token -> id map of the directory's ``tokenizer.json`` (its added tokens too);
    None when it has none to compare."""
    path = os.path.join(model_dir, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    model = raw.get("model") if isinstance(raw, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = [(t.get("id"), t.get("content")) for t in raw.get("added_tokens") or []]
    return (vocab, sorted(added, key=repr)) if vocab is not None else None
