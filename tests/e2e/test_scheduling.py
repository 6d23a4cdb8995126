"""The scheduler through the whole system: greedy output does not depend on how the engine
sliced the work, and the scheduler's facts (prefix-cache hits, preemptions, KV sizing,
utilities) reach the client.

Real servers (`switchboard serve` on the tiny checkpoint), driven over gRPC. One server per
configuration, shared by the tests that need it:

* ``main``     admin on, KV cache from a memory budget: the "alone" reference (each prompt run
               by itself, prefix cache reset first), all together, prefix-cache hits, utilities;
* ``chunked``  a token budget of 8 per step: every prompt is prefilled in many chunks;
* ``cramped``  10 KV blocks: max_model_len auto-fitted to 160, requests preempted and recomputed;
* ``priority`` priority policy, one sequence at a time: priorities reverse the arrival order.

Requests are queued while the engine sleeps where a test needs them all waiting at once (the
only way to make "all at once" certain rather than likely).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from tests.e2e.client_calls import greedy_request, streamed_token_ids, utility
from tests.e2e.server import RunningServer, start_server, wait_until
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
LONG_MAX_TOKENS = 450  # hundreds of steps: still running when a utility call arrives
SLEEP_RACE_ATTEMPTS = 5  # tries to catch the long request running (a race, see its test)
RPC_TIMEOUT_S = 120.0  # generous: other tests share the two cores
BLOCK_SIZE = 16  # the server default
KV_BUDGET_BYTES = 4 << 20  # the main server's --kv-cache-memory-bytes
# Enough for every prompt at once, and quick to allocate (the CPU default is 1 GiB).
SMALL_KV_CACHE = ("--num-gpu-blocks-override", "128")
CRAMPED_BLOCKS = 10  # 160 tokens of KV: less than the model's 512 positions

SYSTEM = (
    "You are a careful assistant for the Python standard library. Answer with short, correct "
    "code and explain each step: the glob module finds path names matching a pattern, fnmatch "
    "compares names against shell patterns, and bisect keeps lists in sorted order without "
    "sorting them again."
)
PROMPTS = {  # 1 to 8 KV blocks each; the last two share a 6-block system prompt
    "short": "def add(a, b):\n    return a + b\n",
    "mid": "Split the string into a list of words, keeping quoted phrases together, the way a "
    "shell would do it for the command line.",
    "long": 'class TextWrapper:\n    """Object for wrapping and filling text. The public '
    "interface consists of the wrap() and fill() methods; the other methods are just there "
    'for subclasses to override in order to tweak the default behaviour."""\n    width = 70\n',
    "system-glob": SYSTEM + "\nQuestion: which module matches file names?",
    "system-bisect": SYSTEM + "\nQuestion: how do I insert into a sorted list?",
}


@dataclass
class Result:
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int  # PromptInfo
    cached_prompt_tokens: int  # Usage
    num_preemptions: int
    first_token_ns: int  # the engine's first-token time on the wall clock


# ---------------------------------------------------------------- gRPC helpers


def greedy(text: str, priority: int = 0) -> pb.GenerateRequest:
    return greedy_request(
        text, MAX_TOKENS, final_only=True, return_token_ids=True, priority=priority
    )


def generate(channel: grpc.Channel, text: str, priority: int = 0) -> Result:
    stub = pb_grpc.GenerationServiceStub(channel)
    (final,) = list(stub.Generate(greedy(text, priority), timeout=RPC_TIMEOUT_S))
    (sequence,) = final.outputs
    assert sequence.finish_reason == pb.FINISH_REASON_LENGTH
    metrics = final.metrics
    return Result(
        token_ids=list(sequence.token_ids),
        num_prompt_tokens=final.prompt_info.num_prompt_tokens,
        num_cached_tokens=final.prompt_info.num_cached_tokens,
        cached_prompt_tokens=final.usage.cached_prompt_tokens,
        num_preemptions=metrics.num_preemptions,
        first_token_ns=metrics.arrival_time.ToNanoseconds()
        + metrics.time_to_first_token.ToNanoseconds(),
    )


def generate_all(channel: grpc.Channel, names: list[str]) -> dict[str, Result]:
    """Every prompt at once, one thread each."""
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(generate, channel, PROMPTS[name]) for name in names}
        return {name: future.result(RPC_TIMEOUT_S) for name, future in futures.items()}


def while_asleep(
    channel: grpc.Channel, submit: Callable[[ThreadPoolExecutor], list[Future]]
) -> list[Any]:
    """Put the engine to sleep, let ``submit`` queue requests (it waits until they are all in
    the engine's waiting queue), wake it up and return the results: the requests meet the
    scheduler all at once."""
    utility(channel, "sleep", 1)
    with ThreadPoolExecutor(8) as pool:
        try:
            futures = submit(pool)
        finally:
            utility(channel, "wake_up")
        return [future.result(RPC_TIMEOUT_S) for future in futures]


def submit_in_order(channel: grpc.Channel, pool: ThreadPoolExecutor, requests) -> list[Future]:
    """Submit (name, priority) pairs one by one, each after the previous one is queued."""
    futures = []
    for name, priority in requests:
        futures.append(pool.submit(generate, channel, PROMPTS[name], priority))
        queued = len(futures)
        wait_until(
            lambda q=queued: utility(channel, "get_stats")["num_waiting"] == q,
            f"{queued} requests wait",
        )
    return futures


# ---------------------------------------------------------------- servers


@dataclass
class Served:
    server: RunningServer
    channel: grpc.Channel


@contextlib.contextmanager
def serve(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Iterator[Served]:
    server = start_server(tiny_llama_dir(), tmp_path_factory.mktemp(name), *args)
    try:
        with server.channel() as channel:
            yield Served(server, channel)
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    budget = str(KV_BUDGET_BYTES)
    with serve(tmp_path_factory, "main", "--enable-admin", "--kv-cache-memory-bytes", budget) as s:
        yield s


@pytest.fixture(scope="module")
def reference(main: Served) -> dict[str, Result]:
    """Each prompt alone, with nothing cached: the output every other run must reproduce."""
    results = {}
    for name, text in PROMPTS.items():
        assert utility(main.channel, "reset_prefix_cache") is True
        results[name] = generate(main.channel, text)
        assert results[name].num_cached_tokens == 0
        assert len(results[name].token_ids) == MAX_TOKENS
    return results


def assert_same_output(results: dict[str, Result], reference: dict[str, Result]) -> None:
    for name, result in results.items():
        assert result.token_ids == reference[name].token_ids, name


def run_queued_together(
    channel: grpc.Channel, names: list[str], priorities: list[int] | None = None
) -> dict[str, Result]:
    """Queue the prompts (in this order) while the engine sleeps, then wake it up."""
    requests = list(zip(names, priorities or [0] * len(names), strict=True))
    results = while_asleep(channel, lambda pool: submit_in_order(channel, pool, requests))
    return dict(zip(names, results, strict=True))


def server_info(channel: grpc.Channel) -> tuple[model_pb.GetModelInfoResponse, model_pb.EngineInfo]:
    stub = model_grpc.ModelServiceStub(channel)
    info = stub.GetModelInfo(model_pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
    (engine,) = stub.GetServerInfo(model_pb.GetServerInfoRequest(), timeout=RPC_TIMEOUT_S).engines
    return info, engine


# ---------------------------------------------------------------- main server


def test_prompts_span_several_blocks(reference: dict[str, Result]) -> None:
    blocks = sorted(-(-r.num_prompt_tokens // BLOCK_SIZE) for r in reference.values())
    assert blocks[0] == 1 and blocks[-1] >= 7, blocks


def test_all_together_equals_alone(main: Served, reference: dict[str, Result]) -> None:
    assert utility(main.channel, "reset_prefix_cache") is True
    results = run_queued_together(main.channel, list(PROMPTS))
    assert_same_output(results, reference)
    # The cache was empty: only the second system prompt may find blocks, the first one's.
    assert all(r.num_cached_tokens == 0 for n, r in results.items() if n != "system-bisect")
    assert all(r.cached_prompt_tokens == r.num_cached_tokens for r in results.values())


def test_prefix_cache_hit_equals_alone(main: Served, reference: dict[str, Result]) -> None:
    channel = main.channel
    assert utility(channel, "reset_prefix_cache") is True
    assert generate(channel, PROMPTS["system-glob"]).num_cached_tokens == 0
    second = generate(channel, PROMPTS["system-bisect"])  # shares the system prompt's blocks
    again = generate(channel, PROMPTS["system-glob"])  # everything but the last token cached
    assert_same_output({"system-bisect": second, "system-glob": again}, reference)
    assert second.num_cached_tokens >= 5 * BLOCK_SIZE
    assert second.cached_prompt_tokens == second.num_cached_tokens
    assert again.num_cached_tokens == (again.num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.cached_prompt_tokens == again.num_cached_tokens
    stats = utility(channel, "get_stats")
    assert stats["prefix_cache_hits"] > 0 and 0 < stats["prefix_cache_hit_rate"] < 1


def test_kv_cache_sized_from_the_memory_budget(main: Served) -> None:
    with open(os.path.join(tiny_llama_dir(), "config.json")) as f:
        config = json.load(f)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    num_blocks = KV_BUDGET_BYTES // (BLOCK_SIZE * bytes_per_token)
    info, engine = server_info(main.channel)
    assert engine.num_gpu_blocks == num_blocks
    assert engine.kv_block_size == BLOCK_SIZE
    assert engine.kv_capacity_tokens == num_blocks * BLOCK_SIZE
    assert info.max_model_len == config["max_position_embeddings"]  # the cache holds it
    assert utility(main.channel, "get_stats")["num_blocks"] == num_blocks


def test_get_stats_and_reset_prefix_cache(main: Served, reference: dict[str, Result]) -> None:
    channel = main.channel
    stats = utility(channel, "get_stats")
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_cache_usage"] == 0  # idle: cached blocks are free to evict
    assert stats["num_preemptions"] >= 0 and stats["is_sleeping"] is False
    assert "prefix_cache_hit_rate" in stats
    generate(channel, PROMPTS["long"])  # cached now
    assert utility(channel, "reset_prefix_cache") is True
    assert generate(channel, PROMPTS["long"]).num_cached_tokens == 0  # forgotten


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up(main: Served, reference: dict[str, Result], level: int) -> None:
    channel = main.channel
    generate(channel, PROMPTS["mid"])  # cached: sleeping must forget it with the KV memory
    assert utility(channel, "is_sleeping") is False
    utility(channel, "sleep", level)
    try:
        assert utility(channel, "is_sleeping") is True
        stats = utility(channel, "get_stats")
        assert stats["sleep_level"] == level and stats["is_sleeping"] is True
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(generate, channel, PROMPTS["mid"])
            wait_until(lambda: utility(channel, "get_stats")["num_waiting"] == 1, "it waits")
            assert not future.done()  # nothing runs while asleep
            utility(channel, "wake_up")
            result = future.result(RPC_TIMEOUT_S)
    finally:
        utility(channel, "wake_up")  # a no-op when awake
    assert utility(channel, "is_sleeping") is False
    assert result.token_ids == reference["mid"].token_ids
    assert result.num_cached_tokens == 0
    if level == 2:
        assert "weights dropped" in main.server.log()


def test_sleep_preempts_a_running_request_and_it_resumes_identically(main: Served) -> None:
    """A long request is running when the engine goes to sleep: it is preempted, waits, and
    after wake_up is recomputed and finishes with the tokens it would have had anyway.

    Whether the sleep arrives before the request's last step is a race the test cannot
    control (the tiny model decodes fast); an attempt that loses it is retried."""
    channel = main.channel
    long_request = greedy(PROMPTS["mid"])
    long_request.stopping.max_tokens = LONG_MAX_TOKENS
    stub = pb_grpc.GenerationServiceStub(channel)
    (alone,) = list(stub.Generate(long_request, timeout=RPC_TIMEOUT_S))
    long_request.output.kind = pb.OUTPUT_KIND_DELTA
    for _ in range(SLEEP_RACE_ATTEMPTS):
        stream = stub.Generate(long_request, timeout=RPC_TIMEOUT_S)
        try:
            first = next(stream)  # it is running now: a token came back
            utility(channel, "sleep", 1)
            try:
                stats = utility(channel, "get_stats")
            finally:
                utility(channel, "wake_up")
            messages = [first, *stream]
        finally:
            stream.cancel()
        token_ids = streamed_token_ids(messages)
        assert token_ids == list(alone.outputs[0].token_ids)
        assert len(token_ids) == LONG_MAX_TOKENS
        assert stats["num_running"] == 0  # asleep: nothing runs
        preempted = stats["num_waiting"] == 1  # else it had already finished
        assert messages[-1].metrics.num_preemptions == (1 if preempted else 0)
        if preempted:
            return
    pytest.fail(f"the request finished before the sleep in all {SLEEP_RACE_ATTEMPTS} attempts")


# ---------------------------------------------------------------- a tiny token budget


@pytest.fixture(scope="module")
def chunked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    budget = ("--max-num-batched-tokens", "8", "--long-prefill-token-threshold", "4")
    with serve(tmp_path_factory, "chunked", *SMALL_KV_CACHE, *budget) as served:
        yield served


def test_tiny_token_budget_equals_alone(chunked: Served, reference: dict[str, Result]) -> None:
    names = list(PROMPTS)
    assert_same_output(generate_all(chunked.channel, names), reference)
    again = generate_all(chunked.channel, names)  # chunks now start after a prefix-cache hit
    assert_same_output(again, reference)
    assert all(r.num_cached_tokens > 0 for r in again.values() if r.num_prompt_tokens > 16)


def test_admin_is_off_unless_enabled(chunked: Served) -> None:
    with pytest.raises(grpc.RpcError) as error:
        utility(chunked.channel, "get_stats")
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ---------------------------------------------------------------- few KV blocks


@pytest.fixture(scope="module")
def cramped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    blocks = ("--num-gpu-blocks-override", str(CRAMPED_BLOCKS))
    with serve(tmp_path_factory, "cramped", "--enable-admin", *blocks) as served:
        yield served


def test_max_model_len_auto_fitted_to_the_kv_cache(cramped: Served) -> None:
    capacity = CRAMPED_BLOCKS * BLOCK_SIZE
    assert f"max_model_len auto-fitted down to {capacity}" in cramped.server.log()
    info, engine = server_info(cramped.channel)
    assert info.max_model_len == capacity
    assert engine.num_gpu_blocks == CRAMPED_BLOCKS and engine.kv_capacity_tokens == capacity
    too_long = " ".join([SYSTEM] * 2)  # ~220 tokens: fine for the model, not for this cache
    with pytest.raises(grpc.RpcError) as error:
        generate(cramped.channel, too_long)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in error.value.details()


def test_preempted_and_recomputed_equals_alone(
    cramped: Served, reference: dict[str, Result]
) -> None:
    results = run_queued_together(cramped.channel, list(PROMPTS))
    assert_same_output(results, reference)
    assert any(r.num_preemptions > 0 for r in results.values())
    assert utility(cramped.channel, "get_stats")["num_preemptions"] > 0


# ---------------------------------------------------------------- priorities


@pytest.fixture(scope="module")
def by_priority(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    policy = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
    with serve(tmp_path_factory, "priority", "--enable-admin", *SMALL_KV_CACHE, *policy) as served:
        yield served


def test_priorities_reverse_the_order_and_output_equals_alone(
    by_priority: Served, reference: dict[str, Result]
) -> None:
    names = ["short", "mid", "long", "system-glob"]  # arrival order
    results = run_queued_together(by_priority.channel, names, priorities=[3, 2, 1, 0])
    assert_same_output(results, reference)
    # One sequence at a time: the engine's first-token times give the order they ran in.
    assert sorted(names, key=lambda name: results[name].first_token_ns) == names[::-1]
