"""Prefix-aware routing on a real `serve -dp 2` (one gateway, so one routing table): a
conversation's turns follow the engine that holds its prefix, and once that engine's cache is
reset the router no longer sends them there by what it held before. Run with the engines' KV
events followed (what `serve` sets up for prefix routing) and without them (the prompts routed
alone). Which engine served a turn shows in its cached prompt tokens: the engines are set up to
hold different lengths of the conversation (requests pinned to a DP rank)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest

from switchboard.api.v1 import admin_service_pb2 as admin_pb
from switchboard.api.v1 import admin_service_pb2_grpc as admin_grpc
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.client_calls import UTILITY_TIMEOUT_S, greedy_request
from tests.e2e.server import RunningServer, start_server, wait_until
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

BLOCK = 16  # the server's default block size
ANSWER_TOKENS = 4
RPC_TIMEOUT_S = 120.0
FOLLOWED = "routing follows its KV events"
EVENTS = {"events": (), "no-events": ("--kv-events-config", '{"enable_kv_cache_events": false}')}


@pytest.fixture(scope="module", params=sorted(EVENTS))
def server(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[RunningServer]:
    running = start_server(
        tiny_llama_dir(),
        tmp_path_factory.mktemp(f"prefix-routing-{request.param}"),
        "-dp", "2",
        "--api-servers", "1",
        "--enable-admin",
        "--routing-policy", "prefix",
        # A gain of one block is followed even when a load report still counts the turn before.
        "--prefix-routing-min-match", str(BLOCK),
        *EVENTS[request.param],
    )  # fmt: skip
    try:
        yield running
    finally:
        assert running.stop() == 0, running.log()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def generate(stub: pb_grpc.GenerationServiceStub, prompt: list[int], rank: int | None = None):
    """(cached prompt tokens, the answer's token ids)."""
    request = greedy_request(
        prompt, ANSWER_TOKENS, final_only=True, return_token_ids=True, data_parallel_rank=rank
    )
    (final,) = list(stub.Generate(request, timeout=RPC_TIMEOUT_S))
    return final.usage.cached_prompt_tokens, list(final.outputs[0].token_ids)


def engine_ids(channel: grpc.Channel) -> dict[int, str]:
    """DP rank -> engine id (``EngineCore_DP<rank>-...``)."""
    request = admin_pb.UtilityRequest(method="is_sleeping")
    results = admin_grpc.AdminServiceStub(channel).Utility(request, timeout=UTILITY_TIMEOUT_S)
    return {
        int(r.engine_id.split("-")[0].removeprefix("EngineCore_DP")): r.engine_id
        for r in results.results
    }


def reset_prefix_cache(channel: grpc.Channel, engine_id: str) -> bool:
    request = admin_pb.UtilityRequest(method="reset_prefix_cache", engine_ids=[engine_id])
    (result,) = (
        admin_grpc.AdminServiceStub(channel).Utility(request, timeout=UTILITY_TIMEOUT_S).results
    )
    assert result.status.code == 0, result.status.message
    return result.result.bool_value


def test_turns_follow_their_prefix_and_not_a_reset_engine(server: RunningServer) -> None:
    if "--kv-events-config" not in server.process.args:  # serve has the engines publish
        wait_until(lambda: server.log().count(FOLLOWED) == 2, "both engines' events followed")
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        ranks = engine_ids(channel)
        assert sorted(ranks) == [0, 1]
        history = tokens(1, 10 * BLOCK)
        # Rank 0 holds the whole first turn, rank 1 only its first five blocks.
        _, answer = generate(stub, history, rank=0)
        generate(stub, history[: 5 * BLOCK] + tokens(2, 3 * BLOCK), rank=1)
        for turn in range(2):  # each turn follows rank 0, which holds more of it
            previous = len(history)
            history += answer + tokens(10 + turn, 2 * BLOCK)
            cached, answer = generate(stub, history)
            assert cached >= previous // BLOCK * BLOCK, (turn, cached)
        wait_until(lambda: reset_prefix_cache(channel, ranks[0]), "rank 0's cache reset", 120.0)
        # Rank 0 holds nothing now; rank 1 still holds five blocks: the next turn goes there.
        history += answer + tokens(20, 2 * BLOCK)
        cached, _ = generate(stub, history)
        assert cached == 5 * BLOCK
