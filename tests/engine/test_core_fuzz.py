"""Forged wire-1 frames at a real engine core (the tiny model, driven like test_core_frames):
random and boundary ADDs, ADD bodies with wrongly typed fields, byte-mutated ADD / ABORT /
UTILITY bodies, random UTILITY calls, unknown type bytes and frame counts. The engine process
must survive every one and afterwards answer a valid greedy request exactly as before. The
count of frames per outcome is printed (``-s`` shows it)."""

from __future__ import annotations

import collections
import math
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
    RepetitionDetectionParams,
    RequestType,
    SamplingParams,
    StructuredOutputParams,
    TensorRef,
    UtilityCall,
)
from tests.engine.test_core_frames import EngineUnderTest, greedy
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("SWITCHBOARD_FUZZ_SEED", "7"))
FRAMES = 500
QUIET_TIMEOUT_S = 60.0
RUN_S = 15.0  # the runnable forged requests get this long to finish before the final ABORT


def _pick(rng: random.Random, *choices: Any) -> Any:
    return rng.choice(choices)


def _token_ids(rng: random.Random, vocab: int) -> list[int]:
    return _pick(
        rng,
        [],
        [0],
        [vocab - 1, vocab, vocab + 7],
        [-1, 3],
        [rng.randrange(vocab) for _ in range(rng.randint(1, 20))],
        [rng.randrange(vocab) for _ in range(600)],  # longer than max_model_len
        [2**31 - 1],
    )


def _sampling(rng: random.Random, vocab: int) -> SamplingParams:
    floats = (0.0, -1.0, 0.7, 1.0, 2.0, math.nan, math.inf, -math.inf, 1e30)
    params = SamplingParams(
        temperature=rng.choice(floats),
        top_p=_pick(rng, 1.0, 0.0, -1.0, 0.5, 1.5, math.nan),
        top_k=_pick(rng, 0, -1, -2, 1, 5, vocab + 5, 2**31 - 1),
        seed=_pick(rng, None, 0, -1, 2**63 - 1, -(2**63)),
        max_tokens=_pick(rng, 1, 2, 4, 0, -1, 2**31 - 1),
        min_tokens=_pick(rng, 0, 0, 3, -1, 2**31 - 1),
        stop_token_ids=_pick(rng, [], [], [-1], [vocab + 1], [0, 1, 2]),
        eos_token_ids=_pick(rng, [], [2], [-5], [vocab * 2]),
        ignore_eos=rng.random() < 0.5,
    )
    knobs: dict[str, Any] = {
        "min_p": _pick(rng, 0.5, -1.0, 2.0, math.nan),
        "presence_penalty": rng.choice(floats),
        "frequency_penalty": rng.choice(floats),
        "repetition_penalty": _pick(rng, 1.0, 0.0, -1.0, math.inf, math.nan, 1.2),
        "logit_bias": _pick(rng, {}, {0: math.inf}, {-1: 1.0}, {vocab + 3: 2.0}, {5: math.nan}),
        "allowed_token_ids": _pick(rng, [], [-1], [vocab + 9], [1, 2, 3]),
        "bad_words_token_ids": _pick(rng, [[]], [[-1]], [[vocab + 2]], [[1, 2], [3]]),
        "logprobs": _pick(rng, 0, 3, -1, vocab + 1, 2**31 - 1),
        "prompt_logprobs": _pick(rng, 0, 2, -1, vocab + 1),
        "repetition_detection": RepetitionDetectionParams(
            _pick(rng, 0, 1, -1, 1000), _pick(rng, 0, 1, -3, 10**6), _pick(rng, 0, 2, -1, 10**9)
        ),
        "structured_output": StructuredOutputParams(
            _pick(rng, "json_schema", "json_object", "regex", "grammar", "choice", "nope", ""),
            _pick(rng, "", "{", "[]", '{"type": "object"}', "(a|b)*", "root ::= x", "\x00" * 9),
        ),
    }
    for name in rng.sample(sorted(knobs), rng.randint(0, 4)):
        setattr(params, name, knobs[name])
    if rng.random() < 0.5:  # one knob forged on a runnable request: reaches the scheduler
        name = rng.choice([*sorted(knobs), "temperature", "top_k", "seed", "max_tokens"])
        value = getattr(params, name) if name not in knobs else knobs[name]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 6))
        setattr(params, name, value if name != "max_tokens" or value < 64 else 6)
    return params


def _add(rng: random.Random, vocab: int, request_id: str) -> EngineCoreRequest:
    request = EngineCoreRequest(request_id, _token_ids(rng, vocab))
    if rng.random() < 0.4:
        request.prompt_token_ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
    if rng.random() < 0.85:
        request.sampling_params = _sampling(rng, vocab)
    if rng.random() < 0.15:
        request.pooling_params = PoolingParams(
            *_pick(rng, ("last", True, None), ("mean", False, -1), ("nope", True, 10**6))
        )
    extras: dict[str, Any] = {
        "arrival_time": _pick(rng, 0.0, -1.0, math.nan, math.inf),
        "lora_request": {"name": "x"},
        "cache_salt": _pick(rng, "", "salt", "\x00" * 100),
        "data_parallel_rank": _pick(rng, 0, 1, -1, 2**31),
        "prompt_embeds": TensorRef("<f4", [2, 3], 0),
        "mm_features": [{"x": 1}],
        "client_index": _pick(rng, 1, 99, -1),
        "priority": _pick(rng, -(2**31), 2**31 - 1, 7),
        "trace_context": {"traceparent": _pick(rng, "", "00-zz", "x" * 1000)},
    }
    for name in rng.sample(sorted(extras), rng.randint(0, 2)):
        setattr(request, name, extras[name])
    return request


def _garbage(rng: random.Random) -> Any:
    return _pick(rng, None, -1, 2**63, -(2**63), 1.5, math.nan, "", "x" * 50, b"\x00\xff",
                 [], [1, [2, [3]]], {"k": "v"}, {1: 2}, True)  # fmt: skip


def _retyped(rng: random.Random, body: Any) -> bytes:
    """The struct as msgpack arrays with one to three fields replaced by garbage."""
    data = msgspec.to_builtins(body)
    for _ in range(rng.randint(1, 3)):
        target = data
        if isinstance(target, list) and len(target) > 3 and isinstance(target[3], list):
            target = rng.choice([data, data[3]])  # the request or its SamplingParams
        if isinstance(target, list) and target:
            target[rng.randrange(len(target))] = _garbage(rng)
    if rng.random() < 0.2:
        data = data[: rng.randint(0, len(data))] + ([_garbage(rng)] * rng.randint(0, 3))
    return msgspec.msgpack.encode(data)


def _mutated(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 5)):
        if data and rng.random() < 0.5:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif data and rng.random() < 0.5:
            del data[rng.randrange(len(data)) :]
        else:
            data[rng.randrange(len(data) + 1) : 0] = rng.randbytes(rng.randint(1, 9))
    return bytes(data)


def _utility(rng: random.Random, call_id: int) -> UtilityCall:
    # "sleep" is left out: a valid one would park every request (test_core_frames covers it).
    method = _pick(rng, "get_stats", "is_sleeping", "wake_up", "reset_prefix_cache", "shutdown",
                   "__init__", "execute_model", "", "x" * 300, "get_stats\x00")  # fmt: skip
    args = _pick(rng, [], [1], [-1, 2], ["x"], [None], [[1] * 50], [{"a": 1}], [2**63 - 1])
    return UtilityCall(_pick(rng, 0, 0, 5, -1), call_id, method, args)


class Outcomes:
    """What came back, per request id and per utility call."""

    def __init__(self) -> None:
        self.finished: dict[str, FinishReason] = {}
        self.utility: dict[int, bool] = {}
        self.errors: collections.Counter[str] = collections.Counter()  # why, first words

    def drain(self, engine: EngineUnderTest, timeout_s: float = 0.0) -> bool:
        """Read what is there (waiting up to ``timeout_s`` for the first); False if nothing
        but heartbeats came."""
        got = waited = False
        while engine.pull.poll(int(timeout_s * 1000) if not waited else 0):
            waited = True
            outputs, _ = zmq_channel.parse_output_frames(engine.pull.recv_multipart())
            assert outputs is not None, f"ENGINE_CORE_DEAD:\n{engine.log()[-4000:]}"
            got = got or not outputs.heartbeat
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.finished[output.request_id] = output.finish_reason
                if output.finish_reason == FinishReason.ERROR:
                    self.errors[" ".join(str(output.stop_reason).split()[:4])] += 1
            if outputs.utility_output is not None:
                self.utility[outputs.utility_output.call_id] = (
                    outputs.utility_output.failure_message is None
                )
        return got

    def wait_quiet(self, engine: EngineUnderTest, timeout_s: float) -> bool:
        """Until 1.5 s pass with nothing but heartbeats; False at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 1.5:
            if time.monotonic() > deadline:
                return False
            if self.drain(engine, 0.2):
                quiet_since = time.monotonic()
            assert engine.process.poll() is None, engine.log()
        return True


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineUnderTest]:
    running = EngineUnderTest(tiny_llama_dir())
    yield running
    running.close()


def test_forged_frames_never_kill_the_engine(engine: EngineUnderTest) -> None:
    rng = random.Random(SEED)
    vocab = engine.ready.vocab_size
    before = [o.new_token_ids for o in engine.generate(greedy("reference-before", 8))]
    outcomes = Outcomes()
    kinds: collections.Counter[str] = collections.Counter()
    add_ids: list[str] = []
    sample_bodies = [
        zmq_channel.encode(_add(rng, vocab, "sample")),
        zmq_channel.encode(["a", "b"]),
        zmq_channel.encode(UtilityCall(0, 1, "get_stats", [])),
    ]
    started = time.monotonic()
    for i in range(FRAMES):
        roll = rng.random()
        if roll < 0.40:
            request_id = rng.choice(add_ids) if add_ids and rng.random() < 0.05 else f"fz-{i}"
            add_ids.append(request_id)
            kinds["ADD forged values"] += 1
            engine.send(RequestType.ADD, _add(rng, vocab, request_id))
        elif roll < 0.60:
            kinds["ADD wrong types"] += 1
            body = _add(rng, vocab, f"fz-{i}")
            engine.send_frames([RequestType.ADD.value, _retyped(rng, body)])
        elif roll < 0.75:
            kinds["mutated body"] += 1
            type_byte = rng.choice([RequestType.ADD, RequestType.ABORT, RequestType.UTILITY])
            raw = _mutated(rng, rng.choice(sample_bodies))
            engine.send_frames([type_byte.value, raw])
        elif roll < 0.83:
            kinds["ABORT"] += 1
            ids = rng.sample(add_ids, min(len(add_ids), rng.randint(0, 3))) if add_ids else []
            ids += _pick(rng, [], ["never-added"], [""], ["x" * 5000])
            if rng.random() < 0.3:
                engine.send_frames([RequestType.ABORT.value, _retyped(rng, ids or ["y"])])
            else:
                engine.send(RequestType.ABORT, ids)
        elif roll < 0.93:
            kinds["UTILITY"] += 1
            call = _utility(rng, 1000 + i)
            if rng.random() < 0.3:
                engine.send_frames([RequestType.UTILITY.value, _retyped(rng, call)])
            else:
                engine.send(RequestType.UTILITY, call)
        else:
            kinds["raw frames"] += 1
            count = rng.choice([1, 1, 2, 3, 5])
            frames = [rng.randbytes(rng.choice([0, 1, 2, 16])) for _ in range(count)]
            if rng.random() < 0.5 and count > 1:
                frames[0] = rng.choice([b"\x02", b"\x04", b"\x05", b"\x06", b"\xff", b"\x00\x00"])
            engine.send_frames(frames)
        outcomes.drain(engine)
        assert engine.process.poll() is None, f"frame {i} killed the engine:\n{engine.log()}"
    # Let the runnable ones run (a while), abort whatever still runs, then wait for quiet.
    outcomes.wait_quiet(engine, RUN_S)
    engine.send(RequestType.ABORT, sorted(set(add_ids)))
    assert outcomes.wait_quiet(engine, QUIET_TIMEOUT_S), "the engine never went quiet"
    assert engine.process.poll() is None, engine.log()
    log = engine.log()
    assert "thread failed" not in log and "Traceback" not in log, log[-6000:]
    after = [o.new_token_ids for o in engine.generate(greedy("reference-after", 8))]
    assert after == before
    finished = collections.Counter(reason.name for reason in outcomes.finished.values())
    utility = collections.Counter("ok" if ok else "failure" for ok in outcomes.utility.values())
    dropped = log.count("Dropped a ")
    print(
        f"\nengine frame fuzz: {FRAMES} frames in {time.monotonic() - started:.1f} s; "
        f"sent {dict(kinds)}; ADDs finished {dict(finished)} of {len(set(add_ids))} ids; "
        f"utility replies {dict(utility)}; 'Dropped' log lines {dropped}; "
        f"most common ERROR reasons {outcomes.errors.most_common(6)}"
    )
