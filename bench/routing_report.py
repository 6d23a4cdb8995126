"""What ``bench/prefix_routing.py`` prints: each variant's hit rate, TTFT and throughput
against power of two choices, and where its prefix hits went, turn by turn, against the
workload's ideal.

The ideal: every turn serves from cache all it could — a conversation's first turn the shared
system prompt, every later turn the whole previous turn (its prompt and the answer computed
for it: all but the last answer token, which was sampled and never fed back) — in full
blocks, as a prefix cache keys them, and never the last prompt token (its logits are needed).
The token-level ideal (the previous turn's tokens, whole) says what the block granularity
costs.

Each turn's shortfall against the ideal is put down to one cause, from the engine that ran it
(``RequestMetrics.engine_id``) and the engine that ran the conversation's previous turn:

* ``moved``: it ran on another engine than its previous turn (the router sent it away);
* ``evicted``: it ran on the same engine, which no longer held the whole previous turn;
* ``first``: a conversation's first turn that missed part of the system prompt.

A conversation that a staggered slot picks up mid-way (its history never sent: cold on every
engine) has such a ``picked_up`` first turn, whose ideal is the system prompt alone; its
misses are the bench's warm-up, the same under every policy, so the hit rate is also shown
without those turns.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from bench.prefix_cache import RunResult, Sample


@dataclass(frozen=True)
class Turn:
    sample: Sample
    engine: str
    previous_engine: str | None  # None: the conversation's first turn sent
    picked_up: bool  # a first turn sent with a history that was never sent (staggered slot)
    ideal_tokens: int  # the most a prefix cache serves (full blocks)
    reusable_tokens: int  # the same, token by token


def ideal_hit(
    block_size: int, prompt_tokens: int, system_tokens: int, previous_computed: int | None
) -> tuple[int, int]:
    """(full-block ideal, token ideal) for a prompt of ``prompt_tokens`` whose conversation
    computed ``previous_computed`` tokens of it in its previous turn (None: first turn)."""
    reusable = system_tokens if previous_computed is None else previous_computed
    reusable = min(reusable, prompt_tokens - 1)
    return reusable // block_size * block_size, reusable


def cause(turn: Turn) -> str:
    if turn.previous_engine is None:
        return "first"
    return "evicted" if turn.engine == turn.previous_engine else "moved"


@dataclass
class Breakdown:
    """One policy's turns, summed (shares of all prompt tokens)."""

    turns: list[Turn]

    def rate(self, warm_only: bool = False) -> tuple[float, float]:
        """(hit rate, ideal hit rate), optionally without the picked-up turns."""
        turns = [t for t in self.turns if not (warm_only and t.picked_up)]
        prompt = sum(t.sample.prompt_tokens for t in turns)
        hits = sum(t.sample.cached_prompt_tokens for t in turns)
        return hits / prompt, sum(t.ideal_tokens for t in turns) / prompt

    def losses(self) -> dict[str, tuple[float, int]]:
        """Per cause: (missed tokens as a share of all prompt tokens, turns that missed)."""
        prompt = sum(t.sample.prompt_tokens for t in self.turns)
        missed: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for turn in self.turns:
            short = turn.ideal_tokens - turn.sample.cached_prompt_tokens
            if short > 0:
                missed[cause(turn)] += short
                count[cause(turn)] += 1
        return {c: (missed[c] / prompt, count[c]) for c in ("moved", "evicted", "first")}

    def moved_turns(self) -> int:
        return sum(t.previous_engine not in (None, t.engine) for t in self.turns)


def print_breakdown(results: dict[str, Breakdown]) -> None:
    """Ideal, hits and the losses per cause, as shares of the prompt tokens."""
    header = (
        f"{'routing':<16} | {'ideal (tok)':>11} | {'ideal':>6} | {'hit':>6} | "
        f"{'moved':>13} | {'evicted':>13} | {'first':>11} | {'warm hit/ideal':>14}"
    )
    print(header)
    print("-" * len(header))
    for name, breakdown in results.items():
        turns = breakdown.turns
        prompt = sum(t.sample.prompt_tokens for t in turns)
        reusable = sum(t.reusable_tokens for t in turns) / prompt
        hit, ideal = breakdown.rate()
        warm_hit, warm_ideal = breakdown.rate(warm_only=True)
        losses = breakdown.losses()
        cells = [f"{share:>6.1%} ({n:>4})" for share, n in losses.values()]
        print(
            f"{name:<16} | {reusable:>11.1%} | {ideal:>6.1%} | {hit:>6.1%} | "
            f"{cells[0]:>13} | {cells[1]:>13} | {cells[2]:>11} | "
            f"{warm_hit:>6.1%}/{warm_ideal:<6.1%}"
        )
    print(
        "(ideal (tok): the previous turns' tokens whole; ideal: in full blocks; losses: missed "
        "tokens as a share of all prompt tokens (turns); moved: ran on another engine than its "
        "previous turn; evicted: same engine, the previous turn no longer all cached; warm: "
        "without the picked-up turns of staggered slots; moved turns: "
        + ", ".join(f"{n} {b.moved_turns()}/{len(b.turns)}" for n, b in results.items())
        + ")"
    )


def print_table(results: dict[str, RunResult], baseline: str) -> None:
    """Per variant: hit rate, TTFT, throughput, and each one's ratios to ``baseline``."""
    header = (
        f"{'routing':<16} | {'prefix hit rate':>15} | {'TTFT p50 ms':>11} | "
        f"{'TTFT p90 ms':>11} | {'output tok/s':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, result in results.items():
        print(
            f"{name:<16} | {result.cached_share:>15.1%} | {result.ttft_ms(0.5):>11.1f} | "
            f"{result.ttft_ms(0.9):>11.1f} | {result.tokens_per_s:>12.1f}"
        )
    off = results[baseline]
    for name, on in results.items():
        if name == baseline:
            continue
        print(
            f"{(name + ' / p2')[:16]:<16} | {on.cached_share / off.cached_share:>15.2f} | "
            f"{on.ttft_ms(0.5) / off.ttft_ms(0.5):>11.2f} | "
            f"{on.ttft_ms(0.9) / off.ttft_ms(0.9):>11.2f} | "
            f"{on.tokens_per_s / off.tokens_per_s:>12.2f}"
        )
