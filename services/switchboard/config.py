"""Frozen configuration per role, built once from the CLI (and environment) by the launcher.

Configs are msgspec structs so that a launcher can hand them to a child process as JSON
(``encode_config`` / ``decode_config``) without pickle. No process mutates its config.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import TypeVar

import msgspec

from switchboard.defaults import DEFAULT_GRPC_PORT

# sun_path in struct sockaddr_un holds 108 bytes including the terminating NUL.
_MAX_IPC_PATH_BYTES = 107
DEFAULT_SHUTDOWN_GRACE_S = 30.0  # SIGTERM: how long in-flight streams get (the chart matches it)


def cache_root() -> Path:
    """The folder switchboard keeps downloads, converted checkpoints and built kernels in:
    $SWITCHBOARD_CACHE, else $XDG_CACHE_HOME/switchboard, else ~/.cache/switchboard."""
    if explicit := os.environ.get("SWITCHBOARD_CACHE"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "switchboard"


class _Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config. Subclasses inherit these options; each restates ``frozen=True``
    because type checkers do not see a msgspec option inherited."""


class ModelConfig(_Config, frozen=True):
    model: str  # a Hugging Face checkpoint directory (config.json + safetensors + tokenizer.json)
    served_model_name: str = ""  # "" = the directory's name
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None = max_position_embeddings (auto-fitted to the KV cache)
    seed: int = 0
    # A Jinja chat template file for requests with chat messages (read by the gateway);
    # "" = the checkpoint's own (chat_template.jinja, else tokenizer_config.json), if any.
    chat_template: str = ""

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))


class CacheConfig(_Config, frozen=True):
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # None = fraction of free device memory / CPU default
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True


class SchedulerConfig(_Config, frozen=True):
    max_num_seqs: int = 256  # as vLLM's server default: 64 queued half of 128 clients
    max_num_batched_tokens: int = 0  # 0 = by the workers' device: with_step_budget
    # Tokens per step while more than one request is in the engine (0: max_num_batched_tokens
    # always). Only the device default sets it; an explicit --max-num-batched-tokens holds always.
    shared_step_tokens: int = 0
    long_prefill_token_threshold: int = 0  # 0 = no cap on one request's chunk
    scheduling_policy: str = "fcfs"  # fcfs | priority
    # Schedule step N+1 while the workers compute step N (engine/core.py, "the busy loop").
    async_scheduling: bool = True


# Tokens per step when --max-num-batched-tokens is not given: vLLM's server default, and on a
# CPU 256 while several requests share the engine. There a step of 2,048 prompt tokens takes
# seconds (SmolLM2-135M on 2 cores: ~2.5 s) and every decoding stream waits that long for its
# next token; 256 a step keep decoding going and spread a burst of arrivals over several steps
# (SmolLM2, 32 concurrent streams of 32-token prompts: TTFT p50 1,361 -> 636 ms, 317 -> 343
# output tok/s). A request alone is prefilled 2,048 tokens a step: one prompt of 1,900 tokens
# took 3.5 s so and 4.4 s in chunks of 256 (smaller matmuls, more steps).
MAX_NUM_BATCHED_TOKENS = 2048
CPU_SHARED_STEP_TOKENS = 256


def with_step_budget(config: SchedulerConfig, device_type: str) -> SchedulerConfig:
    """``config`` as given when it names a budget; else with the default budget for
    ``device_type`` workers, never below ``max_num_seqs`` (every running request decodes in
    every step)."""
    if config.max_num_batched_tokens:
        return config
    seqs = config.max_num_seqs
    return msgspec.structs.replace(
        config,
        max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, seqs),
        shared_step_tokens=max(CPU_SHARED_STEP_TOKENS, seqs) if device_type == "cpu" else 0,
    )


class ParallelConfig(_Config, frozen=True):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    api_servers: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class WorkerConfig(_Config, frozen=True):
    device: str = "auto"  # auto | cpu | cuda
    # Torch intra-op threads per worker; 0 = an equal share of the usable CPUs among the
    # workers on this host (worker/threads.py says why).
    torch_threads: int = 0
    # A step the workers have not answered within step_timeout_s + step_timeout_per_token_s x
    # its scheduled tokens is a stall: the worker is named in the log, the engine's stats say so
    # (its gateways stop routing to it, readiness goes NOT_SERVING with no other engine) until it
    # answers. Past execute_timeout_s + the same per-token term the engine fails (its workers are
    # treated as dead).
    step_timeout_s: float = 10.0
    step_timeout_per_token_s: float = 0.01
    execute_timeout_s: float = 60.0
    # Workers that share this host's CPUs; 0 = this engine's own (TP x PP). `serve -dp N`
    # sets N x TP x PP: its engines all run here.
    workers_on_host: int = 0


class GatewayConfig(_Config, frozen=True):
    host: str = "0.0.0.0"
    port: int = DEFAULT_GRPC_PORT
    enable_admin: bool = False
    tokenizer_threads: int = 2
    max_message_bytes: int = 64 * 1024 * 1024
    startup_timeout_s: float = 600.0
    # Observability: OTLP traces, /metrics and the periodic stats log line.
    otlp_traces_endpoint: str = ""  # "" = OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, or no tracing
    otlp_traces_protocol: str = ""  # grpc | http/protobuf; "" = OTEL_EXPORTER_OTLP_* or grpc
    trace_content: bool = False  # prompt and output text in span attributes (opt-in)
    metrics_port: int | None = None  # /metrics on this port + client_index; None = off
    # The OpenAI-compatible HTTP API (gateway/http/) on this port + client_index; 0 = a free
    # port; None = off. `serve`/`gateway` default to 8000 (as vLLM); the config itself to off.
    http_port: int | None = None
    log_stats_interval_s: float = 10.0  # the periodic stats log line; 0 = off
    # A stream's messages after its first: one per this many output tokens (and its last).
    stream_interval: int = 1
    # Admission control (gateway/admission.py), per gateway process; 0 = no cap.
    max_inflight_requests: int = 1024
    max_queued_prompt_tokens: int = 1 << 22
    # TLS on both fronts (tls.py): certificate chain and key; with a CA bundle, client
    # certificates are required and verified (mTLS). "" = plaintext.
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_ca_certs: str = ""
    # API keys (gateway/auth.py), one per line; the keys themselves never travel in a config
    # (configs are on children's command lines): given on the command line they reach the
    # gateway in $SWITCHBOARD_API_KEYS, the admin token in $SWITCHBOARD_ADMIN_TOKEN.
    api_key_file: str = ""


class EngineConfig(_Config, frozen=True):
    """Everything one engine core (and its workers) needs."""

    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    worker: WorkerConfig = WorkerConfig()
    data_parallel_rank: int = 0
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
    gateway_discovery: str = ""
    # CURVE on every tcp:// socket: the keys directory (wire/curve.py); "" = plain TCP.
    curve_keys_dir: str = ""
    discovery_interval_s: float = 5.0
    load_report_interval_s: float = 0.1  # EngineLoad at most this often
    # Worker rank r of this engine uses accelerator first_device_index + r. One machine:
    # dp_rank x TP x PP, so DP engines never share a device; an engine alone on its host
    # (`switchboard engine`): 0.
    first_device_index: int = 0


class GatewayRoleConfig(_Config, frozen=True):
    """Everything one gateway process needs."""

    model: ModelConfig
    gateway: GatewayConfig = GatewayConfig()
    client_index: int = 0
    input_address: str = ""  # ROUTER bind address
    output_address: str = ""  # PULL bind address
    num_engines: int = 1
    exit_when_engines_dead: bool = True  # one machine: the gateway exits with its engine
    # One machine with --restart-policy always: the supervisor restarts a dead engine, so the
    # gateway waits for its READY instead of exiting when its last engine dies.
    engines_restart: bool = False
    # A stream cut off by an engine's death is re-submitted (prompt + the tokens already sent)
    # to a live or restarted engine within resume_timeout_s; 0 = never (UNAVAILABLE at once).
    resume_timeout_s: float = 0.0
    # SIGTERM: NOT_SERVING at once, in-flight streams get this long to finish.
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    heartbeat_timeout_s: float = 10.0
    # Topologies beyond one engine on one machine: DP > 1 (coordinator), engines on other hosts.
    coordinator_publish_address: str = ""  # the coordinator's PUB of LoadReport ("" = none)
    # Engines on other hosts: the fixed TCP address engines say hello to ("" = one machine).
    # The data sockets then bind on port 0 of the same host and are announced in the answer.
    handshake_address: str = ""
    # CURVE on every tcp:// socket: the keys directory (wire/curve.py); "" = plain TCP.
    curve_keys_dir: str = ""


class CoordinatorConfig(_Config, frozen=True):
    """The coordinator (only when DP > 1): engines' load in, one report to every gateway out."""

    input_address: str  # PULL bind: EngineLoad from every engine
    publish_address: str  # PUB bind: LoadReport to every gateway
    num_engines: int = 1
    publish_interval_s: float = 0.1  # at most this often, when something changed
    keepalive_interval_s: float = 5.0  # at least this often, changed or not
    # CURVE on every tcp:// socket: the keys directory (wire/curve.py); "" = plain TCP.
    curve_keys_dir: str = ""


# The gateway's secrets, from the environment (never in a config): API keys one per line, and
# the AdminService token.
API_KEYS_ENV = "SWITCHBOARD_API_KEYS"
ADMIN_TOKEN_ENV = "SWITCHBOARD_ADMIN_TOKEN"

C = TypeVar("C", bound=_Config)


def encode_config(config: _Config) -> str:
    return msgspec.json.encode(config).decode()


def decode_config(text: str | bytes, kind: type[C]) -> C:
    return msgspec.json.decode(text, type=kind)


def new_run_dir(base: str | None = None) -> str:
    """A private directory for one server's ipc:// sockets; the launcher removes it at exit.
    Created 0700 (whatever the umask) and checked: its sockets are only as private as it."""
    base = base or os.environ.get("SWITCHBOARD_RPC_BASE_PATH") or tempfile.gettempdir()
    path = os.path.join(base, f"switchboard-{uuid.uuid4().hex[:12]}")
    os.makedirs(path, mode=0o700)  # fails if it exists: never one someone else made
    os.chmod(path, 0o700)
    from switchboard.wire.zmq_channel import check_private_dir

    check_private_dir(path)
    return path


def ipc_address(run_dir: str, name: str) -> str:
    """``ipc://`` of a socket file in ``run_dir``; ValueError when the path cannot be bound."""
    path = os.path.join(run_dir, name)
    if len(path.encode()) > _MAX_IPC_PATH_BYTES:
        raise ValueError(
            f"ipc socket path {path!r} is longer than {_MAX_IPC_PATH_BYTES} bytes; "
            "use a shorter run directory"
        )
    return f"ipc://{path}"
