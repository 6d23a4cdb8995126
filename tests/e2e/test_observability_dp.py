"""Metrics with two gateways and two engines (`-dp 2`, one gateway per engine by default): the
sums over gateways are right, engine-level series come once per engine, from gateway 0 only.

Gateway i serves /metrics on --metrics-port + i. Requests are pinned to an engine
(``data_parallel_rank``) so that each engine's share is known; the kernel spreads connections
over the two gateways, which must not matter.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.client_calls import greedy_request, metric_sum, scrape
from tests.e2e.server import RunningServer, free_port, start_server, wait_until
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
WAIT_S = 60.0
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
PINNED = [0, 1, 1, 0, 1]  # the engine of each request


def consecutive_free_ports() -> int:
    """A free port whose successor is free too (gateway 1 serves on port + 1)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, int]]:
    port = consecutive_free_ports()
    server = start_server(
        tiny_llama_dir(),
        tmp_path_factory.mktemp("dp2-metrics"),
        "-dp", "2",
        "--kv-cache-memory-bytes", str(8 << 20),
        "--metrics-port", str(port),
        "--no-enable-prefix-caching",
    )  # fmt: skip
    try:
        yield server, port
    finally:
        assert server.stop() == 0, server.log()


def total(samples: list[dict], name: str, **labels: str) -> float:
    """Summed over every gateway's scrape and every series whose labels include ``labels``."""
    return sum(metric_sum(scraped, name, **labels) for scraped in samples)


def generate(target: str, rank: int) -> pb.GenerateResponse:
    request = greedy_request(PROMPT, MAX_TOKENS, final_only=True, data_parallel_rank=rank)
    with grpc.insecure_channel(target) as channel:  # a new connection: either gateway
        (final,) = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    return final


def test_two_gateways_two_engines_count_everything_once(dp2) -> None:
    server, port = dp2
    ports = [port, port + 1]

    def idle() -> bool:
        return total([scrape(port)], "switchboard:num_requests_running") == 0

    wait_until(idle, "no request is running", WAIT_S, interval_s=0.1)
    before = [scrape(p) for p in ports]
    finals = [generate(server.target, rank) for rank in PINNED]
    assert all(
        f.metrics.engine_id.startswith(f"EngineCore_DP{r}-")
        for f, r in zip(finals, PINNED, strict=True)
    )
    expected_steps = {r: PINNED.count(r) * MAX_TOKENS for r in (0, 1)}

    def settled() -> bool:
        now = [scrape(port)]
        return (
            all(
                total(now, "switchboard:iteration_tokens_total_count", engine=str(r))
                - total(before[:1], "switchboard:iteration_tokens_total_count", engine=str(r))
                >= expected_steps[r]
                for r in (0, 1)
            )
            and idle()
        )

    wait_until(settled, "engine stats reached gateway 0", WAIT_S, interval_s=0.1)
    after = [scrape(p) for p in ports]

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    n = len(PINNED)
    assert delta("switchboard:request_success_total") == n
    assert delta("switchboard:generation_tokens_total") == n * MAX_TOKENS
    assert delta("switchboard:prompt_tokens_total") == n * len(PROMPT)
    assert delta("gen_ai_server_request_duration_seconds_count") == n
    for rank in (0, 1):
        engine = str(rank)
        count = PINNED.count(rank)
        assert delta("switchboard:request_success_total", engine=engine) == count
        # Engine-level, from the engine's own counters: once, although both gateways hear it.
        assert delta("switchboard:iteration_tokens_total_count", engine=engine) == count * (
            MAX_TOKENS
        )
        assert delta("switchboard:iteration_tokens_total_sum", engine=engine) == count * (
            len(PROMPT) + MAX_TOKENS - 1
        )
    assert total(after[1:], "switchboard:num_requests_running") == 0
    assert not any(name.startswith("switchboard:num_requests") for name, _ in after[1])
    engines = {dict(s)["engine"] for n_, s in after[0] if n_ == "switchboard:num_requests_running"}
    assert engines == {"0", "1"}
