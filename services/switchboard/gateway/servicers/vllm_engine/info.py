"""What ``GetModelInfo``, ``GetServerInfo`` and ``GetLoads`` answer, from the gateway's model
facts, its engines' READY and the load table it keeps (the coordinator's reports with DP > 1,
each engine's own scheduler stats otherwise)."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from smg_grpc_proto import vllm_engine_pb2 as vllm_pb

import switchboard
from switchboard.gateway.api_errors import invalid_argument
from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.state import GatewayState

SERVER_TYPE = "switchboard"
# GetLoadsRequest.include: the sections there are; every one of them is "core".
LOAD_SECTIONS = frozenset({"core", "all"})
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _checkpoint_config(model_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def model_info(state: GatewayState) -> vllm_pb.GetModelInfoResponse:
    facts = state.facts
    config = _checkpoint_config(facts.model_path)
    defaults = {
        key: facts.sampling_defaults[key]
        for key in _SAMPLING_DEFAULT_KEYS
        if key in facts.sampling_defaults
    }
    architectures = config.get("architectures")
    return vllm_pb.GetModelInfoResponse(
        model_path=facts.model_path,
        is_generation=facts.tasks.can_generate,
        max_context_length=facts.max_model_len,
        vocab_size=facts.vocab_size,
        supports_vision=False,
        served_model_name=facts.name,
        tokenizer_path=facts.model_path,
        model_type=str(config.get("model_type") or ""),
        architectures=[str(a) for a in architectures] if isinstance(architectures, list) else [],
        eos_token_ids=list(facts.eos_token_ids),
        pad_token_id=_int_or(config.get("pad_token_id"), -1),
        bos_token_id=facts.bos_token_id if facts.bos_token_id is not None else -1,
        max_req_input_len=facts.max_model_len,
        default_sampling_params_json=json.dumps(defaults, separators=(",", ":"))
        if defaults
        else "",
    )


def _first_ready(state: GatewayState) -> EngineHandle | None:
    live = sorted(state.engines.live_engines, key=lambda e: e.ready.data_parallel_rank)
    return live[0] if live else None


def server_info(
    state: GatewayState, active_requests: int, last_receive: float, uptime_s: float
) -> vllm_pb.GetServerInfoResponse:
    engine = _first_ready(state)
    ready = engine.ready if engine is not None else None
    return vllm_pb.GetServerInfoResponse(
        active_requests=active_requests,
        is_paused=False,
        last_receive_timestamp=last_receive,
        uptime_seconds=uptime_s,
        server_type=SERVER_TYPE,
        data_parallel_size=max(1, state.config.num_engines),
        kv_cache_dtype="auto",  # the model's dtype
        block_size=ready.block_size if ready is not None else 0,
        model_dtype=state.facts.dtype,
        max_num_seqs=ready.max_num_seqs if ready is not None else 0,
        # a constraint applies from the first generated token (no reasoning parser here)
        constrained_decoding_start="first_token",
    )


def scheduler_load(rank: int, engine: EngineHandle) -> vllm_pb.SchedulerLoad:
    """One rank's load: the coordinator's latest report of it where there is one (DP > 1, as
    routing reads it), else the engine's own latest stats."""
    stats = engine.scheduler_stats
    counts = engine.load or stats  # both carry num_running_reqs, num_waiting_reqs, kv usage
    running = counts.num_running_reqs if counts is not None else 0
    waiting = counts.num_waiting_reqs if counts is not None else 0
    usage = counts.kv_cache_usage if counts is not None else 0.0
    capacity = engine.ready.kv_capacity_tokens
    hit_rate = 0.0
    if stats is not None and stats.prefix_cache_queries:
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries
    max_running = engine.ready.max_num_seqs
    return vllm_pb.SchedulerLoad(
        dp_rank=rank,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_total_reqs=running + waiting,
        num_used_tokens=round(usage * capacity),
        max_total_num_tokens=capacity,
        token_usage=usage,
        cache_hit_rate=hit_rate,
        utilization=running / max_running if max_running else 0.0,
        max_running_requests=max_running,
    )


def loads(state: GatewayState, request: vllm_pb.GetLoadsRequest) -> vllm_pb.GetLoadsResponse:
    unknown = sorted(set(request.include) - LOAD_SECTIONS)
    if unknown:
        raise invalid_argument(
            "include", f"include: unknown sections {unknown} (there is one: 'core')"
        )
    engines = {
        engine.ready.data_parallel_rank: engine
        for engine in state.engines.engines.values()
        if engine.alive
    }
    if request.HasField("dp_rank"):
        if request.dp_rank not in engines:
            raise invalid_argument(
                "dp_rank",
                f"dp_rank: no live engine of rank {request.dp_rank} (live: {sorted(engines)})",
            )
        engines = {request.dp_rank: engines[request.dp_rank]}
    entries = [scheduler_load(rank, engine) for rank, engine in sorted(engines.items())]
    return vllm_pb.GetLoadsResponse(
        timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
        version=switchboard.__version__,
        dp_rank_count=len(entries),
        loads=entries,
    )
