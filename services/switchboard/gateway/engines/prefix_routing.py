"""Prefix-aware routing across DP engines (``--routing-policy prefix``).

A request goes to the engine that holds the longest cached prefix of its prompt, unless it
gains too little there for what that engine's load costs. The gain is how much longer that
prefix is than the shortest any engine holds (a system prompt every engine holds gains
nothing), in tokens; the load difference ``d`` is that engine's score (``pool.engine_score``)
minus the least-loaded engine's. The prefix is followed when

    gain >= min_match_tokens * (1 + d)    and    d <= max_imbalance

so a gain under ``min_match_tokens`` is never followed, each request of imbalance asks for
``min_match_tokens`` more, and past ``max_imbalance`` nothing is. A long conversation stays on
its engine through some imbalance; a new one whose only cached part is a system prompt that
one engine holds goes there only while that engine is about as loaded as the others (so a
burst of them does not pile onto it). Otherwise power of two choices decides, as without this
policy. Among engines with the same longest prefix the least loaded wins. With
``running_weight`` below 1 the scores in ``d`` count each running request (decoding, or its
prefill under way) at that weight and each waiting one whole (``engine_score``): a decoding
request delays a newcomer's prefill by a token a step, a waiting one by its whole prompt, so a
conversation need not leave its cache for an engine that merely decodes fewer. What each engine
holds is its ``prefix_table.py``: the engine's KV events when they are followed, and the
prompts this gateway routed there (docs/operations.md, "Prefix-aware routing"); the prompt's
block hashes are recorded on the engine chosen, whatever chose it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from switchboard.gateway.engines.pool import engine_score, power_of_two
from switchboard.gateway.engines.types import EngineHandle
from switchboard.wire.block_hash import BlockHash, extend_block_hashes
from switchboard.wire.engine_msgs import EngineCoreRequest


@dataclass(frozen=True)
class PrefixRouting:
    min_match_tokens: int
    max_imbalance: float
    running_weight: float = 1.0

    def choose(
        self, live: list[EngineHandle], request: EngineCoreRequest, rng: random.Random
    ) -> EngineHandle:
        """The engine for ``request`` among ``live`` (two or more), its prompt recorded there."""
        block_size = live[0].ready.block_size
        hashes = _chain(request, block_size)
        engine = self._pick(live, hashes, block_size, rng) if hashes else power_of_two(live, rng)
        engine.prefix_table.record(hashes)
        return engine

    @staticmethod
    def record(engine: EngineHandle, request: EngineCoreRequest) -> None:
        """``request`` goes to ``engine`` whatever its prefix (its DP rank was pinned)."""
        engine.prefix_table.record(_chain(request, engine.ready.block_size))

    def _pick(
        self, live: list[EngineHandle], hashes: list[BlockHash], block_size: int, rng: random.Random
    ) -> EngineHandle:
        order = rng.sample(live, len(live))  # ties go to a random one, not always the first
        scores = {id(e): engine_score(e, self.running_weight) for e in order}
        matches = {id(e): e.prefix_table.match(hashes) for e in order}
        least = min(order, key=lambda e: scores[id(e)])
        best = max(order, key=lambda e: (matches[id(e)], -scores[id(e)]))
        gain_tokens = (matches[id(best)] - min(matches.values())) * block_size
        imbalance = max(0.0, scores[id(best)] - scores[id(least)])
        if imbalance > self.max_imbalance:
            return power_of_two(live, rng)
        if gain_tokens < max(1, self.min_match_tokens) * (1 + imbalance):
            return power_of_two(live, rng)
        return best


def _chain(request: EngineCoreRequest, block_size: int) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, request.prompt_token_ids, block_size, request.cache_salt)
    return hashes
