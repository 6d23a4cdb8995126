"""The worker's RPC surface and busy loop, driven without a ring (a list stands in for it)."""

from __future__ import annotations

import gc
import os

import msgspec
import pytest

from switchboard.config import EngineConfig, ModelConfig, WorkerConfig
from switchboard.wire.codec import RPC_CALL
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import (
    ModelRunnerOutput,
    ModelSummary,
    NewRequest,
    RpcCall,
    RpcReply,
    SchedulerOutput,
)
from switchboard.worker import rpc
from switchboard.worker.rpc import dispatch, dispatch_encoded
from switchboard.worker.worker import Worker, run_busy_loop
from tests.tiny_checkpoint import tiny_llama_dir


class ListReader:
    """Hands out the payloads in order, then times out like an idle ring."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = list(payloads)
        self.timeouts = 0

    def dequeue(self, timeout: float | None = None) -> bytes:
        if self.payloads:
            return self.payloads.pop(0)
        self.timeouts += 1
        raise TimeoutError


class ListSender:
    def __init__(self) -> None:
        self.replies: list[RpcReply] = []

    def send(self, data: bytes) -> None:
        self.replies.append(msgspec.msgpack.decode(data, type=RpcReply))


def encode(call_id: int, method: str, *args, output_rank: int = 0, **kwargs) -> bytes:
    call = RpcCall(
        call_id, method, msgspec.to_builtins(list(args)), msgspec.to_builtins(kwargs), output_rank
    )
    return msgspec.msgpack.encode(call)


@pytest.fixture(scope="module")
def engine_config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=tiny_llama_dir()), worker=WorkerConfig(device="cpu")
    )


def test_engine_call_sequence_over_the_loop(engine_config):
    prompt = [0, 5, 9, 33, 100]
    step = SchedulerOutput(
        step_id=0,
        new_requests=[NewRequest("r", prompt, SamplingParams(temperature=0.0), [3, 7], 0)],
        num_scheduled_tokens={"r": len(prompt)},
        total_num_scheduled_tokens=len(prompt),
    )
    reader = ListReader(
        [
            encode(1, "ping"),
            encode(2, "load_model"),
            encode(3, "determine_num_kv_blocks", 16, None),
            encode(4, "initialize_kv_cache", num_blocks=8, block_size=4),
            encode(5, "execute_model", step),
            encode(6, "free_kv_cache"),
            encode(7, "shutdown"),
            encode(8, "ping"),  # never read: the loop left on shutdown
        ]
    )
    sender = ListSender()
    worker = Worker(engine_config, rank=0)
    assert run_busy_loop(worker, reader, sender, os.getppid()) == "shutdown RPC"
    replies = {reply.call_id: reply for reply in sender.replies}
    assert sorted(replies) == [1, 2, 3, 4, 5, 6, 7]
    assert all(reply.error is None and reply.rank == 0 for reply in replies.values())
    assert replies[1].result == "pong"
    summary = msgspec.convert(replies[2].result, ModelSummary)
    assert summary.kv_cache_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K+V, layers, kv heads, dim, f32
    assert replies[3].result == (1 << 30) // (16 * summary.kv_cache_bytes_per_token)
    output = msgspec.convert(replies[5].result, ModelRunnerOutput)
    assert output.request_ids == ["r"] and len(output.sampled_token_ids[0]) == 1


def test_only_the_output_rank_replies(engine_config):
    reader = ListReader([encode(1, "ping", output_rank=1), encode(2, "shutdown", output_rank=1)])
    sender = ListSender()
    run_busy_loop(Worker(engine_config, rank=0), reader, sender, os.getppid())
    assert sender.replies == []


def test_failures_become_error_replies(engine_config):
    worker = Worker(engine_config, rank=0)
    unknown = dispatch(worker, Worker.RPC_METHODS, RpcCall(1, "__init__"), rank=0)
    assert unknown.error and "not a worker RPC method" in unknown.error
    too_early = dispatch(
        worker, Worker.RPC_METHODS, RpcCall(2, "execute_model", [{"nonsense": 1}]), rank=0
    )
    assert too_early.call_id == 2 and "ValidationError" in too_early.error
    not_loaded = dispatch(
        worker, Worker.RPC_METHODS, RpcCall(3, "determine_num_kv_blocks", [16, None]), rank=0
    )
    assert "load_model first" in not_loaded.error


def test_encoded_calls_take_typed_arguments_and_fail_as_plain_ones(engine_config, monkeypatch):
    worker = Worker(engine_config, rank=0)
    allowed = Worker.RPC_METHODS
    plain: list[bytes] = []  # the argument lists decoded as plain values (the general path)
    general = rpc.RPC_ARGUMENTS.decode
    monkeypatch.setattr(
        rpc,
        "RPC_ARGUMENTS",
        type("Spy", (), {"decode": lambda _, b: plain.append(b) or general(b)})(),
    )
    step = SchedulerOutput(step_id=1, num_scheduled_tokens={"r": 1})
    encoded = RPC_CALL.encode(RpcCall(4, "execute_model", [step]))  # as the engine sends it
    head, reply = dispatch_encoded(worker, allowed, encoded, rank=0)
    # decoded into a SchedulerOutput at once: the method itself refused (nothing loaded yet)
    assert head.call_id == 4 and plain == [] and "before load_model" in reply.error
    _, wrong = dispatch_encoded(worker, allowed, encode(5, "execute_model", {"nonsense": 1}), 0)
    assert len(plain) == 1 and wrong.call_id == 5 and "ValidationError" in wrong.error
    _, unknown = dispatch_encoded(worker, allowed, encode(6, "__init__"), rank=0)
    assert unknown.error and "not a worker RPC method" in unknown.error
    _, keywords = dispatch_encoded(worker, allowed, encode(7, "sleep", level=1), rank=0)
    assert keywords.error is None and len(plain) == 3  # keyword arguments: the general path
    head, pong = dispatch_encoded(worker, allowed, encode(8, "ping", output_rank=2), rank=0)
    assert pong.result == "pong" and head.output_rank == 2


def test_loop_leaves_when_the_parent_is_gone_or_a_signal_arrived(engine_config):
    worker = Worker(engine_config, rank=0)
    reader = ListReader([])
    reason = run_busy_loop(worker, reader, ListSender(), parent_pid=-1)
    assert "parent process -1 is gone" == reason and reader.timeouts == 1
    assert run_busy_loop(worker, reader, ListSender(), os.getppid(), lambda: True) == "signal"


def test_the_process_loop_freezes_its_heap_once_set_up(engine_config):
    """``freeze_heap`` (the worker process's loop): after the KV cache is made, what was
    allocated while loading leaves the garbage collector's full collections; a test's loop
    (the default) leaves the heap as it is, and so does a failed set-up call."""
    frozen_before = gc.get_freeze_count()
    try:
        worker = Worker(engine_config, rank=0)
        failed = ListReader([encode(1, "initialize_kv_cache", num_blocks=8, block_size=4)])
        sender = ListSender()
        run_busy_loop(worker, failed, sender, parent_pid=-1, freeze_heap=True)
        assert sender.replies[0].error is not None  # no model loaded yet: nothing frozen
        assert gc.get_freeze_count() == frozen_before
        calls = [
            encode(2, "load_model"),
            encode(3, "initialize_kv_cache", num_blocks=8, block_size=4),
        ]
        run_busy_loop(worker, ListReader(calls), ListSender(), parent_pid=-1)
        assert gc.get_freeze_count() == frozen_before  # not asked to
        again = [encode(4, "initialize_kv_cache", num_blocks=8, block_size=4)]
        run_busy_loop(worker, ListReader(again), ListSender(), parent_pid=-1, freeze_heap=True)
        assert gc.get_freeze_count() > frozen_before
    finally:
        gc.unfreeze()
