"""A real engine core process (``python -m switchboard.engine`` + one worker on a tiny model),
driven through a test-owned ROUTER/PULL pair exactly as a gateway drives it over wire 1."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from switchboard.common.log_limits import DEFAULT_BURST
from switchboard.config import (
    CPU_SHARED_STEP_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    WorkerConfig,
    encode_config,
    ipc_address,
)
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EventType,
    FinishReason,
    RequestType,
    SamplingParams,
    UtilityCall,
    UtilityOutput,
)
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NUM_BLOCKS = 64  # 1024 tokens of KV: more than the tiny model's 512 positions
STARTUP_TIMEOUT_S = 180.0  # the worker imports torch; other tests share the two cores
REPLY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0
PROMPT = [0, 17, 42, 99, 7, 256, 300, 11, 5, 64]
PARENT_SCRIPT = """
import subprocess, sys
engine = subprocess.Popen(sys.argv[1:])
print(f"engine pid {engine.pid}", flush=True)
engine.wait()
"""


class EngineUnderTest:
    """One engine core process plus the gateway-side sockets it connects to."""

    def __init__(
        self,
        model_dir: str,
        *,
        via_parent: bool = False,
        ready: bool = True,
        scheduler: SchedulerConfig | None = None,
        cache: CacheConfig | None = None,
    ) -> None:
        """``via_parent``: start the engine from an intermediate process the test can kill."""
        self.run_dir = tempfile.mkdtemp(prefix="sb-core-")  # short: ipc paths are <= 107 bytes
        self.log_path = os.path.join(self.run_dir, "engine.log")
        self.ctx = zmq.Context()
        input_address = ipc_address(self.run_dir, "gw-in")
        output_address = ipc_address(self.run_dir, "gw-out")
        self.router = zmq_channel.make_socket(self.ctx, zmq.ROUTER, input_address, bind=True)
        self.pull = zmq_channel.make_socket(self.ctx, zmq.PULL, output_address, bind=True)
        config = EngineConfig(
            model=ModelConfig(model=model_dir),
            cache=cache or CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS),
            scheduler=scheduler or SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
            worker=WorkerConfig(device="cpu"),
            gateway_input_addresses=[input_address],
            gateway_output_addresses=[output_address],
            run_dir=self.run_dir,
            heartbeat_interval_s=0.5,
        )
        argv = [sys.executable, "-m", "switchboard.engine", "--config-json", encode_config(config)]
        if via_parent:
            argv = [sys.executable, "-c", PARENT_SCRIPT, *argv]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.engine_pid = self.process.pid
        if via_parent:
            assert wait_until(lambda: "engine pid" in self.log(), STARTUP_TIMEOUT_S), self.log()
            self.engine_pid = int(re.search(r"engine pid (\d+)", self.log()).group(1))
        self.identity = zmq_channel.engine_identity(0)
        if ready:
            self.ready = self.wait_ready()

    # ---- wire 1, gateway side -------------------------------------------------------------

    def wait_ready(self) -> EngineReady:
        if not self.router.poll(int(STARTUP_TIMEOUT_S * 1000)):
            raise AssertionError(f"no READY within {STARTUP_TIMEOUT_S}s:\n{self.log()}")
        identity, body = self.router.recv_multipart()
        assert identity == self.identity
        return zmq_channel.parse_ready(body)

    def send_frames(self, frames: list[bytes]) -> None:
        self.router.send_multipart([self.identity, *frames])

    def send(self, request_type: RequestType, body: object) -> None:
        self.send_frames(zmq_channel.request_frames(request_type, body))

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S) -> EngineCoreOutputs | None:
        """The next non-heartbeat message; None is ENGINE_CORE_DEAD."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self.pull.poll(remaining_ms):
                raise AssertionError(f"no output within {timeout_s}s:\n{self.log()}")
            outputs, _ = zmq_channel.parse_output_frames(self.pull.recv_multipart())
            if outputs is None or not outputs.heartbeat:
                return outputs

    def call_utility(self, call_id: int, method: str, *args: object) -> UtilityOutput:
        self.send(RequestType.UTILITY, UtilityCall(0, call_id, method, list(args)))
        while True:
            outputs = self.recv()
            assert outputs is not None, "engine died during a utility call"
            if outputs.utility_output is not None and outputs.utility_output.call_id == call_id:
                return outputs.utility_output

    def generate(self, request: EngineCoreRequest) -> list[EngineCoreOutput]:
        """Send an ADD and collect its outputs until it finishes."""
        self.send(RequestType.ADD, request)
        collected: list[EngineCoreOutput] = []
        while not collected or collected[-1].finish_reason is None:
            outputs = self.recv()
            assert outputs is not None, "engine died during a request"
            collected += [o for o in outputs.outputs if o.request_id == request.request_id]
        return collected

    # ---- the process ----------------------------------------------------------------------

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def worker_pids(self) -> list[int]:
        return [int(pid) for pid in re.findall(r"Started worker rank \d+ .*pid (\d+)", self.log())]

    def ring_segment(self) -> str:
        match = re.search(r"shm ring (sb_ring_\w+):", self.log())
        assert match, self.log()
        return "/dev/shm/" + match.group(1)

    def wait_exit(self) -> int:
        return self.process.wait(EXIT_TIMEOUT_S)

    def close(self) -> None:
        if not process_gone(self.engine_pid):
            os.kill(self.engine_pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(EXIT_TIMEOUT_S)
        for pid in self.worker_pids():  # only if the engine could not stop them itself
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.router.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def process_gone(pid: int) -> bool:
    """Exited (a zombie counts: it runs nothing and holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_until(predicate, timeout_s: float = EXIT_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def greedy(request_id: str, max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, PROMPT, sampling_params=params)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[EngineUnderTest]:
    running = EngineUnderTest(model_dir)
    yield running
    running.close()


@pytest.fixture
def fresh_engine(model_dir: str) -> Iterator[EngineUnderTest]:
    running = EngineUnderTest(model_dir)
    yield running
    running.close()


def test_ready_comes_first_with_sane_fields(engine: EngineUnderTest) -> None:
    ready = engine.ready
    assert ready.data_parallel_rank == 0
    assert ready.engine_id.startswith("EngineCore_DP0")
    assert (ready.num_gpu_blocks, ready.block_size) == (NUM_BLOCKS, BLOCK_SIZE)
    assert ready.kv_capacity_tokens == NUM_BLOCKS * BLOCK_SIZE
    assert ready.max_model_len == 512  # the model's positions; the KV cache holds more
    assert ready.vocab_size == 1024
    assert ready.dtype == "float32"
    assert abs(ready.wall_clock_ns - time.time_ns()) < 3600 * 10**9
    assert 0 < ready.monotonic_ns <= time.monotonic_ns()  # one machine: the same clock


def test_without_a_token_budget_the_cpu_default_is_used(model_dir: str) -> None:
    from switchboard.kernels import gemm, small_batch_gemm  # what the worker finds here

    # shared steps no bigger than the worker's kernel for few rows takes (128 with AVX-512)
    few_rows = gemm.SMALL_BATCH_MAX_ROWS if small_batch_gemm.load() else CPU_SHARED_STEP_TOKENS
    engine = EngineUnderTest(model_dir, scheduler=SchedulerConfig(max_num_seqs=8))
    try:
        assert engine.ready.max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS
        shared = min(CPU_SHARED_STEP_TOKENS, few_rows)
        assert f"shared_step_tokens={shared} " in engine.log()
    finally:
        engine.close()


def test_bad_frames_are_logged_and_dropped(engine: EngineUnderTest) -> None:
    """... a few lines a minute however many come (log_limits.py): the log is not flooded."""
    for _ in range(10):
        engine.send_frames([b"\x09", zmq_channel.encode(["junk"])])  # unknown type byte
        engine.send_frames([RequestType.ADD.value, b"\xc1 not msgpack"])  # malformed body
    outputs = engine.generate(greedy("after-bad-frames", max_tokens=8))
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outputs) == 8
    lines = "Dropped a bad request frame"
    assert wait_until(lambda: engine.log().count(lines) >= DEFAULT_BURST, 10)
    engine.generate(greedy("after-bad-frames-2", max_tokens=2))  # every frame before it handled
    assert engine.log().count(lines) == DEFAULT_BURST
    assert engine.process.poll() is None


def test_add_runs_greedy_to_max_tokens(engine: EngineUnderTest) -> None:
    first = engine.generate(greedy("greedy-a", max_tokens=12))
    second = engine.generate(greedy("greedy-b", max_tokens=12))
    tokens = [t for o in first for t in o.new_token_ids]
    assert len(tokens) == 12
    assert tokens == [t for o in second for t in o.new_token_ids]  # greedy is deterministic
    assert first[-1].finish_reason == FinishReason.LENGTH
    events = [e for o in first for e in (o.events or [])]
    assert [e.type for e in events][:2] == [EventType.QUEUED, EventType.SCHEDULED]
    assert events[0].timestamp_ns <= events[1].timestamp_ns


def test_get_stats_utility(engine: EngineUnderTest) -> None:
    reply = engine.call_utility(101, "get_stats")
    assert reply.failure_message is None
    assert reply.result["num_running"] == 0
    assert reply.result["num_waiting"] == 0
    assert reply.result["is_sleeping"] is False


def test_utility_not_on_the_allow_list_fails(engine: EngineUnderTest) -> None:
    reply = engine.call_utility(102, "collective_rpc", "shutdown")
    assert reply.failure_message == "method collective_rpc is not allowed"
    assert engine.call_utility(103, "is_sleeping").result is False  # still serving


def test_abort_stops_a_running_request(engine: EngineUnderTest) -> None:
    request = greedy("to-abort", max_tokens=480)
    engine.send(RequestType.ADD, request)
    received: list[EngineCoreOutput] = []
    while not received:
        outputs = engine.recv()
        assert outputs is not None
        received += [o for o in outputs.outputs if o.request_id == request.request_id]
    engine.send(RequestType.ABORT, [request.request_id])
    stats = engine.call_utility(104, "get_stats").result
    while stats["num_running"]:
        stats = engine.call_utility(105, "get_stats").result
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    while engine.pull.poll(0):  # outputs the engine made before the abort arrived
        outputs, _ = zmq_channel.parse_output_frames(engine.pull.recv_multipart())
        received += [o for o in outputs.outputs if o.request_id == request.request_id]
    assert all(o.finish_reason is None for o in received)  # it never ran to max_tokens
    assert sum(len(o.new_token_ids) for o in received) < request.sampling_params.max_tokens


def test_sigterm_stops_everything_cleanly(fresh_engine: EngineUnderTest) -> None:
    worker_pids = fresh_engine.worker_pids()
    segment = fresh_engine.ring_segment()
    assert worker_pids and os.path.exists(segment)
    fresh_engine.process.send_signal(signal.SIGTERM)
    assert fresh_engine.wait_exit() == 0, fresh_engine.log()
    assert not os.path.exists(segment)
    assert all(process_gone(pid) for pid in worker_pids)
    leftovers = [n for n in os.listdir(fresh_engine.run_dir) if n.startswith(("ring-", "replies-"))]
    assert leftovers == []


def test_worker_death_kills_the_engine(fresh_engine: EngineUnderTest) -> None:
    segment = fresh_engine.ring_segment()
    (worker_pid,) = fresh_engine.worker_pids()
    os.kill(worker_pid, signal.SIGKILL)
    assert fresh_engine.recv() is None  # ENGINE_CORE_DEAD
    assert fresh_engine.wait_exit() != 0
    assert "EngineCore encountered a fatal error" in fresh_engine.log()
    assert not os.path.exists(segment)


def test_heartbeats_while_idle(engine: EngineUnderTest) -> None:
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while engine.pull.poll(int((deadline - time.monotonic()) * 1000)):
        outputs, _ = zmq_channel.parse_output_frames(engine.pull.recv_multipart())
        if outputs is not None and outputs.heartbeat:
            assert outputs.outputs == [] and outputs.engine_index == 0
            return
    raise AssertionError("no heartbeat from an idle engine")


def test_a_request_that_cannot_run_fails_alone(engine: EngineUnderTest) -> None:
    too_long = EngineCoreRequest("too-long", [5] * 600, sampling_params=SamplingParams())
    assert engine.generate(too_long)[-1].finish_reason == FinishReason.ERROR
    assert engine.generate(greedy("still-serving", max_tokens=2))[-1].finish_reason == (
        FinishReason.LENGTH
    )


FORGED_ADDS = {  # what a stray process on the wire once killed the engine with, one each
    "id-at-vocab": {"prompt": [0, 1024]},
    "id-1e6": {"prompt": [0, 10**6]},
    "id-2^32-1": {"prompt": [0, 2**32 - 1]},
    "id-minus-1": {"prompt": [0, -1]},
    "id-2^63-1": {"prompt": [0, 2**63 - 1]},
    "logprobs-1e6": {"logprobs": 10**6},
    "prompt-logprobs-1e6": {"prompt_logprobs": 10**6},
    "empty-bad-word": {"bad_words_token_ids": [[]]},
}


def test_forged_adds_fail_alone_and_the_engine_serves_on(engine: EngineUnderTest) -> None:
    for name, forged in FORGED_ADDS.items():
        prompt = forged.pop("prompt", PROMPT)
        params = SamplingParams(temperature=0.0, max_tokens=4, **forged)
        outputs = engine.generate(
            EngineCoreRequest(f"forged-{name}", prompt, sampling_params=params)
        )
        (only,) = outputs
        assert only.finish_reason == FinishReason.ERROR and not only.new_token_ids, name
        assert isinstance(only.stop_reason, str) and only.stop_reason, name  # says why
        assert engine.process.poll() is None, name
    outputs = engine.generate(greedy("after-forged-adds", max_tokens=8))
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outputs) == 8


def test_sleep_frees_kv_and_requests_wait_until_wake_up(engine: EngineUnderTest) -> None:
    assert engine.call_utility(201, "sleep", 1).failure_message is None
    assert engine.call_utility(202, "is_sleeping").result is True
    engine.send(RequestType.ADD, greedy("sleepy", max_tokens=3))
    assert engine.call_utility(203, "get_stats").result["num_waiting"] == 1  # it waits
    assert engine.call_utility(204, "wake_up").failure_message is None
    collected: list[EngineCoreOutput] = []
    while not collected or collected[-1].finish_reason is None:
        outputs = engine.recv()
        assert outputs is not None
        collected += [o for o in outputs.outputs if o.request_id == "sleepy"]
    assert sum(len(o.new_token_ids) for o in collected) == 3
    assert engine.call_utility(205, "sleep", 3).failure_message  # levels are 1 and 2 only


def test_engine_exits_when_its_parent_dies(model_dir: str) -> None:
    orphan = EngineUnderTest(model_dir, via_parent=True)
    try:
        worker_pids, segment = orphan.worker_pids(), orphan.ring_segment()
        orphan.process.kill()  # the parent, not the engine
        orphan.process.wait(EXIT_TIMEOUT_S)
        assert wait_until(lambda: process_gone(orphan.engine_pid)), orphan.log()
        assert all(process_gone(pid) for pid in worker_pids)
        assert not os.path.exists(segment)
    finally:
        orphan.close()


def test_failed_start_sends_engine_core_dead(tmp_path: Path) -> None:
    broken = EngineUnderTest(str(tmp_path / "no-such-model"), ready=False)
    try:
        assert broken.recv(STARTUP_TIMEOUT_S) is None  # ENGINE_CORE_DEAD, and no READY
        assert broken.wait_exit() != 0
        assert not broken.router.poll(0)
        assert not os.path.exists(broken.ring_segment())
    finally:
        broken.close()
