"""UTILITY calls: the engine methods a gateway may call by name, and nothing else.

A gateway sends ``UtilityCall(client_index, call_id, method_name, args)``; the busy loop runs
it between steps with :func:`run_utility` and the answer goes back as a ``UtilityOutput``
tagged with ``call_id``. Only the names in :data:`UTILITIES` can be called: a peer that can
reach the engine's socket must not be able to reach arbitrary engine (or worker) methods the
way ``getattr`` would allow. Any other name, and any exception, becomes a failure reply; a
utility never takes the engine down.

Sleep (level 1) frees the workers' KV cache and keeps the model loaded; while asleep the
engine takes requests but schedules nothing, and ``wake_up`` re-creates the KV cache with the
same number of blocks so that the scheduler's block accounting stays valid.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from switchboard.wire.engine_msgs import UtilityCall, UtilityOutput

logger = logging.getLogger(__name__)


class UtilityTarget(Protocol):
    """What utilities need from the engine core (``EngineCore`` satisfies it)."""

    scheduler: Any
    executor: Any
    num_gpu_blocks: int
    block_size: int
    sleeping: bool


def reset_prefix_cache(core: UtilityTarget) -> bool:
    """Drop every cached block hash; False when blocks are still in use by requests."""
    return bool(core.scheduler.reset_prefix_cache())


def get_stats(core: UtilityTarget) -> dict[str, Any]:
    stats = dict(core.scheduler.get_stats())
    stats["is_sleeping"] = core.sleeping
    return stats


def is_sleeping(core: UtilityTarget) -> bool:
    return core.sleeping


def sleep(core: UtilityTarget, level: int = 1) -> None:
    """Free the KV cache on every worker; new requests wait until ``wake_up``."""
    if level != 1:
        raise ValueError(f"sleep level {level} is not supported (only level 1: free the KV cache)")
    if core.sleeping:
        return
    in_flight = core.scheduler.num_running + core.scheduler.num_waiting
    if in_flight:
        raise RuntimeError(f"cannot sleep with {in_flight} requests in flight")
    core.scheduler.reset_prefix_cache()  # cached blocks will not survive freeing the memory
    core.executor.free_kv_cache()
    core.sleeping = True
    logger.info("Engine asleep: KV cache freed (level 1)")


def wake_up(core: UtilityTarget) -> None:
    if not core.sleeping:
        return
    core.executor.initialize_kv_cache(core.num_gpu_blocks, core.block_size)
    core.sleeping = False
    logger.info("Engine awake: KV cache re-created with %d blocks", core.num_gpu_blocks)


UTILITIES: dict[str, Callable[..., Any]] = {
    "reset_prefix_cache": reset_prefix_cache,
    "get_stats": get_stats,
    "is_sleeping": is_sleeping,
    "sleep": sleep,
    "wake_up": wake_up,
}


def run_utility(core: UtilityTarget, call: UtilityCall) -> UtilityOutput:
    """Run one allow-listed utility; every failure becomes a failure reply."""
    method = UTILITIES.get(call.method_name)
    if method is None:
        logger.warning("Refused UTILITY call %r: not on the allow-list", call.method_name)
        return UtilityOutput(
            call.call_id, failure_message=f"method {call.method_name} is not allowed"
        )
    try:
        result = method(core, *call.args)
    except Exception as exc:
        logger.warning("UTILITY %s failed: %s", call.method_name, exc)
        return UtilityOutput(
            call.call_id, failure_message=f"Call to {call.method_name} method failed: {exc}"
        )
    return UtilityOutput(call.call_id, result=result)
