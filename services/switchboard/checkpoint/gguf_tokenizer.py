"""Rebuild a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) from GGUF metadata.

A GGUF file keeps the tokenizer as arrays (`tokenizer.ggml.tokens`, `.merges`, `.token_type`),
special-token ids, and a *name* for the pre-tokenizer (`tokenizer.ggml.pre`) whose regexes live
in llama.cpp's source. Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are
supported; the pre-tokenizer name is mapped back to the HF pre-tokenizer it came from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from gguf import GGUFReader, TokenType
from tokenizers import Tokenizer

from switchboard.checkpoint.gguf_fields import field

log = logging.getLogger(__name__)

_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}

# llama.cpp's pre-tokenizer names -> the HF pre-tokenizer. The "smollm" family splits every
# digit on its own (llama.cpp's "\p{N}" regex) before GPT-2's byte-level split, which is HF's
# Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
_DIGITS_THEN_BYTE_LEVEL = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
}
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": _DIGITS_THEN_BYTE_LEVEL,
    "starcoder": _DIGITS_THEN_BYTE_LEVEL,
    "refact": _DIGITS_THEN_BYTE_LEVEL,
    "codeshell": _DIGITS_THEN_BYTE_LEVEL,
    "gpt2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
}

# Added tokens: CONTROL tokens are special (skipped when decoding with skip_special_tokens);
# USER_DEFINED ones are matched verbatim but decoded as text. llama.cpp's converter stores
# both in their raw (not byte-level-encoded) form, hence normalized=False.
_ADDED_TOKEN_TYPES = {int(TokenType.CONTROL): True, int(TokenType.USER_DEFINED): False}


def write_tokenizer_files(reader: GGUFReader, out_dir: Path, model_max_length: int) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for the GGUF's vocabulary."""
    tokenizer_json = build_tokenizer_json(reader)
    # Validate with the real library before writing: a bad JSON must fail here, not in a worker.
    Tokenizer.from_str(json.dumps(tokenizer_json))
    _write_json(out_dir / "tokenizer.json", tokenizer_json)
    _write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(reader, model_max_length))


def build_tokenizer_json(reader: GGUFReader) -> dict[str, Any]:
    """The `tokenizer.json` document (HF `tokenizers` serialisation format)."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, not {kind!r}")
    pre_name = field(reader, "tokenizer.ggml.pre", "default")
    pre_tokenizer = _PRE_TOKENIZERS.get(pre_name)
    if pre_tokenizer is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre_name!r} is not supported (known: {sorted(_PRE_TOKENIZERS)})"
        )
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges: list[str] = field(reader, "tokenizer.ggml.merges")

    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        if token in vocab:
            log.warning(
                "GGUF vocabulary repeats %r (ids %d, %d); keeping the first",
                token,
                vocab[token],
                token_id,
            )
            continue
        vocab[token] = token_id

    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, token_types),
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": _post_processor(reader, tokens),
        "decoder": {**_BYTE_LEVEL, "add_prefix_space": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,  # byte-level BPE can spell every input; it never needs <unk>
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [merge.split(" ", 1) for merge in merges],
        },
    }


def build_tokenizer_config(reader: GGUFReader, model_max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` transformers reads: special tokens and the chat template."""
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(entry["id"]): {k: v for k, v in entry.items() if k != "id"}
            for entry in _added_tokens(tokens, token_types)
        },
    }
    for role in ("bos", "eos", "unk", "pad"):
        key = "unknown" if role == "unk" else "padding" if role == "pad" else role
        token_id = field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{role}_token"] = tokens[token_id]
    chat_template = field(reader, "tokenizer.chat_template", None)
    if chat_template:
        config["chat_template"] = chat_template
    return config


def special_token_ids(reader: GGUFReader) -> dict[str, int]:
    """bos/eos/pad ids present in the metadata, keyed as config.json names them."""
    ids: dict[str, int] = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            ids[f"{role}_token_id"] = int(token_id)
    return ids


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[dict[str, Any]]:
    return [
        {
            "id": token_id,
            "content": tokens[token_id],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": _ADDED_TOKEN_TYPES[token_type],
        }
        for token_id, token_type in enumerate(token_types)
        if token_type in _ADDED_TOKEN_TYPES
    ]


def _post_processor(reader: GGUFReader, tokens: list[str]) -> dict[str, Any]:
    bos_id = field(reader, "tokenizer.ggml.bos_token_id", None)
    if not field(reader, "tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return {**_BYTE_LEVEL, "trim_offsets": False}
    bos = tokens[bos_id]
    first, second = ({"Sequence": {"id": name, "type_id": i}} for i, name in enumerate("AB"))
    return {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, first],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            first,
            {"SpecialToken": {"id": bos, "type_id": 1}},
            second,
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
