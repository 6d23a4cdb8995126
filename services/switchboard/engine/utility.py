"""UTILITY calls: the engine methods a gateway may call by name, and nothing else.

A gateway sends ``UtilityCall(client_index, call_id, method_name, args)``; the busy loop runs
it between steps with :func:`run_utility` and the answer goes back as a ``UtilityOutput``
tagged with ``call_id``. Only the names in :data:`UTILITIES` can be called: a peer that can
reach the engine's socket must not be able to reach arbitrary engine (or worker) methods the
way ``getattr`` would allow. Any other name, and any exception, becomes a failure reply; a
utility never takes the engine down.

Sleep frees device memory: level 1 the workers' KV cache, level 2 the model weights too.
Requests running at that moment are preempted (they are recomputed after waking, the same
as any preemption); while asleep the engine takes requests but schedules nothing. ``wake_up``
reloads the weights from the checkpoint (level 2) and re-creates the KV cache with the same
number of blocks, so the scheduler's block accounting stays valid.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from switchboard.common.log_limits import WarningLimit
from switchboard.wire.engine_msgs import UtilityCall, UtilityOutput

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)


class UtilityTarget(Protocol):
    """What utilities need from the engine core (``EngineCore`` satisfies it)."""

    scheduler: Any
    executor: Any
    num_gpu_blocks: int
    block_size: int
    sleeping: bool
    sleep_level: int
    kv_events: Any
    loras: Any  # engine/lora_registry.py's EngineLoras


def get_cached_block_hashes(core: UtilityTarget) -> dict[str, Any]:
    """The prefix cache's block hashes (sorted) and, with KV events on, ``next_seq``: the
    number the next event batch gets, so a subscriber that has applied every batch before it
    can compare its state with this one (-1: events off)."""
    hashes = sorted(core.scheduler.kv.pool.cached_hashes())
    next_seq = core.kv_events.next_seq if core.kv_events is not None else -1
    return {"block_hashes": hashes, "next_seq": next_seq}


def reset_prefix_cache(core: UtilityTarget) -> bool:
    """Drop every cached block hash; False when blocks are still in use by requests."""
    return bool(core.scheduler.reset_prefix_cache())


def get_stats(core: UtilityTarget) -> dict[str, Any]:
    stats = dict(core.scheduler.get_stats())
    stats["is_sleeping"] = core.sleeping
    stats["sleep_level"] = core.sleep_level
    return stats


def is_sleeping(core: UtilityTarget) -> bool:
    return core.sleeping


def sleep(core: UtilityTarget, level: int = 1) -> None:
    """Free the KV cache (level 1) and the weights (level 2) on every worker; requests wait
    until ``wake_up``. Sleeping deeper than now is allowed; shallower is a no-op."""
    if level not in (1, 2):  # JSON numbers may arrive as 2.0: compare by value
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    level = int(level)
    if core.sleeping and level <= core.sleep_level:
        return
    if not core.sleeping:
        num_preempted = core.scheduler.preempt_all()
        if num_preempted:
            logger.info("Preempted %d running requests to sleep", num_preempted)
        core.scheduler.reset_prefix_cache()  # cached blocks will not survive freeing the memory
    core.executor.sleep(level)
    core.sleeping = True
    core.sleep_level = level
    freed = "KV cache and weights" if level == 2 else "KV cache"
    logger.info("Engine asleep (level %d): %s freed; requests wait for wake_up", level, freed)


def wake_up(core: UtilityTarget) -> None:
    if not core.sleeping:
        return
    core.executor.wake_up()
    core.sleeping = False
    core.sleep_level = 0
    logger.info("Engine awake: KV cache re-created with %d blocks", core.num_gpu_blocks)


def add_lora(core: UtilityTarget, name: str, path: str) -> dict[str, Any]:
    """Every worker reads and checks the adapter; running requests go on meanwhile (between
    two steps). The adapter's description, or a failure naming the problem."""
    return dict(core.loras.add(name, path))


def remove_lora(core: UtilityTarget, name: str) -> None:
    """Refused while requests use the adapter (``engine/lora_registry.py`` says why)."""
    core.loras.remove(name, core.scheduler.requests.values())


def list_loras(core: UtilityTarget) -> dict[str, str]:
    return dict(core.loras.names())


UTILITIES: dict[str, Callable[..., Any]] = {
    "reset_prefix_cache": reset_prefix_cache,
    "get_stats": get_stats,
    "is_sleeping": is_sleeping,
    "sleep": sleep,
    "wake_up": wake_up,
    "get_cached_block_hashes": get_cached_block_hashes,
    "add_lora": add_lora,
    "remove_lora": remove_lora,
    "list_loras": list_loras,
}


def run_utility(core: UtilityTarget, call: UtilityCall) -> UtilityOutput:
    """Run one allow-listed utility; every failure becomes a failure reply."""
    method = UTILITIES.get(call.method_name)
    if method is None:
        limited.warning(
            "refused utility call",
            "Refused UTILITY call %r: not on the allow-list",
            call.method_name,
        )
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
