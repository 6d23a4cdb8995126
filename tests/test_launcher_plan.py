"""The per-process configs of a one-machine server (``launcher.plan_server``); nothing started."""

from __future__ import annotations

import msgspec

from switchboard.config import (
    CacheConfig,
    EngineConfig,
    GatewayConfig,
    GatewayRoleConfig,
    ModelConfig,
    ParallelConfig,
)
from switchboard.config.kv_events import KVEventsConfig
from switchboard.supervisor.launcher import plan_coordinator, plan_server
from switchboard.supervisor.ready_report import ready_line, server_addresses


def plan(a: int, dp: int, pp: int, tp: int, run_dir: str = "/run/sb"):
    parallel = ParallelConfig(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, api_servers=a
    )
    model = ModelConfig(model="/m")
    engine = EngineConfig(model=model, parallel=parallel)
    return plan_server(GatewayRoleConfig(model=model), engine, run_dir), engine


def test_every_engine_talks_to_every_gateway_and_the_coordinator() -> None:
    (gateways, engines), engine = plan(a=3, dp=2, pp=1, tp=1)
    coordinator = plan_coordinator(engine, "/run/sb")
    assert coordinator is not None
    assert [g.client_index for g in gateways] == [0, 1, 2]
    assert {g.coordinator_publish_address for g in gateways} == {coordinator.publish_address}
    assert [e.data_parallel_rank for e in engines] == [0, 1]
    for e in engines:
        assert e.gateway_input_addresses == [g.input_address for g in gateways]
        assert e.gateway_output_addresses == [g.output_address for g in gateways]
        assert e.coordinator_address == coordinator.input_address


def test_one_engine_has_no_coordinator() -> None:
    (gateways, engines), engine = plan(a=1, dp=1, pp=1, tp=2)
    assert plan_coordinator(engine, "/run/sb") is None
    assert engines[0].coordinator_address == "" and gateways[0].coordinator_publish_address == ""


def test_data_parallel_engines_never_share_a_device() -> None:
    # -dp 3 -pp 2 -tp 2 on one machine: engine r's workers use devices 4r .. 4r + 3.
    (_, engines), _ = plan(a=1, dp=3, pp=2, tp=2)
    assert [e.first_device_index for e in engines] == [0, 4, 8]


def test_every_worker_of_one_machine_counts_for_the_thread_share() -> None:
    # -dp 3 -tp 2: six workers share the host's CPUs; a configured count is kept as it is.
    (_, engines), _ = plan(a=1, dp=3, pp=1, tp=2)
    assert [e.worker.workers_on_host for e in engines] == [6, 6, 6]
    assert all(e.worker.torch_threads == 0 for e in engines)


def test_the_ready_line_lists_every_address() -> None:
    parallel = ParallelConfig(data_parallel_size=2, api_servers=2)
    model = ModelConfig(model="/models/tiny")
    gateway = GatewayRoleConfig(
        model=model, gateway=GatewayConfig(host="0.0.0.0", port=50051, metrics_port=9090)
    )
    gateways, engines = plan_server(gateway, EngineConfig(model=model, parallel=parallel), "/r")
    assert server_addresses(gateways) == [
        ("gRPC", "0.0.0.0:50051"),
        ("metrics", "http://0.0.0.0:9090/metrics"),
        ("metrics", "http://0.0.0.0:9091/metrics"),
    ]
    line = ready_line(gateways, engines, 2.5, "dtype float32, quantization int8")
    assert line == (
        "switchboard is ready to serve 'tiny' (dtype float32, quantization int8): gRPC "
        "0.0.0.0:50051, metrics http://0.0.0.0:9090/metrics, metrics "
        "http://0.0.0.0:9091/metrics (2 engine cores, ready in 2.5 s)"
    )
    assert ready_line(gateways, engines, 2.5).startswith("switchboard is ready to serve 'tiny': ")


def test_the_ready_line_lists_the_http_api_of_each_gateway() -> None:
    model = ModelConfig(model="/models/tiny")
    parallel = ParallelConfig(api_servers=2)
    gateway = GatewayRoleConfig(
        model=model, gateway=GatewayConfig(host="127.0.0.1", port=50051, http_port=8000)
    )
    gateways, _ = plan_server(gateway, EngineConfig(model=model, parallel=parallel), "/r")
    assert server_addresses(gateways) == [
        ("gRPC", "127.0.0.1:50051"),
        ("HTTP", "http://127.0.0.1:8000/v1"),
        ("HTTP", "http://127.0.0.1:8001/v1"),
    ]


def test_without_metrics_only_grpc_is_listed_and_ipv6_is_bracketed() -> None:
    model = ModelConfig(model="/m")
    gateway = GatewayRoleConfig(model=model, gateway=GatewayConfig(host="::", port=7))
    gateways, _ = plan_server(gateway, EngineConfig(model=model), "/r")
    assert server_addresses(gateways) == [("gRPC", "[::]:7")]


def test_prefix_routing_across_engines_has_them_publish_kv_events_unless_told() -> None:
    model = ModelConfig(model="/m")
    engine = EngineConfig(model=model, parallel=ParallelConfig(data_parallel_size=2))

    def events(policy: str, engine: EngineConfig = engine) -> list:
        gateway = GatewayRoleConfig(model=model, gateway=GatewayConfig(routing_policy=policy))
        _, engines = plan_server(gateway, engine, "/run/sb")
        return [e.cache.kv_events_config for e in engines]

    published = events("prefix")
    assert all(c is not None and c.enabled for c in published)
    assert published[0].endpoint == "ipc:///run/sb/kv-events"
    assert published[0].replay_endpoint == "ipc:///run/sb/kv-replay"
    assert events("power-of-two") == [None, None]
    off = KVEventsConfig(enable_kv_cache_events=False)
    told = msgspec.structs.replace(engine, cache=CacheConfig(kv_events_config=off))
    assert events("prefix", told) == [off, off]
    one = msgspec.structs.replace(engine, parallel=ParallelConfig(data_parallel_size=1))
    assert events("prefix", one) == [None]
