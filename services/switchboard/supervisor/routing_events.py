"""The KV events a one-machine server's engines publish for its own prefix-aware routing."""

from __future__ import annotations

import msgspec

from switchboard.config import EngineConfig, GatewayRoleConfig, ipc_address
from switchboard.config.kv_events import KVEventsConfig


def with_routing_events(
    gateway: GatewayRoleConfig, engine: EngineConfig, run_dir: str
) -> EngineConfig:
    """Prefix-aware routing across DP engines follows what each engine's prefix cache really
    holds from its KV events (gateway/engines/cache_events.py): the engines publish them on
    ipc:// sockets in the run directory unless ``--kv-events-config`` says otherwise (given at
    all, it is used as it is: ``{"enable_kv_cache_events": false}`` turns them off)."""
    routed_by_prefix = gateway.gateway.routing_policy == "prefix"
    if engine.parallel.data_parallel_size <= 1 or not routed_by_prefix:
        return engine
    if engine.cache.kv_events_config is not None or not engine.cache.enable_prefix_caching:
        return engine
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=ipc_address(run_dir, "kv-events"),
        replay_endpoint=ipc_address(run_dir, "kv-replay"),
    )
    return msgspec.structs.replace(
        engine, cache=msgspec.structs.replace(engine.cache, kv_events_config=events)
    )
