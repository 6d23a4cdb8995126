"""The engine core: start-up, the busy loop, and its end.

Threads (docs/architecture.md, "Inside the engine core")::

    gateways ─DEALER─> InputThread ─input_queue─> busy loop ─output_queue─> OutputThread ─PUSH─┐
                          │                        ^  │                                   gateways
                          └──────aborts_queue──────┘  └─ executor ─shm ring─> workers

The busy loop (main thread) touches only the queues, the scheduler and the executor; all
socket I/O and (de)serialisation live on the I/O threads (``io_threads``).

Fate: a fatal error anywhere in the loop (a dead worker arrives as EXECUTOR_FAILED) logs
"EngineCore encountered a fatal error", sends ENGINE_CORE_DEAD to every gateway, stops the
workers and exits non-zero. SIGTERM/SIGINT, or the parent process dying (``shutdown``), stop
everything cleanly: threads, workers, the ring and the sockets. The process entry that wires
this together is ``__main__.run_engine_core``.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import shutil
import time
import uuid
from typing import Any, TypeVar

import msgspec
import zmq

from switchboard import __version__
from switchboard.common.log_limits import WarningLimit, report_suppressed
from switchboard.common.model_tasks import read_model_tasks
from switchboard.config import EngineConfig, new_run_dir, with_step_budget
from switchboard.engine import clock
from switchboard.engine.constrained_decoding import StructuredOutputManager, attach_bitmask
from switchboard.engine.executor import MultiprocExecutor, Stall, SubmittedStep
from switchboard.engine.io_threads import (
    InputQueue,
    InputThread,
    OutputThread,
    send_engine_dead_directly,
)
from switchboard.engine.kv_event_publisher import KvEventPublisher
from switchboard.engine.kv_sizing import check_num_blocks, fit_max_model_len
from switchboard.engine.lora_registry import EngineLoras
from switchboard.engine.peers import EnginePeers, engine_curve_keys
from switchboard.engine.request import Request
from switchboard.engine.scheduler import Scheduler
from switchboard.engine.shutdown import ShutdownRequest
from switchboard.engine.utility import run_utility
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    RequestType,
    SchedulerStats,
    UtilityCall,
)
from switchboard.wire.request_rules import check_engine_request
from switchboard.wire.step_msgs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)  # a client can have its requests refused on purpose

T = TypeVar("T")

DEAD_SEND_TIMEOUT_S = 5.0
IO_THREAD_FAILED = "io-thread-failed"  # input-queue kind: an I/O thread died, the engine follows
GRAMMAR_READY = "grammar-ready"  # input-queue kind: a structured-output grammar finished compiling
GATEWAY_LOST = "gateway-lost"  # input-queue kind: a gateway went away; payload its client_index


class EngineCore:
    def __init__(self, config: EngineConfig, shutdown: ShutdownRequest, input_queue: InputQueue):
        self.config = config
        self.engine_index = config.data_parallel_rank
        self.block_size = config.cache.block_size
        self.sleeping = False
        self.sleep_level = 0  # 1: KV cache freed; 2: weights dropped too (engine/utility.py)
        self.input_queue = input_queue
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._shutdown = shutdown
        self._own_run_dir = not config.run_dir
        if config.run_dir:
            zmq_channel.check_private_dir(config.run_dir)
        self.run_dir = config.run_dir or new_run_dir()
        # CURVE client keys toward the gateways and the coordinator (None: plain TCP); read
        # now, so that a broken keys directory fails before the model loads.
        self._curve_gateway, self._curve_coordinator = engine_curve_keys(config)
        self._ctx = zmq.Context()
        self.executor: MultiprocExecutor | None = None
        self._input_thread: InputThread | None = None
        self._output_thread: OutputThread | None = None
        self._peers: EnginePeers | None = None  # coordinator, discovered gateways
        self.kv_events: KvEventPublisher | None = None  # --kv-events-config
        self.structured_output: StructuredOutputManager | None = None
        # Constrained requests whose grammar is still compiling, in arrival order: they wait
        # here, outside the scheduler, so nobody behind them is held back.
        self._compiling: dict[str, Request] = {}
        # The step scheduled ahead (async scheduling): on the workers' ring, output not applied.
        self._ahead: _SentStep | None = None
        self.loras = EngineLoras.for_engine(config)

    def start(self) -> None:
        """Start the workers, load the model, size the KV cache, then open the wire to the
        gateways (READY goes first). ``shutdown`` cleans up after a failure here too."""
        config = self.config
        logger.info(
            "Loading model %s on %d worker(s)", config.model.model, config.parallel.world_size
        )
        self.executor = MultiprocExecutor(
            config, self.run_dir, self._on_executor_failure, self._on_worker_stall
        )
        logger.info("Workers ready: pids %s", [w.pid for w in self.executor.workers])
        summary = self.executor.load_model()
        self.loras.start(self.executor)  # --lora-modules: a bad one stops the engine here
        self.embed_only = read_model_tasks(config.model.model).encoder_only  # an encoder
        if config.cache.num_gpu_blocks_override:
            num_blocks, source = config.cache.num_gpu_blocks_override, "--num-gpu-blocks-override"
        else:
            num_blocks = self.executor.determine_num_kv_blocks(
                self.block_size, config.cache.kv_cache_memory_bytes
            )
            source = "the workers' memory budget"
        self.num_gpu_blocks = check_num_blocks(num_blocks, self.block_size, source)
        self.max_model_len = fit_max_model_len(
            config.model.max_model_len, summary.max_position_embeddings, self.kv_capacity_tokens
        )
        self.executor.initialize_kv_cache(self.num_gpu_blocks, self.block_size)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d",
            self.num_gpu_blocks,
            self.block_size,
            self.kv_capacity_tokens,
            self.max_model_len,
        )
        scheduler_config = with_step_budget(config.scheduler, summary.device_type)
        self.scheduler = Scheduler(
            scheduler_config,
            config.cache,
            self.num_gpu_blocks,
            self.max_model_len,
            max_loras=config.model.lora.max_loras if config.model.lora.enable_lora else 0,
        )
        self.structured_output = StructuredOutputManager(config.model.model, summary.vocab_size)
        self._start_kv_events()
        events = self.kv_events
        self._ready = EngineReady(
            engine_id=f"EngineCore_DP{self.engine_index}-{uuid.uuid4().hex[:8]}",
            data_parallel_rank=self.engine_index,
            max_model_len=self.max_model_len,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            kv_capacity_tokens=self.kv_capacity_tokens,
            wall_clock_ns=0,  # stamped when sent
            monotonic_ns=0,
            vocab_size=summary.vocab_size,
            dtype=summary.dtype,
            quantization=summary.quantization,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            tensor_parallel_size=config.parallel.tensor_parallel_size,
            pipeline_parallel_size=config.parallel.pipeline_parallel_size,
            engine_version=__version__,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            # How a gateway subscribes to this engine's KV events ("" = off).
            kv_events_endpoint=events.endpoint if events else "",
            kv_events_replay_endpoint=(events.replay_endpoint or "") if events else "",
            kv_events_topic=events.topic if events else "",
        )
        # Everything allocated while loading is permanent: full collections skip it from now on.
        gc.collect()
        gc.freeze()
        self._start_io_threads()
        if clock.TEST_CLOCK_OFFSET_NS:
            logger.warning(
                "test hook %s: every timestamp of this engine is offset by %d ns",
                clock.TEST_CLOCK_OFFSET_ENV,
                clock.TEST_CLOCK_OFFSET_NS,
            )
        logger.info("EngineCore_DP%d ready", self.engine_index)

    def _start_kv_events(self) -> None:
        events = self.config.cache.kv_events_config
        if events is None or not events.enabled:
            return
        if not self.config.cache.enable_prefix_caching:
            logger.warning("KV events: prefix caching is off, no block will ever be stored")
        self.kv_events = KvEventPublisher(self._ctx, events, self.engine_index)
        self.scheduler.kv.pool.events = []
        self.kv_events.start()

    def _publish_kv_events(self) -> None:
        """The KV events recorded since the last call, as one batch (none: nothing sent)."""
        if self.kv_events is None:
            return
        pool = self.scheduler.kv.pool
        if pool.events:
            self.kv_events.publish(pool.events)
            pool.events = []

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def _start_io_threads(self) -> None:
        self._output_thread = OutputThread(
            self._ctx,
            list(self.config.gateway_output_addresses),
            self.output_queue,
            self.engine_index,
            self.config.heartbeat_interval_s,
            self._on_io_thread_failure,
            engine_id=self._ready.engine_id,
            curve=self._curve_gateway,
            exit_after_frozen_s=self.config.exit_after_frozen_s,
        )
        self._input_thread = InputThread(
            self._ctx,
            list(self.config.gateway_input_addresses),
            zmq_channel.engine_identity(
                self.engine_index, os.urandom(8) if self._curve_gateway is not None else b""
            ),
            self._make_ready,
            self._prepare_add,
            self.input_queue,
            self.aborts_queue,
            self._on_io_thread_failure,
            curve=self._curve_gateway,
            on_gateway_lost=lambda client_index: self.input_queue.put((GATEWAY_LOST, client_index)),
        )
        self._output_thread.start()
        self._input_thread.start()
        self._peers = EnginePeers(
            self._ctx,
            self.config,
            self._ready.engine_id,
            self._input_thread,
            self.output_queue,
            curve_gateway=self._curve_gateway,
            curve_coordinator=self._curve_coordinator,
        )
        self._peers.start()

    def _make_ready(self) -> EngineReady:
        wall_clock_ns, monotonic_ns = time.time_ns(), clock.monotonic_ns()  # one clock anchor
        return msgspec.structs.replace(
            self._ready, wall_clock_ns=wall_clock_ns, monotonic_ns=monotonic_ns
        )

    def _prepare_add(self, request: EngineCoreRequest) -> Request | None:
        """Input thread: build the scheduler's request (and hash its prompt blocks) here, so
        the work overlaps with the forward pass. A bad request fails alone, with ERROR: the
        wire's rules are checked here, whoever sent it, before the scheduler or a worker sees
        any of it (``wire/request_rules.py``)."""
        try:
            check_engine_request(request, self._ready.vocab_size, self.max_model_len)
            if self.embed_only and request.pooling_params is None:
                raise ValueError("the model is an encoder: it embeds and cannot generate")
            prepared = Request.from_engine_core_request(
                request,
                self.block_size,
                clock.monotonic_ns(),
                hash_blocks=self.config.cache.enable_prefix_caching,
            )
            params = request.sampling_params
            if params is not None and params.structured_output is not None:
                assert self.structured_output is not None
                prepared.grammar = self.structured_output.start(  # compiles in the pool
                    params.structured_output,
                    params.eos_token_ids,
                    self._on_grammar_ready,
                    replay=request.output_token_ids or (),  # a resumed stream's tokens
                )
            return prepared
        except Exception as exc:
            self._reject(request.request_id, request.client_index, exc)
            return None

    def _reject(
        self, request_id: str, client_index: int, error: Exception, lora_not_loaded: str = ""
    ) -> None:
        """End one request with ERROR (called from the input thread or the busy loop)."""
        limited.warning("rejected request", "Rejected request %.300r: %s", request_id, error)
        failed = EngineCoreOutput(
            request_id,
            finish_reason=FinishReason.ERROR,
            stop_reason=str(error)[:1000],
            lora_not_loaded=lora_not_loaded,
        )
        self.output_queue.put((client_index, self._outputs([failed])))

    def _on_executor_failure(self, reason: str) -> None:
        """Monitor thread: hand the failure to the busy loop, which raises."""
        self.input_queue.put((RequestType.EXECUTOR_FAILED, reason))

    def _on_worker_stall(self, stall: Stall | None) -> None:
        """Busy loop, inside a step: a worker has not answered within the step timeout (or
        answered after all). The heartbeats the output thread sends meanwhile carry it, so the
        gateways stop routing here; the step's own outputs clear it."""
        if self._output_thread is None:
            return
        stats = self._output_thread.latest_stats or SchedulerStats()
        if stall is None:
            stats = msgspec.structs.replace(stats, stalled_worker_rank=-1, stalled_worker_pid=0)
        else:
            stats = msgspec.structs.replace(
                stats,
                stalled_worker_rank=stall.rank,
                stalled_worker_pid=stall.pid,
                stalled_for_s=stall.waited_s,
            )
        self._output_thread.latest_stats = stats

    def _on_grammar_ready(self) -> None:
        """Compile pool: wake the busy loop (it may be blocked on an empty input queue)."""
        self.input_queue.put((GRAMMAR_READY, None))

    def _on_io_thread_failure(self, reason: str) -> None:
        self.input_queue.put((IO_THREAD_FAILED, reason))

    # ---- the busy loop --------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Serve until shutdown is requested.

        Each turn: wait on the input queue while there is nothing to do (blocking, not
        spinning), take in everything else already queued, then run one step if there is
        work: schedule → execute on the workers → finish requests aborted during the forward
        pass → update the requests from the sampled tokens → put the outputs.

        With async scheduling (the default) the step after is scheduled and put on the ring
        before this one's output is awaited, so the workers go from one step straight to the
        next and the engine's turn (outputs, input, scheduling) overlaps their computing. The
        next step counts on the tokens in flight (``scheduler.py``, "scheduling ahead"). Not
        ahead of a constrained request (its grammar must see its last token before the mask
        of the next one) or of a utility call (its reply comes after the step's), nor while
        requests wait that a step could take (``_may_schedule_ahead``).
        """
        # Idle from the start: the coordinator lists us before any request.
        self._publish_stats(self.scheduler.make_stats())
        while not self._shutdown.requested:
            self._process_input_queue()
            stats = self._step() if self._has_work() else self.scheduler.make_stats()
            self._publish_stats(stats)
        logger.info("Shutdown requested (%s)", self._shutdown.reason)

    def _publish_stats(self, stats: SchedulerStats) -> None:
        """Once per turn, from one snapshot. Heartbeats carry the latest stats (a reference
        handed over, no lock needed), so a gateway's gauges return to zero when the engine goes
        idle. The coordinator (DP > 1) gets the load from the peers' reporter, which sends it
        when it changed, at most every 100 ms; here it is only compared and stored."""
        if self._output_thread is not None:
            self._output_thread.latest_stats = stats
        if self._peers is not None:
            self._peers.report_load(
                stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage
            )

    def _has_work(self) -> bool:
        # Finished ids still owed to the workers count as work: they free the workers' state.
        scheduler = self.scheduler
        return self._ahead is not None or (
            not self.sleeping
            and (scheduler.has_unfinished_requests() or scheduler.has_finished_requests())
        )

    def _process_input_queue(self) -> None:
        if not self._has_work():
            _drain(self.aborts_queue)  # idle: every abort also arrives on the input queue
            self._handle_input(*self.input_queue.get())
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_input(*item)

    def _handle_input(self, kind: RequestType | str, payload: Any) -> None:
        if kind == RequestType.ADD:
            self._add_request(payload)
        elif kind == RequestType.ABORT:
            self._abort(payload)
        elif kind == GRAMMAR_READY:
            self._admit_compiled()
        elif kind == GATEWAY_LOST:
            self._abort_requests_of(payload)
        elif kind == RequestType.UTILITY:
            self._run_utility(payload)
        elif kind == RequestType.EXECUTOR_FAILED:
            raise RuntimeError(f"Executor failed: {payload}")
        elif kind == IO_THREAD_FAILED:
            raise RuntimeError(f"Engine I/O failed: {payload}")
        # WAKEUP only unblocks the loop so that it sees a shutdown request.

    def _abort(self, request_ids: list[str] | str) -> None:
        if self._compiling:
            for rid in (request_ids,) if isinstance(request_ids, str) else request_ids:
                self._compiling.pop(rid, None)
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def _abort_requests_of(self, client_index: int) -> None:
        """A gateway went away: its requests' outputs have no reader, so they end now (their
        KV blocks are freed) rather than running to their last token."""
        requests = [*self.scheduler.requests.values(), *self._compiling.values()]
        ids = [r.request_id for r in requests if r.client_index == client_index]
        if ids:
            logger.warning(
                "Gateway %d went away: aborted its %d request(s)", client_index, len(ids)
            )
            self._abort(ids)

    def _add_request(self, request: Request) -> None:
        lora_refusal = self.loras.refusal(request)  # here, in order with remove_lora
        if lora_refusal is not None:
            self._reject(
                request.request_id,
                request.client_index,
                LookupError(lora_refusal),
                lora_not_loaded=request.lora_name,
            )
            return
        grammar = request.grammar
        if grammar is not None:
            if request.request_id in self._compiling:
                self._reject(
                    request.request_id,
                    request.client_index,
                    ValueError(f"request {request.request_id!r} is already in the engine"),
                )
                return
            if not grammar.ready:
                self._compiling[request.request_id] = request  # GRAMMAR_READY admits it
                return
            error = grammar.resolve()
            if error is not None:  # e.g. a bad spec that came in on the wire
                self._reject(request.request_id, request.client_index, ValueError(error))
                return
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:  # e.g. a request id already in flight: fail it alone
            self._reject(request.request_id, request.client_index, exc)

    def _admit_compiled(self) -> None:
        """Move the requests whose grammar is ready to the scheduler, in arrival order."""
        ready = [r for r in self._compiling.values() if r.grammar.ready]
        for request in ready:
            del self._compiling[request.request_id]
            self._add_request(request)

    def _step(self) -> SchedulerStats:
        """One step; returns the stats it sent with the outputs (the turn publishes them too).
        The step is the one scheduled ahead in the last turn, if any; the next one is
        scheduled ahead now, if it may be."""
        current = self._ahead if self._ahead is not None else self._schedule_and_submit()
        self._ahead = None
        if self._may_schedule_ahead():
            ahead = self._schedule_and_submit()
            if ahead.submitted is not None:
                self._ahead = ahead
            else:  # nothing to run ahead (say every request ends with its pending token)
                self.scheduler.update_from_output(ahead.output, _no_output(ahead.output))
        return self._finish(current)

    def _schedule_and_submit(self) -> _SentStep:
        scheduler_output = self.scheduler.schedule()
        if self.structured_output is not None:
            attach_bitmask(self.structured_output, scheduler_output, self.scheduler.requests)
        if scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_request_ids:
            assert self.executor is not None  # started before the busy loop
            return _SentStep(scheduler_output, self.executor.submit_step(scheduler_output))
        return _SentStep(scheduler_output, None)

    def _may_schedule_ahead(self) -> bool:
        """Not while requests wait that a step could take: arrivals come in bursts (clients
        whose requests ended together send their next ones together), and a step scheduled
        ahead now would make the rest of the burst wait a whole step more. The next step is
        scheduled when this one ends instead, with every request that arrived meanwhile
        (tiny-llama, 32 streams, alternated runs: TTFT p50 73 -> 63 ms mean of 4, 87 -> 83 ms
        mean of 6 in a slower spell of the VM; throughput level)."""
        scheduler = self.scheduler
        if not self.config.scheduler.async_scheduling or not scheduler.has_unfinished_requests():
            return False
        if scheduler.has_admissible_waiting() or scheduler.wants_latest_tokens():
            return False  # (speculation: proposals start from a request's latest token)
        return not any(request.grammar is not None for request in scheduler.running)

    def _finish(self, step: _SentStep) -> SchedulerStats:
        """Collect a step's output, apply it, put the outputs; the stats sent with them."""
        if step.submitted is not None:
            assert self.executor is not None
            runner_output = self.executor.collect_step(step.submitted)
        else:
            time.sleep(0.001)  # nothing could be scheduled: let the I/O threads run
            runner_output = _no_output(step.output)
        self._finish_aborted_requests()
        outputs_by_client = self.scheduler.update_from_output(step.output, runner_output)
        self._publish_kv_events()
        stats = self.scheduler.make_stats()
        for client_index, outputs in outputs_by_client.items():
            self.output_queue.put((client_index, self._outputs(outputs, stats)))
        return stats

    def _finish_ahead(self) -> None:
        """Apply the step scheduled ahead, if any (before a utility call talks to the
        workers, and before the engine sleeps)."""
        if self._ahead is not None:
            step, self._ahead = self._ahead, None
            self._publish_stats(self._finish(step))

    def _finish_aborted_requests(self) -> None:
        for request_ids in _drain(self.aborts_queue):
            self._abort(request_ids)

    def _run_utility(self, call: UtilityCall) -> None:
        self._finish_ahead()
        result = run_utility(self, call)
        self._publish_kv_events()  # e.g. reset_prefix_cache: before the reply
        output = EngineCoreOutputs(self.engine_index, clock.monotonic_ns(), utility_output=result)
        self.output_queue.put((call.client_index, output))

    def _outputs(self, outputs: list[EngineCoreOutput], stats: Any = None) -> EngineCoreOutputs:
        return EngineCoreOutputs(
            self.engine_index, clock.monotonic_ns(), outputs, scheduler_stats=stats
        )

    # ---- the end --------------------------------------------------------------------------

    def send_engine_dead(self) -> None:
        """Last word to every gateway; the output thread exits after sending it."""
        if self._output_thread is None or not self._output_thread.is_alive():
            addresses = (
                self._peers.gateway_output_addresses()
                if self._peers is not None
                else list(self.config.gateway_output_addresses)
            )
            send_engine_dead_directly(
                self._ctx, addresses, self.engine_index, curve=self._curve_gateway
            )
            return
        self.output_queue.put(ENGINE_CORE_DEAD)
        self._output_thread.join(DEAD_SEND_TIMEOUT_S)
        if self._output_thread.is_alive():
            logger.critical("ENGINE_CORE_DEAD could not be sent within %ss", DEAD_SEND_TIMEOUT_S)

    def shutdown(self) -> None:
        """Stop the I/O threads, the workers and the ring; safe after a failed start."""
        if self._peers is not None:
            self._peers.stop()
        if self._input_thread is not None:
            self._input_thread.stop()
        if self._output_thread is not None and self._output_thread.is_alive():
            self._output_thread.stop()  # sends what is already queued first
        if self.executor is not None:
            self.executor.shutdown()
        if self.structured_output is not None:
            self.structured_output.shutdown()
        if self.kv_events is not None:
            self.kv_events.stop()
        threads = (self._input_thread, self._output_thread)
        if any(t is not None and t.is_alive() for t in threads):
            self._ctx.destroy(linger=0)  # a stuck thread must not hold the exit hostage
        else:
            self._ctx.term()
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        gc.unfreeze()
        report_suppressed()
        logger.info("EngineCore_DP%d shut down", self.engine_index)


class _SentStep(msgspec.Struct):
    """A scheduled step and its handle on the ring (None: nothing to send, an empty step)."""

    output: SchedulerOutput
    submitted: SubmittedStep | None


def _no_output(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(step_id=scheduler_output.step_id)


def _drain(q: queue.Queue[T]) -> list[T]:
    items: list[T] = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
