"""The n-gram (prompt lookup) proposer: continue the text the way it continued before.

Take the last ``n`` tokens of prompt + output, for the longest ``n`` in
``prompt_lookup_min..prompt_lookup_max`` that occurred earlier, and propose the up to ``k`` tokens
that followed that earlier occurrence (its most recent one: recent text predicts best; where
they run into the end, the proposals continue the copy). Editing
code, rewriting or quoting a document, reformatting a record: the output copies long runs of the
prompt, and each proposal costs a dictionary lookup and a few comparisons.

:class:`TokenIndex` keeps, per request, where each token id occurs, updated as tokens arrive, so a
lookup looks at the occurrences of the last token only (the most recent ``MAX_CANDIDATES``).
"""

from __future__ import annotations

MAX_CANDIDATES = 64  # earlier occurrences of the last token compared per lookup


class TokenIndex:
    """Positions of every token id in a growing token list (the request's own list)."""

    __slots__ = ("_positions", "_length")

    def __init__(self) -> None:
        self._positions: dict[int, list[int]] = {}
        self._length = 0

    def update(self, token_ids: list[int]) -> None:
        """Index the tokens appended since the last call."""
        positions = self._positions
        for i in range(self._length, len(token_ids)):
            positions.setdefault(token_ids[i], []).append(i)
        self._length = len(token_ids)

    def occurrences(self, token_id: int) -> list[int]:
        return self._positions.get(token_id, [])


def propose_ngram(
    token_ids: list[int],
    index: TokenIndex,
    num_tokens: int,
    min_n: int,
    max_n: int,
) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``token_ids`` of ``min_n..max_n`` tokens; [] when none occurred."""
    index.update(token_ids)
    end = len(token_ids)
    if num_tokens <= 0 or end < min_n + 1:
        return []
    last = token_ids[-1]
    candidates = index.occurrences(last)
    best_start, best_len = -1, 0
    # The last occurrence is the suffix itself; earlier ones, newest first.
    for i in range(len(candidates) - 2, max(-1, len(candidates) - 2 - MAX_CANDIDATES), -1):
        pos = candidates[i]
        length = 1
        limit = min(max_n, pos + 1)
        while length < limit and token_ids[pos - length] == token_ids[end - 1 - length]:
            length += 1
        if length > best_len:
            best_start, best_len = pos + 1, length
            if length == max_n:
                break
    if best_len < min_n:
        return []
    return continuation(token_ids, best_start, num_tokens)


def continuation(token_ids: list[int], start: int, num_tokens: int) -> list[int]:
    """The ``num_tokens`` tokens from ``start``. One that runs into the end goes on with the
    proposals themselves (as an LZ77 copy overlapping its source): text repeating with a short
    period gets whole proposals."""
    proposals = token_ids[start : start + num_tokens]
    while len(proposals) < num_tokens:
        proposals.append(proposals[start + len(proposals) - len(token_ids)])
    return proposals
