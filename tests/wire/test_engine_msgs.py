"""Wire 1: every message round-trips through zmq_channel, and contract breaches are BadFrame."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from switchboard.wire import zmq_channel
from switchboard.wire.codec import ENGINE_CORE_OUTPUTS
from switchboard.wire.engine_msgs import (
    ENGINE_CORE_DEAD,
    EngineCoreEvent,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EventType,
    FinishReason,
    PoolingParams,
    PoolingType,
    RequestType,
    SamplingParams,
    SchedulerStats,
    TensorRef,
    TokenLogprobs,
    UtilityCall,
    UtilityOutput,
)


def full_request() -> EngineCoreRequest:
    """A request with every field away from its default."""
    return EngineCoreRequest(
        request_id="req-1",
        prompt_token_ids=[1, 2, 3, 70000],
        mm_features=[{"kind": "image", "hash": "abc"}],
        sampling_params=SamplingParams(
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            seed=7,
            max_tokens=32,
            min_tokens=2,
            stop_token_ids=[5, 6],
            eos_token_ids=[1],
            ignore_eos=True,
        ),
        pooling_params=PoolingParams(PoolingType.MEAN, normalize=False, dimensions=8),
        arrival_time=1712345678.25,
        lora_request={"name": "adapter"},
        cache_salt="tenant-a",
        data_parallel_rank=1,
        prompt_embeds=TensorRef(dtype="<f4", shape=[4, 8], frame_index=0),
        client_index=2,
        priority=-3,
        trace_context={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    )


def full_outputs() -> EngineCoreOutputs:
    output = EngineCoreOutput(
        request_id="req-1",
        new_token_ids=[11, 12],
        new_logprobs=[
            TokenLogprobs([7, 3], [-0.5, -1.0], [1, 2]),
            TokenLogprobs([9], [-1.25], [3]),
        ],
        finish_reason=FinishReason.STOP,
        stop_reason=12,
        events=[
            EngineCoreEvent(EventType.QUEUED, 100),
            EngineCoreEvent(EventType.SCHEDULED, 200),
            EngineCoreEvent(EventType.PREEMPTED, 300),
        ],
        num_cached_tokens=16,
        num_preemptions=1,
    )
    return EngineCoreOutputs(
        engine_index=3,
        timestamp_ns=123456789,
        outputs=[output, EngineCoreOutput("req-2", [7])],
        utility_output=UtilityOutput(call_id=9, result={"running": 1, "waiting": 0}),
        scheduler_stats=SchedulerStats(2, 1, 0.5, 10, 4, 1, 48),
        heartbeat=True,
    )


def full_ready() -> EngineReady:
    return EngineReady(
        engine_id="EngineCore_DP1-abc",
        data_parallel_rank=1,
        max_model_len=512,
        num_gpu_blocks=64,
        block_size=16,
        kv_capacity_tokens=1024,
        wall_clock_ns=1_700_000_000_000_000_000,
        monotonic_ns=42,
        vocab_size=1024,
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=256,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        engine_version="0.1.0",
        quantization="gguf Q4_1, Q8_0",
    )


REQUEST_BODIES = [
    (RequestType.ADD, full_request()),
    (RequestType.ADD, EngineCoreRequest("minimal", [1])),
    (RequestType.ABORT, ["req-1", "req-2"]),
    (RequestType.UTILITY, UtilityCall(0, 5, "sleep", [1])),
    (RequestType.UTILITY, UtilityCall(1, 6, "get_stats")),
    (RequestType.START_DP_WAVE, [4, 0]),
    (RequestType.WAKEUP, None),
]


@pytest.mark.parametrize(("request_type", "body"), REQUEST_BODIES)
def test_request_frames_round_trip(request_type: RequestType, body: object) -> None:
    frames = zmq_channel.request_frames(request_type, body)
    parsed_type, parsed_body, tensor_frames = zmq_channel.parse_request_frames(frames)
    assert parsed_type is request_type
    assert parsed_body == body
    assert tensor_frames == []


def test_tensor_frames_travel_after_the_body() -> None:
    embeds = np.arange(32, dtype="<f4").reshape(4, 8)
    request = full_request()
    frames = zmq_channel.request_frames(RequestType.ADD, request, [embeds.data])
    _, parsed, tensor_frames = zmq_channel.parse_request_frames(frames)
    ref = parsed.prompt_embeds
    restored = np.frombuffer(tensor_frames[ref.frame_index], dtype=ref.dtype).reshape(ref.shape)
    np.testing.assert_array_equal(restored, embeds)


def test_fields_are_positional_and_omitted_trailing_defaults_decode() -> None:
    raw = msgspec.msgpack.decode(zmq_channel.encode(EngineCoreRequest("r", [1, 2])))
    assert raw[:2] == ["r", [1, 2]]  # an array: fields go by position, not by name
    # A body whose trailing defaults are left out decodes with the defaults filled in.
    # (msgspec 0.23 ignores omit_defaults for array_like structs when encoding, so our own
    # encoder sends every field; a compact peer may still leave the defaults out.)
    compact = msgspec.msgpack.encode(["r", [1, 2]])
    assert zmq_channel.decode(compact, EngineCoreRequest) == EngineCoreRequest("r", [1, 2])
    compact_outputs = msgspec.msgpack.encode([1])
    assert zmq_channel.decode(compact_outputs, EngineCoreOutputs) == EngineCoreOutputs(1)
    _, body, _ = zmq_channel.parse_request_frames([RequestType.ADD.value, compact])
    assert body == EngineCoreRequest("r", [1, 2])


def test_finish_reason_is_an_integer_on_the_wire_and_a_word_in_text() -> None:
    raw = msgspec.msgpack.decode(
        zmq_channel.encode(EngineCoreOutput("r", finish_reason=FinishReason.LENGTH))
    )
    assert raw[3] == int(FinishReason.LENGTH)
    assert str(FinishReason.LENGTH) == "length"


def test_an_older_peer_decodes_a_message_with_an_appended_field() -> None:
    class NewerUtilityCall(UtilityCall):
        deadline_ms: int = 0

    data = zmq_channel.encode(NewerUtilityCall(0, 1, "get_stats", [], deadline_ms=500))
    assert zmq_channel.decode(data, UtilityCall) == UtilityCall(0, 1, "get_stats", [])


def test_output_frames_round_trip() -> None:
    outputs = full_outputs()
    parsed, tensor_frames = zmq_channel.parse_output_frames([zmq_channel.encode(outputs)])
    assert parsed == outputs
    assert tensor_frames == []


def test_output_frames_encoded_into_a_reused_buffer() -> None:
    codec = ENGINE_CORE_OUTPUTS  # the engine's output thread encodes with it
    buffer = bytearray()
    for outputs in (full_outputs(), EngineCoreOutputs(engine_index=1, heartbeat=True)):
        codec.encode_into(outputs, buffer)
        assert codec.decode(buffer) == outputs


def test_engine_core_dead_is_the_literal_single_frame() -> None:
    assert zmq_channel.parse_output_frames([ENGINE_CORE_DEAD]) == (None, [])


def test_ready_round_trips() -> None:
    ready = full_ready()
    assert zmq_channel.parse_ready(zmq_channel.encode(ready)) == ready


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x07", zmq_channel.encode(["x"])],  # unknown type byte
        [b"\x00\x00", zmq_channel.encode(EngineCoreRequest("r", [1]))],  # type is one byte
        [RequestType.EXECUTOR_FAILED.value, b""],  # internal sentinel, never from a gateway
        [RequestType.ADD.value, b"\xc1not msgpack"],  # malformed body
        [RequestType.ADD.value, zmq_channel.encode({"request_id": "r"})],  # wrong shape
        [RequestType.ABORT.value, zmq_channel.encode([1, 2])],  # ids must be strings
        [RequestType.UTILITY.value, zmq_channel.encode([0])],  # missing required fields
        [RequestType.ADD.value],  # no body
    ],
)
def test_contract_breaches_raise_bad_frame(frames: list[bytes]) -> None:
    with pytest.raises(zmq_channel.BadFrame):
        zmq_channel.parse_request_frames(frames)


@pytest.mark.parametrize(
    "frame", [b"\xc1", zmq_channel.encode(["not", "outputs"]), b"ENGINE_CORE_DEAD!"]
)
def test_malformed_outputs_raise_bad_frame(frame: bytes) -> None:
    with pytest.raises(zmq_channel.BadFrame):
        zmq_channel.parse_output_frames([frame])


def test_malformed_ready_raises_bad_frame() -> None:
    with pytest.raises(zmq_channel.BadFrame):
        zmq_channel.parse_ready(zmq_channel.encode(["engine", "not-a-rank"]))


def test_frames_cross_real_sockets() -> None:
    """ROUTER/PULL on the gateway side, DEALER/PUSH on the engine side, as on wire 1."""
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []
    try:
        router = zmq_channel.make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
        pull = zmq_channel.make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        identity = zmq_channel.engine_identity(1)
        dealer = zmq_channel.make_socket(
            ctx, zmq.DEALER, zmq_channel.bound_address(router), bind=False, identity=identity
        )
        push = zmq_channel.make_socket(ctx, zmq.PUSH, zmq_channel.bound_address(pull), bind=False)
        sockets += [router, pull, dealer, push]
        for sock in (router, pull, dealer):
            sock.setsockopt(zmq.RCVTIMEO, 10_000)

        dealer.send(zmq_channel.encode(full_ready()))  # the engine speaks first
        peer, ready_frame = router.recv_multipart()
        assert peer == identity
        assert zmq_channel.parse_ready(ready_frame) == full_ready()

        embeds = np.ones((4, 8), dtype="<f4")
        router.send_multipart(
            [peer, *zmq_channel.request_frames(RequestType.ADD, full_request(), [embeds.data])],
            copy=False,
        )
        frames = dealer.recv_multipart(copy=False)
        request_type, body, tensor_frames = zmq_channel.parse_request_frames(
            [f.buffer for f in frames]
        )
        assert (request_type, body) == (RequestType.ADD, full_request())
        assert bytes(tensor_frames[0]) == embeds.tobytes()

        push.send(zmq_channel.encode(full_outputs()))
        push.send(ENGINE_CORE_DEAD)
        assert zmq_channel.parse_output_frames(pull.recv_multipart())[0] == full_outputs()
        assert zmq_channel.parse_output_frames(pull.recv_multipart())[0] is None
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
