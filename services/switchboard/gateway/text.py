"""Text handling: the tokenizer, incremental detokenization and stop strings.

The engine core is tokens in, tokens out; all text lives here, in the gateway.

Incremental detokenization uses the prefix/read-offset scheme of TGI and vLLM: each step decodes
a small window of tokens twice, once without and once with the new tokens, and emits the
difference. The window starts a few tokens back so that decoders which strip a leading space
from the first token (SentencePiece's "▁") see the same context in both decodes. While the new
text ends in U+FFFD, the last token holds only part of a multi-byte UTF-8 character, and the
text is held back until the character is complete. Where the tokenizer's decoder is byte-level
(GPT-2's, Llama 3's, SmolLM's: the text is the UTF-8 of the tokens' bytes put together), several
tokens decode at once as they would one by one, and a stream that holds several steps for one
message decodes them once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import tokenizers

# How many tokens before the first new one are decoded along with it (for leading-space context).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A Hugging Face fast tokenizer loaded from a checkpoint's ``tokenizer.json``."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        # A tokenizer.json may switch padding and truncation on (all-MiniLM-L6-v2's pads every
        # input to 128 tokens and cuts it there): lengths are the server's business, so both
        # are off and a prompt's ids are exactly its tokens.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        # The text of a run of ids is the UTF-8 decoding of their bytes put together, so it
        # does not matter how they are grouped into decodes (text is a prefix of the text of
        # more ids once it does not end in an incomplete character). A SentencePiece decoder
        # (byte fallback, the leading-space rules) is not: a group there decodes one id at a time.
        self.byte_level = isinstance(tokenizer.decoder, tokenizers.decoders.ByteLevel)

    @classmethod
    def from_file(cls, path: str) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(path))

    @classmethod
    def from_model_dir(cls, model_dir: str) -> Tokenizer:
        return cls.from_file(os.path.join(model_dir, "tokenizer.json"))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tokenizer.id_to_token(t) or "" for t in token_ids]

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


class IncrementalDetokenizer:
    """Turns the token ids of one sequence, as they arrive, into text deltas."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only a window of ids is kept: [0, read_offset) was emitted already (it is decoded
        # again only as context), [read_offset, end) is not emitted yet.
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def extend(self, token_ids: Sequence[int]) -> str:
        """Add several tokens; return the text they complete, the same as ``step`` one by one
        would (two decodes for them all where the tokenizer is byte-level)."""
        if not self._tokenizer.byte_level:
            return "".join([self.step(token_id) for token_id in token_ids])
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the sequence: whatever is held back, even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[: self._read_offset])
        new_text = self._decode(self._ids)
        if not final and (
            len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
        ):
            return ""
        delta = new_text[len(prefix_text) :]
        # All of it is emitted now; the last few ids stay as the next window's context.
        del self._ids[: -min(_CONTEXT_TOKENS, len(self._ids))]
        self._read_offset = len(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class TextStream:
    """Detokenizes one sequence and applies its stop strings.

    Text is *released* to the client only when no stop string can still begin in it: without
    ``include_stop_str_in_output`` the last ``len(longest stop) - 1`` characters are held back
    until the next token shows they are not the start of a stop string, so a client never sees
    part of a stop string that later matches.

    Like vLLM, a stop string ends the sequence only if it ends in the text of an output token
    past the first ``min_tokens`` (the engine holds EOS and stop tokens back as long).
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = detokenizer
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        longest = max((len(s) for s in self._stop), default=0)
        self._holdback = 0 if include_stop_str_in_output else max(0, longest - 1)
        self.text = ""  # all text so far (cut at the stop string once one matched)
        self._released = 0
        self.stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    @property
    def num_tokens(self) -> int:
        """Tokens pushed before the stop string matched (all of them while none has)."""
        return self._num_tokens

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly released text. Tokens after a stop match are ignored."""
        if not self._stop:  # no token's text is looked at on its own
            self._num_tokens += len(token_ids)
            self._append(self._detokenizer.extend(token_ids))
            return self._release(everything=False)
        for token_id in token_ids:
            if self.stopped:
                break
            self._num_tokens += 1
            self._append(self._detokenizer.step(token_id))
        return self._release(everything=self.stopped)

    def finish(self) -> str:
        """The sequence ended: release everything held back."""
        if not self.stopped:
            self._append(self._detokenizer.flush())
        return self._release(everything=True)

    def _append(self, delta: str) -> None:
        if not delta:
            return
        new_from = len(self.text)
        self.text += delta
        if self._stop and self._num_tokens > self._min_tokens:
            self._match_stop(new_from)

    def _match_stop(self, new_from: int) -> None:
        """The earliest stop string that ends in the text from ``new_from`` on."""
        hits = [
            (i, s)
            for s in self._stop
            if (i := self.text.find(s, max(0, new_from - len(s) + 1))) >= 0
        ]
        if not hits:
            return
        index, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
        self.stop_string = stop
        self.text = self.text[: index + len(stop) if self._include_stop else index]

    def _release(self, everything: bool) -> str:
        end = len(self.text) if everything else max(self._released, len(self.text) - self._holdback)
        released = self.text[self._released : end]
        self._released = end
        return released
