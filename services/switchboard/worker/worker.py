"""The worker's RPC surface and its busy loop.

Busy loop: wait for the next :class:`RpcCall` on the ring -> call the method -> if this rank is
the call's ``output_rank``, send the :class:`RpcReply` to the engine. It leaves when ``shutdown``
is called, when asked to stop (a signal), or when the parent process is gone; every wait on the
ring is bounded so those checks happen at least once a second.

With ``-tp``/``-pp`` > 1 every worker of the engine runs every call (they read the same ring), so
their collectives line up call by call; see ``worker/distributed.py`` and ``models/parallel.py``.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

from switchboard.common.model_tasks import read_model_tasks
from switchboard.config import EngineConfig
from switchboard.models.loader import resolve_device
from switchboard.wire.codec import RPC_REPLY
from switchboard.wire.step_msgs import ModelRunnerOutput, ModelSummary, SchedulerOutput
from switchboard.worker.distributed import init_parallel_state
from switchboard.worker.draft_model import make_draft_model
from switchboard.worker.encoder_runner import EncoderRunner
from switchboard.worker.lora_runner import add_lora, lora_requests
from switchboard.worker.model_runner import ModelRunner
from switchboard.worker.rpc import dispatch_encoded
from switchboard.worker.step_threads import StepThreads

logger = logging.getLogger(__name__)

CPU_KV_CACHE_DEFAULT_BYTES = 1 << 30  # KV budget on CPU when the engine sets none
POLL_INTERVAL_S = 1.0  # longest wait on the ring between checks of the parent and signals


class Worker:
    """One device's model runner, driven by the engine through the methods in RPC_METHODS."""

    RPC_METHODS = frozenset(
        {
            "load_model",
            "determine_num_kv_blocks",
            "initialize_kv_cache",
            "execute_model",
            "free_kv_cache",
            "sleep",
            "wake_up",
            "shutdown",
            "ping",
            "add_lora",
            "remove_lora",
        }
    )

    def __init__(self, config: EngineConfig, rank: int, distributed_init_method: str = "") -> None:
        """``distributed_init_method``: where this engine's workers meet when there are
        several (``WorkerStartup.distributed_init_method``)."""
        self.config = config
        self.rank = rank
        self.device = resolve_device(
            config.worker.device, local_rank=config.first_device_index + rank
        )
        encoder = read_model_tasks(config.model.model).encoder_only
        if encoder and config.parallel.world_size > 1:
            raise ValueError(
                "encoder (embedding) models run on one worker: use -tp 1 -pp 1, and -dp to scale"
            )
        self.parallel = init_parallel_state(
            config.parallel, rank, distributed_init_method, self.device
        )
        self.runner: ModelRunner | EncoderRunner
        if encoder:
            self.runner = EncoderRunner(config.model, self.device)
        else:
            draft = make_draft_model(config, self.device)  # --speculative-config's, if any
            self.runner = ModelRunner(config.model, self.device, self.parallel, draft)
            if self.device.type == "cpu" and config.worker.adaptive_step_threads:
                self.runner.step_threads = StepThreads(
                    torch.get_num_threads(), torch.set_num_threads
                )
        self.shutdown_requested = False
        self._kv_cache_shape: tuple[int, int] | None = None  # (num_blocks, block_size)
        self.sleep_level = 0  # 0 awake; 1 KV cache freed; 2 weights dropped too
        logger.info("device %s (requested %r)", self.device, config.worker.device)

    def load_model(self) -> ModelSummary:
        return self.runner.load_model()

    def determine_num_kv_blocks(self, block_size: int, kv_cache_memory_bytes: int | None) -> int:
        """How many KV blocks fit: the given budget, else 1 GiB on CPU or a share of free
        device memory (``gpu_memory_utilization``) on CUDA. An encoder has no KV cache: its
        blocks are bookkeeping for the scheduler and cost nothing."""
        if isinstance(self.runner, EncoderRunner):
            max_num_seqs = self.config.scheduler.max_num_seqs
            return self.runner.num_bookkeeping_blocks(block_size, max_num_seqs)
        if kv_cache_memory_bytes is not None:
            budget, source = kv_cache_memory_bytes, "configured"
        elif self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            fraction = self.config.cache.gpu_memory_utilization
            budget, source = int(free_bytes * fraction), f"{fraction:.0%} of free device memory"
        else:
            budget, source = CPU_KV_CACHE_DEFAULT_BYTES, "CPU default"
        bytes_per_block = block_size * self.runner.kv_cache_bytes_per_token()
        num_blocks = budget // bytes_per_block
        logger.info(
            "KV budget %.1f MiB (%s): %d blocks of %d tokens",
            budget / 2**20,
            source,
            num_blocks,
            block_size,
        )
        # Several workers: each holds its layers' and its KV heads' share of every block, and
        # the engine hands out one block count, so every rank takes the smallest.
        agreed = self.parallel.min_over_ranks(num_blocks, self.device)
        if agreed != num_blocks:
            logger.info("%d blocks: the smallest count of all workers", agreed)
        return agreed

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, block_size)
        self._kv_cache_shape = (num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def free_kv_cache(self) -> None:
        self.runner.free_kv_cache()

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back: level 1 frees the KV cache (and every request's state),
        level 2 also drops the weights; ``wake_up`` restores both."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.runner.free_kv_cache()
        if level == 2 and self.runner.model is not None:
            self.runner.model = None
            gc.unfreeze()  # the model's objects were frozen with the rest (run_busy_loop)
            gc.collect()  # the weights are freed now, not at some later collection
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            logger.info("asleep (level 2): KV cache freed and weights dropped")
        else:
            logger.info("asleep (level %d): KV cache freed", level)
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """Reload the weights from the checkpoint if sleep dropped them, then re-create the KV
        cache with the shape it had, so the engine's block accounting stays valid."""
        if self.runner.model is None:
            self.runner.load_model()
        if self._kv_cache_shape is None:
            raise RuntimeError("wake_up before initialize_kv_cache")
        if not self.runner.kv_caches:
            self.runner.initialize_kv_cache(*self._kv_cache_shape)
        logger.info("awake (was asleep at level %d)", self.sleep_level)
        self.sleep_level = 0

    def shutdown(self) -> None:
        logger.info("shutdown requested by the engine")
        self.shutdown_requested = True

    def ping(self) -> str:
        return "pong"

    def add_lora(self, name: str, path: str) -> dict[str, Any]:
        """Read and check a LoRA adapter: ``{"adapter": description}`` or ``{"error": why}``
        (a refused adapter is an answer, not a failed call: nothing is disturbed)."""
        return add_lora(self.runner, name, path)

    def remove_lora(self, name: str) -> None:
        lora_requests(self.runner).manager.remove(name)


class RingReader(Protocol):
    def dequeue(self, timeout: float | None = None) -> bytes: ...


class ReplySender(Protocol):
    def send(self, data: bytes) -> object: ...


# The calls after which what the worker holds is what it serves with.
SET_UP_CALLS = frozenset({"initialize_kv_cache", "wake_up"})


def run_busy_loop(
    worker: Worker,
    reader: RingReader,
    replies: ReplySender,
    parent_pid: int,
    stop_requested: Callable[[], bool] = lambda: False,
    freeze_heap: bool = False,
) -> str:
    """Serve calls until told to stop; returns why it stopped (for the log). ``freeze_heap``
    (the worker process's own loop, not a test's): after each set-up call, what the process
    holds is frozen out of the garbage collector's full collections."""
    rank = worker.rank
    while True:
        if stop_requested():
            return "signal"
        try:
            payload = reader.dequeue(timeout=POLL_INTERVAL_S)
        except TimeoutError:
            if os.getppid() != parent_pid:
                return f"parent process {parent_pid} is gone"
            continue
        call, reply = dispatch_encoded(worker, Worker.RPC_METHODS, payload, rank)
        # A failure is always reported, whichever rank it happened on: otherwise the engine
        # would only learn of it from the execute timeout.
        if call.output_rank == rank or reply.error is not None:
            replies.send(RPC_REPLY.encode(reply))
        if freeze_heap and call.method in SET_UP_CALLS and reply.error is None:
            # Everything allocated while loading (the model's modules, torch's) is permanent
            # while serving: full collections skip it from now on. Steps allocate enough to
            # set collections off every few steps, and each full one walked that whole heap
            # (about 1.5 % of a served llama-100m worker's samples at 64 streams).
            gc.collect()
            gc.freeze()
        if worker.shutdown_requested:
            return "shutdown RPC"
