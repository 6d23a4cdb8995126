"""Wire-1 codec benchmark: encode + decode of the two hot messages, our codec vs pickle.

    python bench/codec.py [--repeat 7] [--number 2000]

Messages: an ``EngineCoreRequest`` with a 512-token prompt (one per request, gateway ->
engine) and an ``EngineCoreOutputs`` with 64 outputs (one per engine step, engine -> gateway).
"ours" is ``wire.codec.Codec`` (msgspec msgpack, typed decoder); "ours, reused buffer" encodes
into one bytearray the way the engine's output thread does. pickle is only the baseline here:
it never crosses a wire, because unpickling runs code.
"""

from __future__ import annotations

import argparse
import pickle
import random
import timeit
from collections.abc import Callable
from typing import Any

from switchboard.wire.codec import Codec
from switchboard.wire.engine_msgs import (
    EngineCoreEvent,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EventType,
    SamplingParams,
    SchedulerStats,
)


def make_request(prompt_tokens: int = 512) -> EngineCoreRequest:
    rng = random.Random(0)
    return EngineCoreRequest(
        request_id="cmpl-4f1c2b9e8d7a4c3b",
        prompt_token_ids=[rng.randrange(128_000) for _ in range(prompt_tokens)],
        sampling_params=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, seed=1),
        arrival_time=1_712_345_678.25,
        trace_context={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    )


def make_outputs(num_outputs: int = 64) -> EngineCoreOutputs:
    rng = random.Random(0)
    outputs = [
        EngineCoreOutput(
            request_id=f"cmpl-{i:016x}",
            new_token_ids=[rng.randrange(128_000)],
            events=[EngineCoreEvent(EventType.SCHEDULED, 1_000_000 + i)] if i % 8 == 0 else None,
        )
        for i in range(num_outputs)
    ]
    return EngineCoreOutputs(
        engine_index=0,
        timestamp_ns=123_456_789_000,
        outputs=outputs,
        scheduler_stats=SchedulerStats(64, 3, 0.42, 100, 60, 0, 64),
    )


def best_us(fn: Callable[[], Any], repeat: int, number: int) -> float:
    """Best of ``repeat`` runs, per call in microseconds (the least disturbed run)."""
    return min(timeit.repeat(fn, repeat=repeat, number=number)) / number * 1e6


def measure(msg: Any, repeat: int, number: int) -> list[tuple[str, int, float]]:
    codec = Codec(type(msg))
    data = codec.encode(msg)
    buffer = bytearray()
    pickled = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    assert codec.decode(data) == msg and pickle.loads(pickled) == msg

    def ours() -> None:
        codec.decode(codec.encode(msg))

    def ours_reused_buffer() -> None:
        codec.encode_into(msg, buffer)
        codec.decode(buffer)

    def with_pickle() -> None:
        pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    return [
        ("ours (msgspec msgpack)", len(data), best_us(ours, repeat, number)),
        ("ours, reused buffer", len(data), best_us(ours_reused_buffer, repeat, number)),
        ("pickle (baseline)", len(pickled), best_us(with_pickle, repeat, number)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    cases = [
        ("EngineCoreRequest, 512-token prompt", make_request()),
        ("EngineCoreOutputs, 64 outputs", make_outputs()),
    ]
    header = f"{'message':<36} {'codec':<24} {'bytes':>7} {'enc+dec us':>11} {'vs pickle':>10}"
    print(header)
    print("-" * len(header))
    for name, msg in cases:
        rows = measure(msg, args.repeat, args.number)
        pickle_us = rows[-1][2]
        for codec_name, size, us in rows:
            ratio = f"{pickle_us / us:.2f}x"
            print(f"{name:<36} {codec_name:<24} {size:>7} {us:>11.2f} {ratio:>10}")
    print("\n'vs pickle' = pickle time / this codec's time (higher is faster than pickle).")


if __name__ == "__main__":
    main()
