"""Engine-core start-up: load the model on the workers, size the KV cache and the context
length, build the READY message, then open the wire to the gateways (READY goes first).

``EngineCore.start`` runs these in order; the busy loop starts after them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from switchboard import __version__
from switchboard.common.model_tasks import read_model_tasks
from switchboard.config import EngineConfig, SchedulerConfig, with_step_budget
from switchboard.engine import clock, intake
from switchboard.engine.block_pool import BlockPool
from switchboard.engine.executor import MultiprocExecutor
from switchboard.engine.intake import GATEWAY_LOST
from switchboard.engine.io_threads import InputThread
from switchboard.engine.kv_event_publisher import KvEventPublisher
from switchboard.engine.kv_sizing import check_num_blocks, fit_max_model_len
from switchboard.engine.lora_registry import EngineLoras
from switchboard.engine.output_thread import OutputThread
from switchboard.engine.peers import EnginePeers
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import EngineReady
from switchboard.wire.step_msgs import ModelSummary

if TYPE_CHECKING:
    from switchboard.engine.core import EngineCore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SizedModel:
    """The model as loaded on the workers, with the KV cache sized and allocated."""

    summary: ModelSummary
    embed_only: bool  # an encoder: it embeds and cannot generate
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    scheduler_config: SchedulerConfig  # with the step budget for the workers' device

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def load_and_size(
    config: EngineConfig, executor: MultiprocExecutor, loras: EngineLoras
) -> SizedModel:
    """Load the model (and the --lora-modules: a bad one stops the engine here), size the KV
    cache from the override or the workers' memory budget, fit max_model_len to it, and
    allocate it on the workers."""
    block_size = config.cache.block_size
    summary = executor.load_model()
    loras.start(executor)
    embed_only = read_model_tasks(config.model.model).encoder_only
    if config.cache.num_gpu_blocks_override:
        num_blocks, source = config.cache.num_gpu_blocks_override, "--num-gpu-blocks-override"
    else:
        num_blocks = executor.determine_num_kv_blocks(
            block_size, config.cache.kv_cache_memory_bytes
        )
        source = "the workers' memory budget"
    num_gpu_blocks = check_num_blocks(num_blocks, block_size, source)
    max_model_len = fit_max_model_len(
        config.model.max_model_len, summary.max_position_embeddings, num_gpu_blocks * block_size
    )
    executor.initialize_kv_cache(num_gpu_blocks, block_size)
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d",
        num_gpu_blocks,
        block_size,
        num_gpu_blocks * block_size,
        max_model_len,
    )
    return SizedModel(
        summary,
        embed_only,
        num_gpu_blocks,
        block_size,
        max_model_len,
        with_step_budget(config.scheduler, summary.device_type, summary.few_rows_limit),
    )


def start_kv_events(
    ctx: zmq.Context[zmq.Socket[bytes]], config: EngineConfig, engine_index: int, pool: BlockPool
) -> KvEventPublisher | None:
    """The KV event publisher (--kv-events-config), started and recording ``pool``'s events;
    None when events are off."""
    events = config.cache.kv_events_config
    if events is None or not events.enabled:
        return None
    if not config.cache.enable_prefix_caching:
        logger.warning("KV events: prefix caching is off, no block will ever be stored")
    publisher = KvEventPublisher(ctx, events, engine_index)
    pool.events = []
    publisher.start()
    return publisher


def make_ready(
    config: EngineConfig,
    engine_id: str,
    model: SizedModel,
    events: KvEventPublisher | None,
) -> EngineReady:
    """READY, its clock fields left for ``stamp_ready`` to set when it is sent."""
    return EngineReady(
        engine_id=engine_id,
        data_parallel_rank=config.data_parallel_rank,
        max_model_len=model.max_model_len,
        num_gpu_blocks=model.num_gpu_blocks,
        block_size=model.block_size,
        kv_capacity_tokens=model.kv_capacity_tokens,
        wall_clock_ns=0,
        monotonic_ns=0,
        vocab_size=model.summary.vocab_size,
        dtype=model.summary.dtype,
        quantization=model.summary.quantization,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=model.scheduler_config.max_num_batched_tokens,
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        pipeline_parallel_size=config.parallel.pipeline_parallel_size,
        engine_version=__version__,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        # How a gateway subscribes to this engine's KV events ("" = off).
        kv_events_endpoint=events.endpoint if events else "",
        kv_events_replay_endpoint=(events.replay_endpoint or "") if events else "",
        kv_events_topic=events.topic if events else "",
    )


def stamp_ready(ready: EngineReady) -> EngineReady:
    """``ready`` with the clocks of now: one anchor for the gateway's clock offset."""
    wall_clock_ns, monotonic_ns = time.time_ns(), clock.monotonic_ns()
    return msgspec.structs.replace(ready, wall_clock_ns=wall_clock_ns, monotonic_ns=monotonic_ns)


def start_io_threads(core: EngineCore) -> None:
    """Open the wire to the gateways: the output thread, the input thread (it sends READY to
    each gateway first) and the peers (coordinator, discovered gateways). Each is stored on
    ``core`` as soon as it exists, so that ``teardown.shutdown`` stops it after a failure."""
    config = core.config
    core.output_thread = OutputThread(
        core.ctx,
        list(config.gateway_output_addresses),
        core.output_queue,
        core.engine_index,
        config.heartbeat_interval_s,
        core.on_io_thread_failure,
        engine_id=core.ready.engine_id,
        curve=core.curve_gateway,
        exit_after_frozen_s=config.exit_after_frozen_s,
    )
    core.input_thread = InputThread(
        core.ctx,
        list(config.gateway_input_addresses),
        zmq_channel.engine_identity(
            core.engine_index, os.urandom(8) if core.curve_gateway is not None else b""
        ),
        lambda: stamp_ready(core.ready),
        lambda request: intake.prepare_add(core, request),
        core.input_queue,
        core.aborts_queue,
        core.on_io_thread_failure,
        curve=core.curve_gateway,
        on_gateway_lost=lambda client_index: core.input_queue.put((GATEWAY_LOST, client_index)),
    )
    core.output_thread.start()
    core.input_thread.start()
    core.peers = EnginePeers(
        core.ctx,
        config,
        core.ready.engine_id,
        core.input_thread,
        core.output_queue,
        curve_gateway=core.curve_gateway,
        curve_coordinator=core.curve_coordinator,
    )
    core.peers.start()
