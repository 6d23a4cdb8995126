"""Wire ``TokenLogprobs`` (ids, logprobs, ranks) -> API ``TokenLogprob`` with decoded tokens.

A token's text is the token decoded alone, special tokens included (a byte-level token that
holds part of a UTF-8 character decodes to U+FFFD, as in vLLM). Decoding one id is cheap but
runs per alternative per token, so the texts are cached per tokenizer.
"""

from __future__ import annotations

import functools

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.text import Tokenizer
from switchboard.wire.engine_msgs import TokenLogprobs


@functools.lru_cache(maxsize=1 << 16)
def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def to_api_logprobs(
    entries: list[TokenLogprobs] | None, tokenizer: Tokenizer | None
) -> list[pb.TokenLogprob]:
    """One ``TokenLogprob`` per entry: the chosen token, with its alternatives in ``top``.
    ``tokenizer`` None leaves ``token`` empty (``output.detokenize`` false)."""
    results = []
    for entry in entries or ():
        tokens = [
            pb.TokenLogprob(
                token_id=token_id,
                logprob=logprob,
                rank=rank,
                token=token_text(tokenizer, token_id) if tokenizer is not None else "",
            )
            for token_id, logprob, rank in zip(
                entry.token_ids, entry.logprobs, entry.ranks, strict=True
            )
        ]
        if not tokens:
            continue
        chosen = tokens[0]
        chosen.top.extend(tokens[1:])
        results.append(chosen)
    return results
