"""The executor: the engine core's handle on its worker processes (wire 2).

It starts one worker process per device by module name (``python -m switchboard.worker``; the
engine never imports ``worker/``), broadcasts method calls to all of them over the
shared-memory ring, and reads the one reply it asked for on a ZeroMQ PULL::

    engine core ──RpcCall──> shm ring ──> worker 0 … worker N-1   (every worker runs it)
        ^                                        │
        └──────────── PULL <──RpcReply── worker output_rank (only that one answers)

A step (``execute_model`` on the workers: ``submit_step`` puts it on the ring, ``collect_step``
waits for its output, so the engine can put the next step on the ring first) has two
deadlines, both base + per-token x its scheduled tokens (a long prefill is not a stall), counted
from when its output is awaited: past ``step_timeout_s`` the waiting worker is named (rank, pid:
the stopped one if the kernel says a worker is stopped, else the output rank) in an ERROR line
and ``on_stall`` tells the engine core, which puts it in its stats (the gateways stop routing
to it); when the reply comes ``on_stall(None)`` clears it. Past ``execute_timeout_s`` the call
raises ExecutorFailed: the engine fails as if the worker had died.

A monitor thread watches the worker processes. When one dies unexpectedly it marks the
executor failed (a call waiting for a reply then raises) and calls ``on_failure``; the engine
core turns that into EXECUTOR_FAILED on its input queue and dies. Shutdown asks the workers to
exit, then escalates: wait, SIGTERM, wait, SIGKILL; it then unlinks the ring and the socket.
Starting and stopping the processes themselves is ``worker_processes``.

With ``-tp``/``-pp`` the workers form a grid, ``rank = pp_rank * TP + tp_rank``, and meet for
``torch.distributed`` at a ``file://`` rendezvous in the run directory (no port to race for);
``output_rank`` is the first rank of the last pipeline stage, which holds the sampled tokens.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from switchboard.config import EngineConfig, encode_config, ipc_address
from switchboard.engine.worker_processes import (
    WorkerProcess,
    process_stopped,
    start_worker,
    terminate_workers,
    worker_environment,
)
from switchboard.wire import zmq_channel
from switchboard.wire.codec import RPC_CALL, RPC_REPLY
from switchboard.wire.shm_ring import ShmRingWriter
from switchboard.wire.step_msgs import (
    ModelRunnerOutput,
    ModelSummary,
    RpcCall,
    RpcReply,
    SchedulerOutput,
    WorkerStartup,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # workers import torch and attach to the ring
LOAD_MODEL_TIMEOUT_S = 3600.0  # a large checkpoint on a slow disk
RPC_TIMEOUT_S = 300.0  # calls other than execute_model (those have the step timeouts)
_MONITOR_INTERVAL_S = 0.2
_REPLY_POLL_MS = 100  # a waiting call checks this often whether a worker died


class ExecutorFailed(RuntimeError):
    """A worker died, failed a call, or did not answer in time: fatal to the engine core."""


class SubmittedStep(msgspec.Struct, frozen=True):
    """A step on the ring whose output has not been collected yet."""

    call: RpcCall
    stall_after_s: float
    timeout_s: float


class Stall(msgspec.Struct, frozen=True):
    """A worker that has not answered a step within the step timeout."""

    rank: int
    pid: int
    waited_s: float


class MultiprocExecutor:
    def __init__(
        self,
        config: EngineConfig,
        run_dir: str,
        on_failure: Callable[[str], None],
        on_stall: Callable[[Stall | None], None] | None = None,
    ) -> None:
        parallel = config.parallel
        self.world_size = parallel.world_size
        # Sampled tokens exist on the last pipeline stage; its first TP rank answers steps.
        self.output_rank = self.world_size - parallel.tensor_parallel_size
        self._config = config
        self._on_failure = on_failure
        self._execute_timeout_s = config.worker.execute_timeout_s
        self._step_timeout_s = config.worker.step_timeout_s
        self._per_token_s = config.worker.step_timeout_per_token_s
        self._on_stall = on_stall or (lambda _stall: None)
        self.stall: Stall | None = None  # the current stall, if any
        self._call_ids = itertools.count()
        self._failure: str | None = None
        self._shutting_down = False
        self._stop_monitor = threading.Event()
        self.workers: list[WorkerProcess] = []
        self._ring: ShmRingWriter | None = None
        reply_name = f"replies-{uuid.uuid4().hex[:8]}"
        self._reply_path = os.path.join(run_dir, reply_name)
        self._reply_address = ipc_address(run_dir, reply_name)  # checked before anything starts
        self._ctx = zmq.Context()
        # torch.distributed rendezvous of the workers (only when there are several).
        self._rendezvous_path = os.path.join(run_dir, f"dist-{uuid.uuid4().hex[:8]}")
        self._reply_socket: zmq.SyncSocket | None = None
        try:
            self._reply_socket = zmq_channel.make_socket(
                self._ctx, zmq.PULL, self._reply_address, bind=True
            )
            self._ring = ShmRingWriter(self.world_size, run_dir)
            self._start_workers(run_dir)
            self._wait_for_workers()
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(
            target=self._monitor_workers, name="WorkerMonitor", daemon=True
        )
        self._monitor.start()

    # ---- start-up -------------------------------------------------------------------------

    def _start_workers(self, run_dir: str) -> None:
        assert self._ring is not None  # the ring and the reply socket exist once __init__ ran
        parallel = self._config.parallel
        ring_handle = msgspec.to_builtins(self._ring.handle)
        engine_config_json = encode_config(self._config)
        init_method = f"file://{self._rendezvous_path}" if self.world_size > 1 else ""
        env = worker_environment(dict(os.environ))
        for pp_rank in range(parallel.pipeline_parallel_size):
            for tp_rank in range(parallel.tensor_parallel_size):
                rank = pp_rank * parallel.tensor_parallel_size + tp_rank
                startup = WorkerStartup(
                    rank=rank,
                    world_size=self.world_size,
                    data_parallel_rank=self._config.data_parallel_rank,
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    ring_handle=ring_handle,
                    reply_address=self._reply_address,
                    engine_config_json=engine_config_json,
                    parent_pid=os.getpid(),
                    distributed_init_method=init_method,
                )
                self.workers.append(start_worker(startup, env))

    def _wait_for_workers(self) -> None:
        """Until every worker has attached to the ring; fail fast if one exits meanwhile."""
        assert self._ring is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            self._raise_if_a_worker_exited()
            try:
                self._ring.wait_for_readers(timeout=1.0)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise ExecutorFailed(
                        f"workers did not attach to the ring within {STARTUP_TIMEOUT_S:.0f}s"
                    ) from None

    def _raise_if_a_worker_exited(self) -> None:
        for worker in self.workers:
            code = worker.process.poll()
            if code is not None:
                raise ExecutorFailed(
                    f"worker rank {worker.rank} (pid {worker.pid}) exited with code {code}"
                )

    # ---- calls ----------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        output_rank: int = 0,
        timeout: float | None = RPC_TIMEOUT_S,
        stall_after: float | None = None,
    ) -> Any:
        """Run ``method`` on every worker; return ``output_rank``'s result (plain msgpack
        values). Raises ExecutorFailed on a worker error, a dead worker or a timeout."""
        call = self._send(method, args, kwargs, output_rank, timeout)
        return self._result(call, timeout, stall_after)

    def _send(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any],
        kwargs: dict[str, Any] | None,
        output_rank: int,
        timeout: float | None,
    ) -> RpcCall:
        if self._failure is not None:
            raise ExecutorFailed(self._failure)
        assert self._ring is not None
        call = RpcCall(next(self._call_ids), method, list(args), kwargs or {}, output_rank)
        try:
            self._ring.enqueue(RPC_CALL.encode(call), timeout=timeout)
        except TimeoutError as exc:
            raise ExecutorFailed(f"RPC call to {method} could not be sent: {exc}") from exc
        return call

    def _result(self, call: RpcCall, timeout: float | None, stall_after: float | None) -> Any:
        reply = self._wait_for_reply(call, timeout, stall_after)
        if reply.error is not None:
            raise ExecutorFailed(f"worker rank {reply.rank} failed in {call.method}: {reply.error}")
        return reply.result

    def _wait_for_reply(
        self, call: RpcCall, timeout: float | None, stall_after: float | None = None
    ) -> RpcReply:
        assert self._reply_socket is not None
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        stall_at = None if stall_after is None else start + stall_after
        while True:
            if self._reply_socket.poll(_REPLY_POLL_MS):
                reply = RPC_REPLY.decode(self._reply_socket.recv(copy=False).buffer)
                if reply.call_id == call.call_id:
                    if self.stall is not None:
                        self._end_stall(call, time.monotonic() - start)
                    return reply
                logger.warning(
                    "Discarded a stale reply to call %d from rank %d", reply.call_id, reply.rank
                )
                continue
            if self._failure is not None:
                raise ExecutorFailed(f"{call.method}: {self._failure}")
            now = time.monotonic()
            if stall_at is not None and now > stall_at and self.stall is None:
                self._begin_stall(call, now - start)
            if deadline is not None and now > deadline:
                worker = self._waited_worker(call)
                raise ExecutorFailed(
                    f"RPC call to {call.method} timed out after {timeout:.1f}s: worker rank "
                    f"{worker.rank} (pid {worker.pid}) is treated as dead"
                )

    def _waited_worker(self, call: RpcCall) -> WorkerProcess:
        """The worker a late reply is blamed on: a stopped one, else the one that answers."""
        for worker in self.workers:
            if process_stopped(worker.pid):
                return worker
        rank = call.output_rank if 0 <= call.output_rank < len(self.workers) else 0
        return self.workers[rank]

    def _begin_stall(self, call: RpcCall, waited_s: float) -> None:
        worker = self._waited_worker(call)
        self.stall = Stall(worker.rank, worker.pid, waited_s)
        logger.error(
            "Worker stalled: rank %d (pid %d) has not answered %s (call %d) within %.1fs; "
            "the engine is not routable until it answers (it fails after the hard timeout)",
            worker.rank,
            worker.pid,
            call.method,
            call.call_id,
            waited_s,
        )
        self._on_stall(self.stall)

    def _end_stall(self, call: RpcCall, waited_s: float) -> None:
        stall = self.stall
        assert stall is not None
        self.stall = None
        logger.warning(
            "Worker rank %d (pid %d) answered %s (call %d) after %.1fs: stall over",
            stall.rank,
            stall.pid,
            call.method,
            call.call_id,
            waited_s,
        )
        self._on_stall(None)

    def load_model(self) -> ModelSummary:
        result = self.collective_rpc("load_model", timeout=LOAD_MODEL_TIMEOUT_S)
        return msgspec.convert(result, ModelSummary)

    def determine_num_kv_blocks(self, block_size: int, kv_cache_memory_bytes: int | None) -> int:
        # The workers agree among themselves (the minimum over ranks: pipeline stages may hold
        # different numbers of layers), so any rank's answer is the answer.
        return int(
            self.collective_rpc("determine_num_kv_blocks", (block_size, kv_cache_memory_bytes))
        )

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks, block_size))

    def free_kv_cache(self) -> None:
        self.collective_rpc("free_kv_cache")

    def sleep(self, level: int) -> None:
        self.collective_rpc("sleep", (level,))

    def wake_up(self) -> None:
        # Level 2 reloads the weights from the checkpoint: as long as loading them at start.
        self.collective_rpc("wake_up", timeout=LOAD_MODEL_TIMEOUT_S)

    def step_timeouts(self, num_tokens: int) -> tuple[float, float]:
        """(stall, hard) timeouts of a step of ``num_tokens`` scheduled tokens."""
        per_token = self._per_token_s * num_tokens
        return self._step_timeout_s + per_token, self._execute_timeout_s + per_token

    def submit_step(self, scheduler_output: SchedulerOutput) -> SubmittedStep:
        """Put a step on the ring and return at once: the workers run steps in the order they
        were submitted, and ``collect_step`` must take their outputs in that order too (a
        reply that is not the one awaited is discarded)."""
        stall_after, timeout = self.step_timeouts(scheduler_output.total_num_scheduled_tokens)
        call = self._send("execute_model", (scheduler_output,), None, self.output_rank, timeout)
        return SubmittedStep(call, stall_after, timeout)

    def step_done(self, timeout_ms: int) -> bool:
        """Whether a reply (the oldest submitted step's: steps finish in order) is waiting,
        after up to ``timeout_ms``; nothing is taken: ``collect_step`` still reads it."""
        assert self._reply_socket is not None
        return bool(self._reply_socket.poll(timeout_ms))

    def collect_step(self, step: SubmittedStep) -> ModelRunnerOutput:
        """Wait for a submitted step's output; its timeouts count from now (a step waits for
        the one before it to finish)."""
        result = self._result(step.call, step.timeout_s, step.stall_after_s)
        return msgspec.convert(result, ModelRunnerOutput)

    # ---- liveness and shutdown ------------------------------------------------------------

    def _monitor_workers(self) -> None:
        while not self._stop_monitor.wait(_MONITOR_INTERVAL_S):
            for worker in self.workers:
                code = worker.process.poll()
                if code is None or self._shutting_down:
                    continue
                self._failure = (
                    f"worker rank {worker.rank} (pid {worker.pid}) died unexpectedly "
                    f"with exit code {code}"
                )
                logger.error("Executor failed: %s", self._failure)
                self._on_failure(self._failure)
                return

    def shutdown(self) -> None:
        """Stop the workers (ask, SIGTERM, SIGKILL), then unlink the ring and the socket.
        Idempotent; safe after a failure."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self._stop_monitor.set()
        if self._failure is None and all(w.process.poll() is None for w in self.workers):
            self._ask_workers_to_exit()
        terminate_workers(self.workers)
        if self._ring is not None:
            self._ring.close()
        if self._reply_socket is not None:
            self._reply_socket.close(linger=0)
        self._ctx.term()
        for path in (self._reply_path, self._rendezvous_path):
            if os.path.exists(path):
                os.unlink(path)
        logger.info("Executor shut down: workers stopped, ring unlinked")

    def _ask_workers_to_exit(self) -> None:
        if self._ring is None:
            return
        try:
            call = RpcCall(next(self._call_ids), "shutdown", output_rank=-1)  # nobody replies
            self._ring.enqueue(RPC_CALL.encode(call), timeout=1.0)
        except Exception as exc:  # a worker may already be gone; the ladder below follows
            logger.warning("Could not send shutdown to the workers: %s", exc)
