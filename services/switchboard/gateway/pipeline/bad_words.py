"""``bad_words`` -> token-id sequences for the sampler (vLLM's rule).

Each word is tokenized twice, without and with a leading space, because a word at the start
of the text and one in the middle are different tokens in most vocabularies. The spaced form
is kept only when it is a different word token of the same length (otherwise it would ban
something else). The sampler bans a sequence's last token when the others end the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from switchboard.gateway.errors import invalid_argument
from switchboard.gateway.pipeline.sampling_validation import check_token_ids
from switchboard.gateway.text import Tokenizer


def tokenize_bad_words(
    tokenizer: Tokenizer, bad_words: Sequence[str], vocab_size: int
) -> list[list[int]]:
    """The token-id sequences to ban; INVALID_ARGUMENT for a word without tokens."""
    sequences: list[list[int]] = []
    for i, word in enumerate(bad_words):
        field = f"sampling.bad_words[{i}]"
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise invalid_argument(field, f"{field} ({word!r}) has no tokens")
        check_token_ids(field, plain, vocab_size)
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            check_token_ids(field, spaced, vocab_size)
            sequences.append(spaced)
    return sequences
