"""The engine core's config and its parts: KV cache, scheduler, parallelism, workers."""

from typing import Annotated

import msgspec

from switchboard.common.flags import (
    AT_LEAST_0,
    AT_LEAST_1,
    NO_CAP_OR_MORE,
    POSITIVE,
    Accepts,
    Flag,
    Group,
)
from switchboard.config.kv_events import KVEventsConfig
from switchboard.config.model import ModelConfig
from switchboard.config.struct import Config, curve_keys_flag


class CacheConfig(Config, frozen=True):
    block_size: Annotated[
        int,
        Flag(
            "token slots per KV block (the prefix cache shares whole blocks)",
            Group.SCHEDULER,
            accepts=AT_LEAST_1,
        ),
    ] = 16
    num_gpu_blocks_override: Annotated[
        int | None,
        Flag(
            "KV blocks per engine, instead of sizing them from memory (default: as many as the "
            "KV cache budget holds, see --kv-cache-memory-bytes)",
            Group.SCHEDULER,
            accepts=AT_LEAST_1,
        ),
    ] = None
    kv_cache_memory_bytes: Annotated[
        int | None,
        Flag(
            "KV cache budget per worker (default: --gpu-memory-utilization; 1 GiB on CPU)",
            Group.SCHEDULER,
            accepts=AT_LEAST_1,
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float,
        Flag(
            "share of the device memory left free after loading the weights, for the KV cache",
            Group.SCHEDULER,
            accepts=Accepts(0, 1, low_excluded=True),
        ),
    ] = 0.9
    enable_prefix_caching: Annotated[
        bool,
        Flag("automatic prefix caching (--no-enable-prefix-caching: off)", Group.SCHEDULER),
    ] = True
    kv_events_config: Annotated[
        KVEventsConfig | None,
        Flag(
            "publish the prefix cache's block events over ZeroMQ, as vLLM's flag of this name: "
            'JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5558"}\' (DP rank r: the ports + r; '
            "docs/operations.md, KV events) (default: none; `serve -dp N` with prefix routing: "
            "ipc:// sockets in the run directory, followed by the gateways' router)",
            Group.SCHEDULER,
            metavar="JSON",
        ),
    ] = None


# Tokens per step when --max-num-batched-tokens is not given: vLLM's server default, and on a
# CPU 256 while several requests share the engine. There a step of 2,048 prompt tokens takes
# seconds (SmolLM2-135M on 2 cores: ~2.5 s) and every decoding stream waits that long for its
# next token; 256 a step keep decoding going and spread a burst of arrivals over several steps
# (SmolLM2, 32 concurrent streams of 32-token prompts: TTFT p50 1,361 -> 636 ms, 317 -> 343
# output tok/s). A request alone is prefilled 2,048 tokens a step: one prompt of 1,900 tokens
# took 3.5 s so and 4.4 s in chunks of 256 (smaller matmuls, more steps). Where the workers'
# kernels for few rows take fewer than 256 (128 with AVX-512), a shared step takes no more:
# past them a step leaves the one-call layer stack for oneDNN, no faster a row in float32 and
# 3-5x slower in bfloat16 without AMX; and a burst's first prompts get their tokens a shorter
# step sooner (docs/operations.md, "Step budget").
MAX_NUM_BATCHED_TOKENS = 2048
CPU_SHARED_STEP_TOKENS = 256


class SchedulerConfig(Config, frozen=True):
    # As vLLM's server default: 64 queued half of 128 clients.
    max_num_seqs: Annotated[
        int, Flag("running requests at most", Group.SCHEDULER, accepts=AT_LEAST_1)
    ] = 256
    max_num_batched_tokens: Annotated[
        int,  # 0 = by the workers' device: with_step_budget
        Flag(
            "tokens per engine step; longer prompts are prefilled in chunks (default: "
            f"{MAX_NUM_BATCHED_TOKENS}; on CPU workers {CPU_SHARED_STEP_TOKENS} while more than "
            "one request is in the engine, 128 where the CPU kernels for few rows take 128 "
            "(AVX-512); at least --max-num-seqs)",
            Group.SCHEDULER,
            accepts=AT_LEAST_1,
        ),
    ] = 0
    # Tokens per step while more than one request is in the engine (0: max_num_batched_tokens
    # always); while the running requests take more than a quarter of it, their decodes and a
    # whole shared budget more (engine/scheduler.py). Only the device default sets it; an explicit
    # --max-num-batched-tokens holds always.
    shared_step_tokens: int = 0
    long_prefill_token_threshold: Annotated[
        int,
        Flag(
            "one request's prefill chunk at most while others are eligible (0: no cap)",
            Group.SCHEDULER,
            accepts=NO_CAP_OR_MORE,
        ),
    ] = 0
    scheduling_policy: Annotated[
        str,
        Flag(
            "priority: by GenerateRequest.priority (lower first), preempting the lowest",
            Group.SCHEDULER,
            choices=("fcfs", "priority"),
        ),
    ] = "fcfs"
    # Schedule step N+1 while the workers compute step N (engine/core.py, "the busy loop").
    async_scheduling: Annotated[
        bool,
        Flag(
            "schedule the next step while the workers compute one, so the engine's turn "
            "between steps is off the critical path (--no-async-scheduling: one at a time)",
            Group.SCHEDULER,
        ),
    ] = True
    # JSON text, parsed by config/speculative.py (vLLM's format); "" = no speculation.
    speculative_config: Annotated[
        str,
        Flag(
            "speculative decoding, as vLLM's JSON: "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
            "proposes tokens from the prompt and output so far, "
            '\'{"model": DIR, "num_speculative_tokens": 4}\' with a smaller draft model '
            "sharing the tokenizer; either is verified in one forward pass (default: off)",
            Group.SCHEDULER,
            metavar="JSON",
        ),
    ] = ""


def with_step_budget(
    config: SchedulerConfig, device_type: str, few_rows_limit: int = 0
) -> SchedulerConfig:
    """``config`` as given when it names a budget; else with the default budget for
    ``device_type`` workers, never below ``max_num_seqs`` (every running request decodes in
    every step). ``few_rows_limit``: the most tokens a step may have to run on the workers'
    kernels for few rows (0: none); a CPU's shared steps take no more."""
    if config.max_num_batched_tokens:
        return config
    shared = 0
    if device_type == "cpu":
        shared = min(CPU_SHARED_STEP_TOKENS, few_rows_limit or CPU_SHARED_STEP_TOKENS)
    return msgspec.structs.replace(
        config,
        max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, config.max_num_seqs),
        shared_step_tokens=shared,
    )


class ParallelConfig(Config, frozen=True):
    tensor_parallel_size: Annotated[
        int,
        Flag(
            "workers per pipeline stage, each holding a slice of every layer",
            Group.PARALLEL,
            aliases=("-tp",),
            accepts=AT_LEAST_1,
        ),
    ] = 1
    pipeline_parallel_size: Annotated[
        int,
        Flag(
            "pipeline stages per engine, each holding a run of consecutive layers",
            Group.PARALLEL,
            aliases=("-pp",),
            accepts=AT_LEAST_1,
        ),
    ] = 1
    data_parallel_size: Annotated[
        int,
        Flag(
            "engine cores, each with its own workers and KV cache",
            Group.PARALLEL,
            aliases=("-dp",),
            accepts=AT_LEAST_1,
        ),
    ] = 1
    api_servers: Annotated[
        int,  # the command line's default is DP (cli/serve.py)
        Flag(
            "gateway processes sharing the port (default: DP)",
            Group.GATEWAY,
            default=None,
            accepts=AT_LEAST_1,
        ),
    ] = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class WorkerConfig(Config, frozen=True):
    device: Annotated[
        str,
        Flag(
            "where the workers run the model; auto: cuda when torch sees one, else cpu",
            Group.PARALLEL,
            choices=("auto", "cpu", "cuda"),
        ),
    ] = "auto"
    # worker/threads.py says why the default is an equal share.
    torch_threads: Annotated[
        int,
        Flag(
            "torch intra-op threads per worker (default 0: the usable CPUs shared equally "
            "among the workers on this host)",
            Group.PARALLEL,
            accepts=Accepts(0, says="at least 0 (0: an equal share of the CPUs)"),
        ),
    ] = 0
    # worker/step_threads.py: a short step of many streams split over threads buys little and
    # takes the core their gateway, engine core and clients need.
    adaptive_step_threads: Annotated[
        bool,
        Flag(
            "CPU workers run a step of 16 or more streams and at most 256 tokens on one thread "
            "while such steps take under 6 ms there (a small model's; larger ones go back to all "
            "threads after four); --no-adaptive-step-threads: every step on all of them",
            Group.PARALLEL,
        ),
    ] = True
    # A stalled worker is named in the log and the engine's stats say so: its gateways stop
    # routing to it, readiness goes NOT_SERVING with no other engine, until it answers.
    step_timeout_s: Annotated[
        float,
        Flag(
            "a worker that has not answered a step within this (plus "
            "--step-timeout-per-token-s per scheduled token) is stalled: logged by rank and pid, "
            "its engine takes no new requests until it answers",
            Group.FAILURES,
            accepts=POSITIVE,
        ),
    ] = 10.0
    step_timeout_per_token_s: Annotated[
        float,
        Flag(
            "added to both step timeouts per token of the step (a long prefill is no stall)",
            Group.FAILURES,
            accepts=AT_LEAST_0,
        ),
    ] = 0.01
    execute_timeout_s: Annotated[
        float,
        Flag(
            "the hard step timeout (plus the per-token term): past it the worker is treated "
            "as dead and its engine fails",
            Group.FAILURES,
            accepts=POSITIVE,
        ),
    ] = 60.0
    # Workers that share this host's CPUs; 0 = this engine's own (TP x PP). `serve -dp N`
    # sets N x TP x PP: its engines all run here.
    workers_on_host: int = 0


class EngineConfig(Config, frozen=True):
    """Everything one engine core (and its workers) needs."""

    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    worker: WorkerConfig = WorkerConfig()
    data_parallel_rank: Annotated[
        int,  # `switchboard engine` without the flag: the host name's ordinal (role_commands.py)
        Flag(
            "this engine's DP rank (default: the ordinal ending the host name, as in a "
            "StatefulSet pod 'engine-3', else 0)",
            Group.GATEWAYS_ELSEWHERE,
            default=None,
            accepts=AT_LEAST_0,
        ),
    ] = 0
    # Wire-1 addresses of every gateway, in client_index order.
    gateway_input_addresses: list[str] = []  # the gateways' ROUTERs (engine connects a DEALER)
    gateway_output_addresses: list[str] = []  # the gateways' PULLs (engine connects a PUSH)
    run_dir: str = ""  # where this engine may create ipc:// sockets
    heartbeat_interval_s: float = 1.0
    # One machine with restarts: an engine stopped (SIGSTOP) longer than this, the gateways'
    # heartbeat timeout, has been declared dead by them; it exits on waking (and is restarted).
    # 0 = never.
    exit_after_frozen_s: float = 0.0
    # Topologies beyond one engine on one machine: DP > 1 (coordinator), engines on other hosts.
    coordinator_address: str = ""  # the coordinator's PULL for EngineLoad ("" = no coordinator)
    # Engines on other hosts: "name:port" of the gateways' handshake port. The name is resolved
    # every discovery_interval_s and every address it lists is a gateway; the static address
    # lists above are then unused.
    gateway_discovery: Annotated[
        str,
        Flag(
            "NAME:PORT: a DNS name listing every gateway (e.g. a headless Service) and their "
            "handshake port; re-resolved periodically",
            Group.GATEWAYS_ELSEWHERE,
            name="--gateway-address",
            required=True,
        ),
    ] = ""
    discovery_interval_s: Annotated[
        float,
        Flag(
            "seconds between two resolutions of --gateway-address (new gateways join then)",
            Group.GATEWAYS_ELSEWHERE,
            name="--discovery-interval",
            metavar="S",
            accepts=POSITIVE,
        ),
    ] = 5.0
    curve_keys_dir: Annotated[str, curve_keys_flag(Group.GATEWAYS_ELSEWHERE)] = ""
    load_report_interval_s: float = 0.1  # EngineLoad at most this often
    # Worker rank r of this engine uses accelerator first_device_index + r. One machine:
    # dp_rank x TP x PP, so DP engines never share a device; an engine alone on its host
    # (`switchboard engine`): 0.
    first_device_index: int = 0
