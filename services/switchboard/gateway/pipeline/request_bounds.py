"""Bounded cost before work: what a request must pass before the gateway spends anything on it
(echoes a field into metadata, tokenizes its prompt, picks an engine).

* ``request_id`` (echoed in the ``x-request-id`` header), ``model`` (named in errors) and
  ``labels``: lengths and characters first, and an error about them never repeats them: a
  16 KiB or non-ASCII value would not fit (or not be allowed in) a header or trailer.
* The prompt's size in bytes, against ``max_model_len`` x the tokenizer's longest token in
  bytes (``longest_token_bytes``, once at start): each token covers at most that many bytes of
  text, so a longer prompt cannot fit and is refused before it is tokenized (a 16 MiB prompt
  would otherwise take a minute and gigabytes of tokenizer memory). A normalizer that deletes
  characters (control characters, whitespace runs) could in theory bring such a prompt under
  the limit; it is refused all the same, as is one that sets ``truncate_prompt_tokens``.
* ``data_parallel_rank`` beyond the deployment's engines: a permanent error (INVALID_ARGUMENT),
  not the UNAVAILABLE (retry) of an existing rank that is not ready.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import invalid_argument
from switchboard.gateway.text import Tokenizer
from switchboard.wire.field_rules import MAX_REQUEST_ID_CHARS

MAX_MODEL_CHARS = 256
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 128
MAX_LABEL_VALUE_CHARS = 1024


def _printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def check_request_id(request_id: str) -> None:
    """1 to 256 printable ASCII characters (it goes into the ``x-request-id`` header)."""
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS or not _printable_ascii(request_id):
        raise invalid_argument(
            "request_id",
            f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters "
            f"(got {len(request_id)} characters)",
        )


def check_model_name(model: str) -> None:
    """At most 256 printable ASCII characters ("" = the served model)."""
    if len(model) > MAX_MODEL_CHARS or not _printable_ascii(model):
        raise invalid_argument(
            "model",
            f"model must be at most {MAX_MODEL_CHARS} printable ASCII characters "
            f"(got {len(model)} characters)",
        )


def check_labels(labels: Mapping[str, str]) -> None:
    """At most 64 labels; keys 1 to 128 printable ASCII characters, values at most 1024
    characters without control characters."""
    if len(labels) > MAX_LABELS:
        raise invalid_argument("labels", f"at most {MAX_LABELS} labels (got {len(labels)})")
    for key, value in labels.items():
        if not 0 < len(key) <= MAX_LABEL_KEY_CHARS or not _printable_ascii(key):
            raise invalid_argument(
                "labels",
                f"a label key must be 1 to {MAX_LABEL_KEY_CHARS} printable ASCII characters",
            )
        if len(value) > MAX_LABEL_VALUE_CHARS or not value.isprintable():
            raise invalid_argument(
                "labels",
                f"a label value must be at most {MAX_LABEL_VALUE_CHARS} printable characters",
            )


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most text bytes one token can stand for: the longest token string in UTF-8 (an
    upper bound: a byte-level or SentencePiece token's string is at least as long as the text
    it decodes to). Computed once at start (about 0.1 s for a 150k vocabulary)."""
    strs = tokenizer.token_strs(range(tokenizer.vocab_size))
    return max([len(s.encode()) for s in strs if s] or [1])


def max_prompt_bytes(max_model_len: int, token_bytes: int) -> int:
    return max_model_len * max(1, token_bytes)


def _message_bytes(messages: Iterable[object]) -> int:
    return sum(m.ByteSize() for m in messages)  # type: ignore[attr-defined]


def prompt_bytes(request: pb.GenerateRequest) -> int:
    """The bytes of text the request asks to tokenize: its text, or its chat messages and the
    tools the chat template renders with them."""
    size = len(request.text.encode()) if request.WhichOneof("prompt") == "text" else 0
    messages = getattr(request, "messages", None)
    if messages:
        size += _message_bytes(messages)
    for tool in request.tools:
        function = tool.function
        size += len(function.name.encode()) + len(function.parameters.encode())
        size += len(function.description.encode())
    return size


def check_text_bytes(field: str, size: int, limit: int) -> None:
    if size > limit:
        raise invalid_argument(
            field,
            f"{field}: {size} bytes of text cannot fit max_model_len: the limit is {limit} "
            "bytes (max_model_len x the tokenizer's longest token)",
            reason="PROMPT_TOO_LONG",
        )


def check_data_parallel_rank(
    rank: int | None, num_engines: int, known_ranks: Iterable[int]
) -> None:
    """A pinned rank must be one of the deployment's: below its DP size (or a rank an engine
    has registered as); an existing rank that is not ready stays UNAVAILABLE (engine pool)."""
    if rank is None:
        return
    size = max([num_engines, *(r + 1 for r in known_ranks)])
    if not 0 <= rank < size:
        raise invalid_argument(
            "data_parallel_rank",
            f"data_parallel_rank {rank} is out of range: this deployment has {size} engine "
            f"core(s) (ranks 0 to {size - 1})",
            reason="DATA_PARALLEL_RANK_OUT_OF_RANGE",
        )
