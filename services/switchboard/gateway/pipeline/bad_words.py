"""``bad_words`` -> token-id sequences for the sampler (vLLM's rule).

Each word is tokenized twice, without and with a leading space, because a word at the start
of the text and one in the middle are different tokens in most vocabularies. The spaced form
is kept only when it is a different word token of the same length (otherwise it would ban
something else). The sampler bans a sequence's last token when the others end the output.

A word's tokens keep the engine's rules (``wire/field_rules.py``: at most ``MAX_TOKEN_LIST`` of
them, each in the vocabulary), checked as it is tokenized; a word whose text is too long to fit
is refused before (``check_bad_word_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

from switchboard.gateway.api_errors import invalid_argument
from switchboard.gateway.pipeline.api_field_rules import check_ids
from switchboard.gateway.text import Tokenizer
from switchboard.wire.field_rules import BAD_WORD_TOKENS as WORD_TOKENS
from switchboard.wire.field_rules import BAD_WORDS_IN_VOCABULARY as WORD_IDS


def check_bad_word_bytes(bad_words: Sequence[str], token_bytes: int) -> None:
    """Refuse a word too long to fit the token bound whatever its tokens: each token stands for
    at most ``token_bytes`` bytes of text (the tokenizer's longest)."""
    limit = WORD_TOKENS.api_limit * max(1, token_bytes)
    for i, word in enumerate(bad_words):
        size = len(word.encode())
        if size > limit:
            field = f"sampling.bad_words[{i}]"
            raise invalid_argument(
                field,
                f"{field}: at most {WORD_TOKENS.api_limit} {WORD_TOKENS.unit}: its {size} bytes "
                f"of text make more (the limit is {limit} bytes)",
            )


def tokenize_bad_words(
    tokenizer: Tokenizer, bad_words: Sequence[str], vocab_size: int
) -> list[list[int]]:
    """The token-id sequences to ban; INVALID_ARGUMENT for a word without tokens."""
    sequences: list[list[int]] = []
    for i, word in enumerate(bad_words):
        field = f"sampling.bad_words[{i}]"
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            shown = repr(word) if len(word) <= 40 else f"{word[:40]!r}..."  # errors stay short
            raise invalid_argument(field, f"{field} ({shown}) has no tokens")
        error = WORD_TOKENS.api_message(field, len(plain))
        if error is not None:
            raise invalid_argument(field, error)
        check_ids(WORD_IDS, field, plain, vocab_size)
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            check_ids(WORD_IDS, field, spaced, vocab_size)
            sequences.append(spaced)
    return sequences
