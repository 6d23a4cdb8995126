"""The engine core: its state and the busy loop.

Start-up (loading the model, sizing the KV cache, READY, opening the wire) is in ``startup``,
the request intake (checking, admitting and rejecting ADDs, aborts) in ``intake``, the end
(ENGINE_CORE_DEAD, stopping everything) in ``teardown``.

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
import queue
import time
import uuid
from typing import Any, TypeVar

import msgspec
import zmq

from switchboard.config import EngineConfig, new_run_dir
from switchboard.engine import ahead_hold, clock, intake
from switchboard.engine.constrained_decoding import StructuredOutputManager, attach_bitmask
from switchboard.engine.executor import MultiprocExecutor, Stall, SubmittedStep
from switchboard.engine.intake import GATEWAY_LOST, GRAMMAR_READY
from switchboard.engine.io_threads import InputItem, InputQueue, InputThread
from switchboard.engine.kv_event_publisher import KvEventPublisher
from switchboard.engine.lora_registry import EngineLoras
from switchboard.engine.output_thread import OutputThread
from switchboard.engine.peers import EnginePeers, engine_curve_keys
from switchboard.engine.request import Request
from switchboard.engine.scheduler import Scheduler
from switchboard.engine.shutdown import ShutdownRequest
from switchboard.engine.startup import load_and_size, make_ready, start_io_threads, start_kv_events
from switchboard.engine.utility import run_utility
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    RequestType,
    SchedulerStats,
    UtilityCall,
)
from switchboard.wire.step_msgs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

IO_THREAD_FAILED = "io-thread-failed"  # input-queue kind: an I/O thread died, the engine follows


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
        self.own_run_dir = not config.run_dir
        if config.run_dir:
            zmq_channel.check_private_dir(config.run_dir)
        self.run_dir = config.run_dir or new_run_dir()
        # CURVE client keys toward the gateways and the coordinator (None: plain TCP); read
        # now, so that a broken keys directory fails before the model loads.
        self.curve_gateway, self.curve_coordinator = engine_curve_keys(config)
        self.ctx = zmq.Context()
        self.executor: MultiprocExecutor | None = None
        self.input_thread: InputThread | None = None
        self.output_thread: OutputThread | None = None
        self.peers: EnginePeers | None = None  # coordinator, discovered gateways
        self.kv_events: KvEventPublisher | None = None  # --kv-events-config
        self.structured_output: StructuredOutputManager | None = None
        # Constrained requests whose grammar is still compiling, in arrival order: they wait
        # here, outside the scheduler, so nobody behind them is held back.
        self.compiling: dict[str, Request] = {}  # intake.py
        # The step scheduled ahead (async scheduling): on the workers' ring, output not applied.
        self._ahead: _SentStep | None = None
        # when the last step's outputs were applied; None after the engine waited idle
        self._last_step_end: float | None = None
        self._step_period: float | None = None  # the last step's, in a busy loop
        # input taken while holding the step ahead back (ahead_hold.py), for the next turn
        self._deferred: list[InputItem] = []
        self.loras = EngineLoras.for_engine(config)

    def start(self) -> None:
        """Start the workers, load the model, size the KV cache (``startup``), then open the
        wire to the gateways (READY goes first). ``shutdown`` cleans up after a failure here
        too."""
        config = self.config
        logger.info(
            "Loading model %s on %d worker(s)", config.model.model, config.parallel.world_size
        )
        self.executor = MultiprocExecutor(
            config, self.run_dir, self._on_executor_failure, self._on_worker_stall
        )
        logger.info("Workers ready: pids %s", [w.pid for w in self.executor.workers])
        model = load_and_size(config, self.executor, self.loras)
        self.embed_only = model.embed_only
        self.num_gpu_blocks = model.num_gpu_blocks
        self.max_model_len = model.max_model_len
        self.scheduler = Scheduler(
            model.scheduler_config,
            config.cache,
            self.num_gpu_blocks,
            self.max_model_len,
            max_loras=config.model.lora.max_loras if config.model.lora.enable_lora else 0,
        )
        self.structured_output = StructuredOutputManager(
            config.model.model, model.summary.vocab_size
        )
        self.kv_events = start_kv_events(
            self.ctx, config, self.engine_index, self.scheduler.kv.pool
        )
        self.ready = make_ready(
            config,
            f"EngineCore_DP{self.engine_index}-{uuid.uuid4().hex[:8]}",
            model,
            self.kv_events,
        )
        # Everything allocated while loading is permanent: full collections skip it from now on.
        gc.collect()
        gc.freeze()
        start_io_threads(self)
        if clock.TEST_CLOCK_OFFSET_NS:
            logger.warning(
                "test hook %s: every timestamp of this engine is offset by %d ns",
                clock.TEST_CLOCK_OFFSET_ENV,
                clock.TEST_CLOCK_OFFSET_NS,
            )
        logger.info("EngineCore_DP%d ready", self.engine_index)

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

    def _on_executor_failure(self, reason: str) -> None:
        """Monitor thread: hand the failure to the busy loop, which raises."""
        self.input_queue.put((RequestType.EXECUTOR_FAILED, reason))

    def _on_worker_stall(self, stall: Stall | None) -> None:
        """Busy loop, inside a step: a worker has not answered within the step timeout (or
        answered after all). The heartbeats the output thread sends meanwhile carry it, so the
        gateways stop routing here; the step's own outputs clear it."""
        if self.output_thread is None:
            return
        stats = self.output_thread.latest_stats or SchedulerStats()
        if stall is None:
            stats = msgspec.structs.replace(stats, stalled_worker_rank=-1, stalled_worker_pid=0)
        else:
            stats = msgspec.structs.replace(
                stats,
                stalled_worker_rank=stall.rank,
                stalled_worker_pid=stall.pid,
                stalled_for_s=stall.waited_s,
            )
        self.output_thread.latest_stats = stats

    def on_io_thread_failure(self, reason: str) -> None:
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
        if self.output_thread is not None:
            self.output_thread.latest_stats = stats
        if self.peers is not None:
            self.peers.report_load(
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
        while self._deferred:
            self._handle_input(*self._deferred.pop(0))
        if not self._has_work():
            _drain(self.aborts_queue)  # idle: every abort also arrives on the input queue
            self._last_step_end = None
            self._handle_input(*self.input_queue.get())
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_input(*item)

    def _handle_input(self, kind: RequestType | str, payload: Any) -> None:
        if kind == RequestType.ADD:
            intake.add_request(self, payload)
        elif kind == RequestType.ABORT:
            intake.abort(self, payload)
        elif kind == GRAMMAR_READY:
            intake.admit_compiled(self)
        elif kind == GATEWAY_LOST:
            intake.abort_requests_of(self, payload)
        elif kind == RequestType.UTILITY:
            self._run_utility(payload)
        elif kind == RequestType.EXECUTOR_FAILED:
            raise RuntimeError(f"Executor failed: {payload}")
        elif kind == IO_THREAD_FAILED:
            raise RuntimeError(f"Engine I/O failed: {payload}")
        # WAKEUP only unblocks the loop so that it sees a shutdown request.

    def _step(self) -> SchedulerStats:
        """One step; returns the stats it sent with the outputs (the turn publishes them too).
        The step is the one scheduled ahead in the last turn, if any; the next one is
        scheduled ahead now, if it may be."""
        started = time.perf_counter()
        if self._last_step_end is not None:
            started = self._last_step_end  # busy since: the period of a step in a busy loop
        current = self._ahead if self._ahead is not None else self._schedule_and_submit()
        self._ahead = None
        if self._may_schedule_ahead() and self._hold_ahead(current, started):
            ahead = self._schedule_and_submit()
            if ahead.submitted is not None:
                self._ahead = ahead
            else:  # nothing to run ahead (say every request ends with its pending token)
                self.scheduler.update_from_output(ahead.output, _no_output(ahead.output))
        stats = self._finish(current)
        ended = time.perf_counter()
        self._last_step_end = ended
        self._step_period = ended - started
        if self.scheduler.speculator is not None:
            # what a step of these rows takes in the loop, scheduled ahead or not: what
            # speculation weighs its rows by
            self.scheduler.speculator.observe_step(current.output, self._step_period)
        return stats

    def _schedule_and_submit(self) -> _SentStep:
        scheduler_output = self.scheduler.schedule()
        if self.structured_output is not None:
            attach_bitmask(self.structured_output, scheduler_output, self.scheduler.requests)
        if scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_request_ids:
            assert self.executor is not None  # started before the busy loop
            return _SentStep(scheduler_output, self.executor.submit_step(scheduler_output))
        return _SentStep(scheduler_output, None)

    def _hold_ahead(self, current: _SentStep, started: float) -> bool:
        """Take arrivals in for most of the running step before scheduling the next one ahead
        (``ahead_hold.py``); False when the step ended meanwhile or a request arrived."""
        period = self._step_period
        if current.submitted is None or period is None or period < ahead_hold.MIN_HELD_PERIOD_S:
            return True
        executor = self.executor
        assert executor is not None
        scheduled_ahead = ahead_hold.hold_for_arrivals(
            started + ahead_hold.HOLD_FRACTION * period,
            executor.step_done,
            self.input_queue,
            self._handle_input,
            self._deferred,
        )
        return scheduled_ahead and self._may_schedule_ahead()

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
            intake.abort(self, request_ids)

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
