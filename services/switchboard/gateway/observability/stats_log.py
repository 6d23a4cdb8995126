"""A periodic log line with this gateway's throughput and every engine's queue state.

Every ``interval_s`` (10 s by default, as vLLM's ``VLLM_LOG_STATS_INTERVAL``), when something
happened since the last line (tokens flowed, or an engine had requests), for example::

    Gateway_0: prompt 412.0 tokens/s, generation 96.5 tokens/s, 3 requests in flight |
    engine 0: running 3, waiting 1, KV cache 41.2%, prefix cache hit rate 62.0%, preemptions 0

With LoRA adapters in use, an engine's part ends with them: ``, LoRA running sql,chat waiting
summary``.

Throughput is this gateway's (each gateway logs its own); engine state is each live engine's
latest ``SchedulerStats``; the hit rate is over the interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from switchboard.gateway.engines.types import EngineHandle

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TokenCounts:
    """What this gateway's requests processed; the log line reads the deltas."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_in_flight: int = 0


class StatsLogger:
    def __init__(
        self,
        client_index: int,
        interval_s: float,
        counts: TokenCounts,
        engines: Callable[[], list[EngineHandle]],
    ) -> None:
        self._name = f"Gateway_{client_index}"
        self.interval_s = interval_s
        self._counts = counts
        self._engines = engines
        self._last_time = time.monotonic()
        self._last_prompt = counts.prompt_tokens
        self._last_generation = counts.generation_tokens
        self._last_prefix: dict[int, tuple[int, int]] = {}  # rank -> (queries, hits)
        self._was_busy = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            line = self.line(time.monotonic())
            if line is not None:
                logger.info("%s", line)

    def line(self, now: float) -> str | None:
        """The line for the interval ending now, or None when nothing happened (and nothing
        had happened in the interval before either: the first idle interval is still logged, so
        the gauges are seen to return to zero)."""
        counts = self._counts
        elapsed = max(now - self._last_time, 1e-9)
        prompt = counts.prompt_tokens - self._last_prompt
        generation = counts.generation_tokens - self._last_generation
        self._last_time = now
        self._last_prompt, self._last_generation = counts.prompt_tokens, counts.generation_tokens
        parts = [
            f"{self._name}: prompt {prompt / elapsed:.1f} tokens/s, generation "
            f"{generation / elapsed:.1f} tokens/s, {counts.requests_in_flight} requests in flight"
        ]
        busy = bool(prompt or generation or counts.requests_in_flight)
        for engine in sorted(self._engines(), key=lambda e: e.ready.data_parallel_rank):
            stats = engine.scheduler_stats
            if not engine.alive or stats is None:
                continue
            rank = engine.ready.data_parallel_rank
            queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            last_queries, last_hits = self._last_prefix.get(rank, (0, 0))
            if queries < last_queries:  # the engine restarted: its counters did too
                last_queries = last_hits = 0
            self._last_prefix[rank] = (queries, hits)
            new_queries = queries - last_queries
            hit_rate = 100.0 * (hits - last_hits) / new_queries if new_queries else 0.0
            busy = busy or bool(stats.num_running_reqs or stats.num_waiting_reqs)
            parts.append(
                f"engine {rank}: running {stats.num_running_reqs}, waiting "
                f"{stats.num_waiting_reqs}, KV cache {100.0 * stats.kv_cache_usage:.1f}%, "
                f"prefix cache hit rate {hit_rate:.1f}%, preemptions {stats.num_preemptions}"
                + _lora_part(stats.running_lora_adapters, stats.waiting_lora_adapters)
            )
        was_busy, self._was_busy = self._was_busy, busy
        return " | ".join(parts) if busy or was_busy else None


def _lora_part(running: list[str], waiting: list[str]) -> str:
    if not running and not waiting:
        return ""
    return f", LoRA running {','.join(running) or '-'} waiting {','.join(waiting) or '-'}"
