"""``python -m switchboard.worker`` as a real process on a real shared-memory ring.

The test plays the engine: it owns the ring writer and the PULL socket for replies, starts the
worker with a WorkerStartup, and drives load -> KV sizing -> steps -> shutdown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq

from switchboard.config import EngineConfig, ModelConfig, WorkerConfig, encode_config
from switchboard.kernels import gemm, small_batch_gemm
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.shm_ring import ShmRingWriter
from switchboard.wire.step_msgs import (
    CachedRequest,
    ModelRunnerOutput,
    ModelSummary,
    NewRequest,
    RpcCall,
    RpcReply,
    SchedulerOutput,
    WorkerStartup,
)
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow
REPLY_TIMEOUT_S = 60.0  # generous: other test processes compete for the 2 cores
EXIT_TIMEOUT_S = 20.0


class FakeEngine:
    def __init__(self, writer: ShmRingWriter, replies: zmq.Socket, process: subprocess.Popen):
        self.writer = writer
        self.replies = replies
        self.process = process
        self.call_ids = iter(range(1, 1_000_000))

    def call(self, method: str, *args, output_rank: int = 0):
        call = RpcCall(
            next(self.call_ids), method, msgspec.to_builtins(list(args)), {}, output_rank
        )
        self.writer.enqueue(msgspec.msgpack.encode(call), timeout=REPLY_TIMEOUT_S)
        if output_rank != 0:
            return None
        if not self.replies.poll(REPLY_TIMEOUT_S * 1000):
            raise TimeoutError(f"no reply to {method} (worker exit code {self.process.poll()})")
        reply = msgspec.msgpack.decode(self.replies.recv(), type=RpcReply)
        assert reply.call_id == call.call_id and reply.rank == 0
        if reply.error is not None:
            raise RuntimeError(reply.error)
        return reply.result


@contextmanager
def started_worker(tmp_path, *, parent_pid: int | None = None) -> Iterator[FakeEngine]:
    config = EngineConfig(
        model=ModelConfig(model=tiny_llama_dir()), worker=WorkerConfig(device="cpu")
    )
    context = zmq.Context()
    replies = context.socket(zmq.PULL)
    reply_address = f"ipc://{tmp_path}/replies"
    replies.bind(reply_address)
    writer = ShmRingWriter(1, str(tmp_path), max_chunks=4, max_chunk_bytes=1 << 16)
    startup = WorkerStartup(
        rank=0,
        world_size=1,
        data_parallel_rank=0,
        pp_rank=0,
        tp_rank=0,
        ring_handle=msgspec.to_builtins(writer.handle),
        reply_address=reply_address,
        engine_config_json=encode_config(config),
        parent_pid=os.getpid() if parent_pid is None else parent_pid,
    )
    argv = [sys.executable, "-m", "switchboard.worker", "--startup-json"]
    process = subprocess.Popen([*argv, msgspec.json.encode(startup).decode()])
    try:
        yield FakeEngine(writer, replies, process)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(EXIT_TIMEOUT_S)
        writer.close()
        replies.close(linger=0)
        context.term()


def test_engine_drives_the_worker_over_the_ring_then_shuts_it_down(tmp_path):
    with started_worker(tmp_path) as engine:
        engine.writer.wait_for_readers(timeout=REPLY_TIMEOUT_S)
        assert engine.call("ping") == "pong"
        with open(f"/proc/{engine.process.pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"switchboard::Worker_DP0_PP0_TP0"
        summary = msgspec.convert(engine.call("load_model"), ModelSummary)
        assert summary.num_layers == 2 and summary.dtype == "float32"
        # the rows its kernels for few rows take (the engine's shared steps take no more)
        assert summary.few_rows_limit == (
            gemm.SMALL_BATCH_MAX_ROWS if small_batch_gemm.load() else 0
        )
        assert engine.call("determine_num_kv_blocks", 16, 1 << 20) == (1 << 20) // (
            16 * summary.kv_cache_bytes_per_token
        )
        engine.call("initialize_kv_cache", 8, 4)
        prompt = [0, 5, 9, 33, 100, 7]
        new = NewRequest("r", prompt, SamplingParams(temperature=0.0), [2, 5], 0)
        step = SchedulerOutput(0, [new], [], {"r": 6}, 6)
        first = msgspec.convert(engine.call("execute_model", step), ModelRunnerOutput)
        assert first.request_ids == ["r"] and len(first.sampled_token_ids[0]) == 1
        step = SchedulerOutput(1, [], [CachedRequest("r", [], 6)], {"r": 1}, 1)
        second = msgspec.convert(engine.call("execute_model", step), ModelRunnerOutput)
        assert len(second.sampled_token_ids[0]) == 1
        with pytest.raises(RuntimeError, match="not a worker RPC method"):
            engine.call("__del__")
        engine.call("shutdown", output_rank=-1)  # as the engine does: nobody replies
        assert engine.process.wait(EXIT_TIMEOUT_S) == 0


def test_worker_exits_cleanly_on_sigterm(tmp_path):
    with started_worker(tmp_path) as engine:
        engine.writer.wait_for_readers(timeout=REPLY_TIMEOUT_S)
        assert engine.call("ping") == "pong"
        engine.process.send_signal(signal.SIGTERM)
        assert engine.process.wait(EXIT_TIMEOUT_S) == 0


def test_worker_exits_when_its_parent_is_gone(tmp_path):
    # The worker's real parent is this test; a startup naming another pid looks like the
    # parent died and was replaced, which is what the worker watches for.
    with started_worker(tmp_path, parent_pid=1) as engine:
        assert engine.process.wait(EXIT_TIMEOUT_S) == 0
