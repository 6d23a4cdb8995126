"""Frozen configuration per role, built once from the CLI (and environment) by the launcher.

Configs are msgspec structs so that a launcher can hand them to a child process as JSON
(``encode_config`` / ``decode_config``) without pickle. No process mutates its config.
A field the command line sets declares its flag, help included, on itself
(``switchboard.common.flags``); the CLI is built from these declarations.
"""

from switchboard.config.coordinator import CoordinatorConfig
from switchboard.config.engine import (
    CPU_SHARED_STEP_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
    with_step_budget,
)
from switchboard.config.gateway import (
    ADMIN_TOKEN_ENV,
    API_KEYS_ENV,
    DEFAULT_SHUTDOWN_GRACE_S,
    METRICS_TOKEN_ENV,
    GatewayConfig,
    GatewayRoleConfig,
)
from switchboard.config.kv_events import KVEventsConfig
from switchboard.config.model import ModelConfig
from switchboard.config.paths import cache_root, ipc_address, new_run_dir
from switchboard.config.struct import Config, decode_config, encode_config

__all__ = [
    "ADMIN_TOKEN_ENV",
    "API_KEYS_ENV",
    "CPU_SHARED_STEP_TOKENS",
    "DEFAULT_SHUTDOWN_GRACE_S",
    "MAX_NUM_BATCHED_TOKENS",
    "METRICS_TOKEN_ENV",
    "CacheConfig",
    "Config",
    "CoordinatorConfig",
    "EngineConfig",
    "GatewayConfig",
    "GatewayRoleConfig",
    "KVEventsConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "WorkerConfig",
    "cache_root",
    "decode_config",
    "encode_config",
    "ipc_address",
    "new_run_dir",
    "with_step_budget",
]
