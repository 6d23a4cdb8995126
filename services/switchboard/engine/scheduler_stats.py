"""The scheduler's counters since start-up, and the stats made from them.

``SchedulerStats`` goes out with every step's outputs and every heartbeat (gateway metrics);
``get_stats`` answers the utility of that name with plain values an operator can read.
"""

from __future__ import annotations

import bisect

from switchboard.engine.kv_cache import KVCacheManager
from switchboard.wire.engine_msgs import ITERATION_TOKENS_BUCKETS, SchedulerStats


class SchedulerCounters:
    """Preemptions and tokens per step, cumulative since the scheduler was made."""

    def __init__(self) -> None:
        self.num_preemptions = 0
        self.last_step_tokens = 0
        # Tokens per step, as counts per ITERATION_TOKENS_BUCKETS bucket (+ one for more).
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    def record_step(self, num_tokens: int) -> None:
        self.last_step_tokens = num_tokens
        if num_tokens:
            bucket = bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)
            self.iteration_tokens_counts[bucket] += 1
            self.iteration_tokens_sum += num_tokens

    def record_preemption(self) -> int:
        """Count one preemption; returns the count so far."""
        self.num_preemptions += 1
        return self.num_preemptions

    def make_stats(self, num_running: int, num_waiting: int, kv: KVCacheManager) -> SchedulerStats:
        """Gauges now, counters cumulative since start-up, tokens of the last step."""
        return SchedulerStats(
            num_running,
            num_waiting,
            kv.usage(),
            kv.prefix_queries,
            kv.prefix_hits,
            self.num_preemptions,
            self.last_step_tokens,
            list(self.iteration_tokens_counts),  # a copy: the output thread encodes it later
            self.iteration_tokens_sum,
        )
