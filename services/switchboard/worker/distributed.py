"""Joining this engine's other workers in a ``torch.distributed`` process group.

Only when the engine runs more than one worker (``-tp``/``-pp`` > 1). The engine names the
rendezvous (``WorkerStartup.distributed_init_method``: a ``file://`` under its run directory or
a ``tcp://`` address); the backend is gloo on CPU and NCCL on CUDA. Every worker builds one TP
group per pipeline stage, all in the same order (``new_group`` is itself a collective).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from switchboard.config import ParallelConfig
from switchboard.models.parallel import SINGLE_PROCESS, ParallelState

logger = logging.getLogger(__name__)

# How long a collective (and the rendezvous) may wait for a peer. The engine gives up on a
# step much sooner (execute timeout) and then stops every worker, so this only bounds a worker
# left waiting on a peer that died.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel_state(
    parallel: ParallelConfig,
    rank: int,
    init_method: str,
    device: torch.device,
    timeout: timedelta = COLLECTIVE_TIMEOUT,
) -> ParallelState:
    """Join the group (when there is more than one worker) and say which share this rank is."""
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    world_size = tp_size * pp_size
    if world_size == 1:
        return SINGLE_PROCESS
    if not init_method:
        raise ValueError(f"{world_size} workers but no distributed_init_method to meet at")
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    logger.info(
        "joining %d workers (-tp %d -pp %d) as rank %d over %s at %s",
        world_size,
        tp_size,
        pp_size,
        rank,
        backend,
        init_method,
    )
    dist.init_process_group(
        backend, init_method=init_method, world_size=world_size, rank=rank, timeout=timeout
    )
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    if pp_size > 1 and tp_size > 1:
        for stage in range(pp_size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == pp_rank:
                tp_group = group
    state = ParallelState(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, tp_group=tp_group
    )
    logger.info("joined: TP rank %d of %d, PP stage %d of %d", tp_rank, tp_size, pp_rank, pp_size)
    return state


def leave_parallel_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
