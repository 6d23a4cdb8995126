"""Each engine's KV events (``--kv-events-config``) followed into its prefix table
(``prefix_table.py``), so that prefix-aware routing knows what the engine's cache holds rather
than guessing it from the prompts this gateway sent.

Per engine that publishes events (its READY names the endpoints), one task: connect the SUB
socket, take the engine's snapshot (the ``get_cached_block_hashes`` utility: every cached
block hash and the number of its next event batch), then apply each batch in order
(``KvEventSubscriber.follow``: skipped batches replayed, the first one probed for). Batches
lost for good (no replay endpoint, or past its buffer), a broken socket or a failed snapshot
put the table back on the routed prompts alone, and the task starts over after
``RETRY_S``. The task ends when the engine dies or is replaced (a restarted engine is a new
handle, followed from its own READY on).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.engines.types import EngineHandle
from switchboard.wire.kv_event_subscriber import KvEventSubscriber, connectable

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
SNAPSHOT_TIMEOUT_S = 30.0
RETRY_S = 5.0

CallUtility = Callable[[EngineHandle, str, list[Any], float], Awaitable[Any]]


class CacheEventFollower:
    def __init__(self, call_utility: CallUtility) -> None:
        self._call_utility = call_utility
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[int, asyncio.Task[None]] = {}  # by id() of the engine handle
        self._running: set[asyncio.Task[None]] = set()  # those too that were told to stop

    def follow(self, engine: EngineHandle) -> None:
        """Start following ``engine``'s events, if it publishes any."""
        if not engine.ready.kv_events_endpoint or id(engine) in self._tasks:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        task = asyncio.get_running_loop().create_task(
            self._run(engine), name=f"kv-events-{engine.ready.data_parallel_rank}"
        )
        self._tasks[id(engine)] = task
        self._running.add(task)
        task.add_done_callback(lambda done: self._drop(id(engine), done))

    def forget(self, engine: EngineHandle) -> None:
        """``engine`` died or was replaced: stop following it."""
        task = self._tasks.pop(id(engine), None)
        if task is not None:
            task.cancel()
        engine.prefix_table.unfollow()

    def refollow(self, engine: EngineHandle) -> None:
        """``engine``'s cache was just emptied at this gateway's request: follow it again from
        a new snapshot, so that no event from before the reset, still on its way, is applied
        after it (its ``AllBlocksCleared`` comes later and would undo it only then)."""
        if id(engine) in self._tasks:
            self.forget(engine)
            self.follow(engine)

    def _drop(self, key: int, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        if self._tasks.get(key) is task:
            del self._tasks[key]

    async def close(self) -> None:
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _run(self, engine: EngineHandle) -> None:
        while engine.alive:
            try:
                await self._follow_once(engine)
            except (ApiError, zmq.ZMQError, OSError, KeyError, TypeError) as exc:
                logger.warning(
                    "KV events of engine %s: %s; routing on the prompts sent there until they "
                    "are followed again",
                    engine.engine_id,
                    exc,
                )
            engine.prefix_table.unfollow()
            await asyncio.sleep(RETRY_S)

    async def _follow_once(self, engine: EngineHandle) -> None:
        """Follow until batches are lost (returns) or something breaks (raises)."""
        assert self._ctx is not None
        ready = engine.ready
        replay = ready.kv_events_replay_endpoint
        subscriber = KvEventSubscriber(
            self._ctx,
            connectable(ready.kv_events_endpoint),
            connectable(replay) if replay else None,
            ready.kv_events_topic,
        )

        async def next_seq() -> int:
            return int((await self._snapshot(engine))["next_seq"])

        try:
            if not await subscriber.connected(CONNECT_TIMEOUT_S):
                raise OSError(f"{ready.kv_events_endpoint} not reached")
            snapshot = await self._snapshot(engine)
            table = engine.prefix_table
            table.follow_events(list(snapshot["block_hashes"]))
            subscriber.start_from(int(snapshot["next_seq"]))
            logger.info(
                "engine %s: routing follows its KV events (%d blocks cached)",
                engine.engine_id,
                len(table.cached or ()),
            )
            async for batches in subscriber.follow(next_seq):
                if subscriber.lost_batches:
                    logger.warning(
                        "KV events of engine %s: %d batch(es) lost; taking a new snapshot",
                        engine.engine_id,
                        subscriber.lost_batches,
                    )
                    return
                for _seq, batch in batches:
                    table.apply(batch)
        finally:
            subscriber.close()

    async def _snapshot(self, engine: EngineHandle) -> dict[str, Any]:
        reply = await self._call_utility(engine, "get_cached_block_hashes", [], SNAPSHOT_TIMEOUT_S)
        return dict(reply)
