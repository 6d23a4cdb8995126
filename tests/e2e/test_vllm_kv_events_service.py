"""``SubscribeKvEvents`` of vLLM's engine gRPC service on a real `switchboard serve` started
with ``--kv-events-config``: the streamed batches rebuild exactly the block hashes the engine
reports it caches (each 32-byte hash folded to the proto's int64 as vLLM's reference servicer
folds it), a start past the stream is refused, and a cancelled call closes its sockets."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vgrpc
from smg_grpc_proto.generated import common_pb2

from tests.e2e import client_calls
from tests.e2e.server import RunningServer, served, wait_until
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0
# A subscription outlives the generations it watches (the first may compile kernels); the
# test cancels it.
STREAM_TIMEOUT_S = 900.0
PROMPTS = ([0, *range(5, 45)], [0, *range(50, 90)])  # each more than two KV blocks
CLOSED = "SubscribeKvEvents: stream closed"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    workdir = tmp_path_factory.mktemp("kv-events")
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{workdir}/pub",
        "replay_endpoint": f"ipc://{workdir}/replay",
    }
    yield from served(
        tiny_llama_dir(),
        workdir,
        "--enable-admin",
        "--max-model-len",
        "256",
        "--kv-events-config",
        json.dumps(events),
    )


@pytest.fixture(scope="module")
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    with server.channel() as ch:
        yield ch


def to_int64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big", signed=True)


def engine_cache(channel: grpc.Channel) -> tuple[set[int], int]:
    """The engine's cached hashes (as the proto carries them) and its next batch number."""
    reply = client_calls.utility(channel, "get_cached_block_hashes")
    hashes = {to_int64(base64.b64decode(h)) for h in reply.get("block_hashes", [])}
    return hashes, int(reply["next_seq"])


def generate(stub: vgrpc.VllmEngineStub, prompt: list[int]) -> None:
    sampling = vpb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=prompt), sampling_params=sampling
    )
    assert list(stub.Generate(request, timeout=TIMEOUT_S))[-1].HasField("complete")


def mirror_until(stream: Iterator[common_pb2.KvEventBatch], last_seq: int) -> set[int]:
    """The hashes the stream's batches leave cached, read up to batch ``last_seq``."""
    hashes: set[int] = set()
    for batch in stream:
        assert batch.dp_rank == 0
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                hashes.update(block.block_hash for block in event.stored.blocks)
            elif kind == "removed":
                hashes.difference_update(event.removed.block_hashes)
            else:
                hashes.clear()
        if batch.sequence_number >= last_seq:
            return hashes
    raise AssertionError("the stream ended")


def test_stream_rebuilds_the_engines_cache(server: RunningServer, channel: grpc.Channel) -> None:
    stub = vgrpc.VllmEngineStub(channel)
    # From batch 1: everything after the engine's first batch (its cache empty: cleared).
    call = stub.SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=1), timeout=STREAM_TIMEOUT_S
    )
    call.initial_metadata()  # subscribed
    for prompt in PROMPTS:
        generate(stub, prompt)
    cached, next_seq = engine_cache(channel)
    assert len(cached) >= 2 * len(PROMPTS)
    assert mirror_until(call, next_seq - 1) == cached
    closed_before = server.log().count(CLOSED)
    call.cancel()
    wait_until(lambda: server.log().count(CLOSED) > closed_before, "the relay's sockets closed")

    # A live subscription (start 0) sees a new prompt's blocks stored.
    live = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=STREAM_TIMEOUT_S)
    live.initial_metadata()  # subscribed: what comes next is streamed
    generate(stub, [0, *range(100, 140)])
    cached_now, next_seq_now = engine_cache(channel)
    stored = mirror_until(live, next_seq_now - 1)
    live.cancel()
    assert stored and stored <= cached_now and not stored & cached


def test_a_start_past_the_stream_is_refused(channel: grpc.Channel) -> None:
    stub = vgrpc.VllmEngineStub(channel)
    request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9)
    with pytest.raises(grpc.RpcError) as caught:
        next(iter(stub.SubscribeKvEvents(request, timeout=TIMEOUT_S)))
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "start_sequence_number" in caught.value.details()
