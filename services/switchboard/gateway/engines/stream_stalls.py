"""Streams that pause: a stream that has had its first token and then gets none for longer than
``stall_warn_s`` while its engine is alive.

What is watched, and what is not:

* from a stream's first token on. Before it the request waits in the engine's queue or in its
  prefill, by design; the time to first token measures that wait. A stream resumed on another
  engine starts over there (``RequestRouter.count_on``).
* only while its engine is alive: a dead engine's streams are resumed or failed (``resume.py``),
  which says more. A frozen engine is alive until its heartbeat timeout, so a pause shorter than
  that is seen here first.
* a preempted stream pauses as its client sees it and is counted: the gateway learns of the
  preemption only with the stream's next output. The warning names the engine's preemptions
  and waiting requests, so such a cause is plain.

Each pause of a stream counts once (``on_stalled``, ``switchboard:request_stalls_total``); the
log gets one WARNING per engine while any of its streams is paused, with the engine's state as
this gateway sees it, and one INFO line once none is paused any more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from switchboard.gateway.engines.types import EngineHandle, RequestChannel

logger = logging.getLogger(__name__)


class StreamStalls:
    def __init__(
        self, stall_warn_s: float, channels: Callable[[], Iterable[RequestChannel]]
    ) -> None:
        self.stall_warn_s = stall_warn_s
        self.on_stalled: Callable[[EngineHandle], None] = lambda _engine: None
        self._channels = channels
        # By engine id, while any of its streams is paused: how many have paused since the
        # WARNING that opened it.
        self._pauses: dict[str, int] = {}

    async def run(self) -> None:
        if self.stall_warn_s <= 0:
            return
        period = max(0.05, min(1.0, self.stall_warn_s / 4))
        while True:
            await asyncio.sleep(period)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Count the streams paused since the last check; log an engine's first, and the end."""
        paused: dict[str, list[RequestChannel]] = {}  # by engine id, every stream paused now
        newly: dict[str, int] = {}  # by engine id, streams paused since the last check
        for channel in self._channels():
            engine = channel.engine
            since = channel.last_token_at
            if since is None or not channel.counted or not engine.alive:
                continue
            if now - since <= self.stall_warn_s:
                continue
            paused.setdefault(engine.engine_id, []).append(channel)
            if not channel.stalled:
                channel.stalled = True
                newly[engine.engine_id] = newly.get(engine.engine_id, 0) + 1
                self.on_stalled(engine)
        for engine_id, channels in paused.items():
            if engine_id in self._pauses:
                self._pauses[engine_id] += newly.get(engine_id, 0)
            else:
                self._pauses[engine_id] = len(channels)
                _warn(channels, now, self.stall_warn_s)
        for engine_id in [e for e in self._pauses if e not in paused]:
            logger.info(
                "engine %s: no stream is paused any more (%d stream(s) paused in all)",
                engine_id,
                self._pauses.pop(engine_id),
            )


def _warn(channels: list[RequestChannel], now: float, stall_warn_s: float) -> None:
    engine = channels[0].engine
    longest = max(now - (c.last_token_at or now) for c in channels)
    ids = ", ".join(repr(c.request_id) for c in channels[:5])
    more = f" and {len(channels) - 5} more" if len(channels) > 5 else ""
    logger.warning(
        "engine %s (DP rank %d): %d stream(s) got no token for more than %gs (longest %.1fs: "
        "%s%s) while the engine is alive; %s",
        engine.engine_id,
        engine.ready.data_parallel_rank,
        len(channels),
        stall_warn_s,
        longest,
        ids,
        more,
        engine_state(engine, now),
    )


def engine_state(engine: EngineHandle, now: float) -> str:
    """What this gateway knows of ``engine`` now, in words."""
    words = [
        f"last heard from {now - engine.last_seen:.1f}s ago",
        f"{engine.num_requests} request(s) of this gateway on it",
    ]
    stats = engine.scheduler_stats
    if stats is not None:
        words.append(
            f"its latest stats: running {stats.num_running_reqs}, waiting "
            f"{stats.num_waiting_reqs}, KV cache {stats.kv_cache_usage:.1%}, preemptions "
            f"{stats.num_preemptions}"
        )
        if stats.stalled_worker_rank >= 0:
            words.append(
                f"worker rank {stats.stalled_worker_rank} (pid {stats.stalled_worker_pid}) has "
                f"not answered a step for {stats.stalled_for_s:.1f}s"
            )
        else:
            words.append("no worker stalled")
    return "; ".join(words)
