"""The chart's container commands are ones `switchboard` accepts: each parses with our own
CLI's parser (switchboard.cli.make_parser), under default and big values."""

from __future__ import annotations

import pytest

from switchboard.cli import make_parser
from switchboard.cli.role_commands import coordinator_tcp_address
from tests.chart.chart_render import BIG_VALUES, argv, container, manifests

WORKLOADS = [("Deployment", "gateway"), ("StatefulSet", "engine")]


@pytest.mark.parametrize("values", [{}, BIG_VALUES], ids=["defaults", "dp2-tp2-pp2-gpu"])
def test_rendered_commands_parse(values: dict) -> None:
    docs = manifests(values)
    workloads = WORKLOADS + ([("Deployment", "coordinator")] if values else [])
    parser = make_parser()
    parsed = {}
    for kind, component in workloads:
        args = parser.parse_args(argv(container(docs, kind, component)))
        assert args.command == component
        parsed[component] = args
    gateway, engine = parsed["gateway"], parsed["engine"]
    assert gateway.model == engine.model == "/models/model"
    assert (
        gateway.data_parallel_size == engine.data_parallel_size == values.get("dataParallelSize", 1)
    )
    assert engine.gateway_address.endswith(f":{gateway.handshake_port}")
    if "coordinator" in parsed:
        coordinator = parsed["coordinator"]
        assert coordinator.data_parallel_size == 2
        # each side's address names the coordinator port it uses
        assert coordinator_tcp_address(engine.coordinator_address, 0).endswith(
            f":{coordinator.load_port}"
        )
        assert coordinator_tcp_address(gateway.coordinator_address, 0).endswith(
            f":{coordinator.report_port}"
        )
        assert engine.tensor_parallel_size == engine.pipeline_parallel_size == 2
        assert engine.device == "cuda"
        assert gateway.metrics_port == 9100 and gateway.trace_content and gateway.enable_admin
    else:
        assert gateway.coordinator_address == engine.coordinator_address == ""
        assert engine.device == "cpu"
