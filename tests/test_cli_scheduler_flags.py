"""The scheduler and KV-cache flags of `switchboard serve` (and the gateway's stream interval):
what the engine and gateway run with, and the values refused before anything starts."""

from __future__ import annotations

import pytest

from switchboard import cli
from switchboard.cli import serve
from switchboard.config import (
    CPU_SHARED_STEP_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    SchedulerConfig,
    with_step_budget,
)


def configs(*flags: str):
    """The gateway's and the engine's configs of `serve` with ``flags``."""
    args = cli.make_parser().parse_args(["serve", "--model", "/m", *flags])
    return serve.build_configs(args, "/m")


def engine_config(*flags: str):
    return configs(*flags)[1]


def test_defaults_prefix_caching_on_fcfs_no_chunk_cap() -> None:
    engine = engine_config()
    assert engine.cache.enable_prefix_caching is True
    assert engine.cache.num_gpu_blocks_override is None
    assert engine.cache.kv_cache_memory_bytes is None
    assert engine.scheduler.scheduling_policy == "fcfs"
    assert engine.scheduler.long_prefill_token_threshold == 0
    assert engine.scheduler.max_num_batched_tokens == 0  # the engine picks it by device


def test_the_default_token_budget_is_by_device_and_fits_every_running_request() -> None:
    def budget(device: str, max_num_seqs: int, few_rows_limit: int = 0) -> tuple[int, int]:
        config = SchedulerConfig(max_num_seqs=max_num_seqs)
        config = with_step_budget(config, device, few_rows_limit)
        return config.max_num_batched_tokens, config.shared_step_tokens

    assert budget("cpu", 256) == (MAX_NUM_BATCHED_TOKENS, CPU_SHARED_STEP_TOKENS) == (2048, 256)
    assert budget("cuda", 256) == (2048, 0)  # no separate limit
    # more running requests than a shared step holds: the scheduler gives each its decode
    assert budget("cpu", 1000) == (2048, 256)
    assert budget("cuda", 4096) == (4096, 0)
    # the workers' kernels for few rows take 128 (AVX-512): shared steps no bigger
    assert budget("cpu", 256, few_rows_limit=128) == (2048, 128)
    assert budget("cpu", 256, few_rows_limit=512) == (2048, 256)  # AVX2 alone: 256 still
    assert budget("cuda", 256, few_rows_limit=128) == (2048, 0)
    explicit = SchedulerConfig(max_num_batched_tokens=512)
    assert with_step_budget(explicit, "cpu", 128) == explicit  # a budget given holds always


def test_scheduler_and_kv_flags_reach_the_engine_config() -> None:
    engine = engine_config(
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--long-prefill-token-threshold", "128", "--scheduling-policy", "priority",
        "--no-enable-prefix-caching", "--block-size", "32",
        "--kv-cache-memory-bytes", "1048576", "--num-gpu-blocks-override", "100",
        "--gpu-memory-utilization", "0.5",
    )  # fmt: skip
    scheduler, cache = engine.scheduler, engine.cache
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (8, 512)
    assert scheduler.long_prefill_token_threshold == 128
    assert scheduler.scheduling_policy == "priority"
    assert cache.enable_prefix_caching is False and cache.block_size == 32
    assert (cache.kv_cache_memory_bytes, cache.num_gpu_blocks_override) == (1 << 20, 100)
    assert cache.gpu_memory_utilization == 0.5


@pytest.mark.parametrize(
    "flags",
    [
        ("--max-num-seqs", "0"),
        ("--max-num-batched-tokens", "0"),
        ("--block-size", "0"),
        ("--num-gpu-blocks-override", "0"),
        ("--kv-cache-memory-bytes", "0"),
        ("--long-prefill-token-threshold", "-1"),
        ("--gpu-memory-utilization", "0"),
        ("--gpu-memory-utilization", "1.5"),
        ("--scheduling-policy", "lottery"),
        ("--torch-threads", "-1"),
        ("--stream-interval", "0"),
        ("--stream-messages-per-s", "-1"),
    ],
)
def test_bad_values_are_refused(flags: tuple[str, str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        engine_config(*flags)
    assert exit_info.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_torch_threads_default_to_auto_and_a_count_is_kept() -> None:
    assert engine_config().worker.torch_threads == 0  # 0: the worker picks its share
    assert engine_config("--torch-threads", "3").worker.torch_threads == 3


def test_the_stream_interval_reaches_the_gateway() -> None:
    assert configs()[0].gateway.stream_interval == 1  # one message per token, as vLLM
    assert configs("--stream-interval", "4")[0].gateway.stream_interval == 4


def test_the_message_budget_reaches_the_gateway() -> None:
    assert configs()[0].gateway.stream_messages_per_s > 0  # on by default
    assert configs("--stream-messages-per-s", "0")[0].gateway.stream_messages_per_s == 0
