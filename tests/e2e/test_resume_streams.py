"""Streams resumed across an engine's death beyond plain gRPC generation (docs/operations.md,
"Failure"): structured output at -dp 2 with an engine killed (the engine that takes a stream
replays its delivered tokens through the grammar), and OpenAI HTTP (SSE) streams resumed on
the restarted engine. Each is token-identical to an undisturbed greedy run and valid against
its constraint; the resumed request's metrics and span name both engines.

Streams are held by SIGSTOP of the workers before the kill, so none can end before it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from tests.e2e.client_calls import greedy_request, metric_sum, scrape
from tests.e2e.server import RunningServer, free_port, start_server, wait_until
from tests.e2e.test_resilience import PROMPTS, SMALL_KV, Stream, held_up_streams
from tests.otlp_receiver import OtlpGrpcReceiver

pytestmark = pytest.mark.slow

# Long outputs (300-450 tokens of the tiny model's 512 positions: a stream must still be going
# when the workers are stopped), each complete well within MAX_TOKENS: they end by their grammar.
MAX_TOKENS = 495
DIGITS = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 200, "maxItems": 200}
COLORS = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue"]},
    "minItems": 100,
    "maxItems": 100,
}
PAIRS = r"(ab|cd|ef){220}"
GROUPS = r"[0-9]{3}(-[0-9]{3}){110}"
# (kind, spec) of the six streams: two per engine at least, whichever way they are routed
CONSTRAINTS: list[tuple[str, Any]] = [
    ("json_schema", DIGITS),
    ("json_schema", COLORS),
    ("regex", PAIRS),
    ("json_schema", COLORS),
    ("regex", GROUPS),
    ("json_schema", DIGITS),
]


def constrained_request(index: int, request_id: str) -> pb.GenerateRequest:
    kind, spec = CONSTRAINTS[index]
    request = greedy_request(
        PROMPTS[index % len(PROMPTS)], MAX_TOKENS, return_token_ids=True, request_id=request_id
    )
    request.stopping.ignore_eos = False
    if kind == "json_schema":
        request.structured_output.json_schema = json.dumps(spec)
    else:
        request.structured_output.regex = spec
    return request


def assert_valid(index: int, text: str) -> None:
    kind, spec = CONSTRAINTS[index]
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), spec)
    else:
        assert re.fullmatch(spec, text), text


def resumed_request_ids(log: str) -> list[str]:
    return re.findall(r"request (\S+) resumed on engine", log)


def test_dp2_structured_streams_resume_through_their_grammar(
    tiny_model: str, tmp_path: Path
) -> None:
    """-dp 2, six constrained greedy streams held mid-output, kill -9 the engine that has most
    of them: those resume on the other and every stream completes with the tokens of an
    undisturbed run,
    valid against its schema or regex. The resumed ones count in requests_resumed_total by
    both engines, and their span lists both engines with an engine.resumed child."""
    receiver = OtlpGrpcReceiver()
    metrics_port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
        server = start_server(
            tiny_model,
            tmp_path,
            "-dp", "2", *SMALL_KV,
            "--metrics-port", str(metrics_port),
            "--otlp-traces-endpoint", receiver.endpoint,
        )  # fmt: skip
    workers: list[int] = []
    try:
        references = [
            Stream(server, [], 0, request=constrained_request(i, f"ref-{i}")) for i in range(6)
        ]
        for index, reference in enumerate(references):
            reference.join()
            assert reference.code == grpc.StatusCode.OK, reference.details
            assert_valid(index, reference.text)
        titled = server.titled_processes()
        workers += [titled[f"switchboard::Worker_DP{rank}_PP0_TP0"] for rank in (0, 1)]
        tries = itertools.count()  # a try's streams have ids of their own (spans find them)

        def start() -> list[Stream]:
            attempt = next(tries)
            ids = [f"so-{attempt}-{i}" for i in range(len(CONSTRAINTS))]
            return [Stream(server, [], 0, request=constrained_request(i, ids[i])) for i in range(6)]

        streams = held_up_streams(workers, start)

        # Each of the two gateways (they share the gRPC port) routes on its own counts: the
        # engine to kill is one that the held streams are on, as the engines report it. Gateway 0
        # hears an engine's counts with its own streams' outputs and with every heartbeat (1 s
        # apart while the workers are stopped): a count taken before a heartbeat may still hold a
        # stream that ended on its engine before the stop (its client saw the end late), so the
        # counts are read until two reads a heartbeat apart agree.
        def engine_counts() -> dict[int, int]:
            scraped = scrape(metrics_port)  # gateway 0 exports every engine's own numbers
            return {
                rank: int(
                    metric_sum(scraped, "switchboard:num_requests_running", engine=str(rank))
                    + metric_sum(scraped, "switchboard:num_requests_waiting", engine=str(rank))
                )
                for rank in (0, 1)
            }

        held = engine_counts()

        def counts_settled() -> bool:
            nonlocal held
            time.sleep(2.0)
            before, held = held, engine_counts()
            return held == before and sum(held.values()) > 0

        wait_until(counts_settled, "the engines report the held streams", 30)
        victim = max(held, key=lambda rank: held[rank])
        survivor = 1 - victim
        os.kill(titled[f"switchboard::EngineCore_DP{victim}"], signal.SIGKILL)
        for worker in workers:  # the victim's worker sees its engine gone and exits
            os.kill(worker, signal.SIGCONT)
        for index, stream in enumerate(streams):
            stream.join()
            assert stream.code == grpc.StatusCode.OK, (stream.details, server.log())
            assert stream.tokens == references[index].tokens, f"stream {index} differs"
            assert_valid(index, stream.text)
        resumed = resumed_request_ids(server.log())
        assert resumed and all(request_id.startswith("so-") for request_id in resumed), resumed
        assert len(resumed) == held[victim], (held, server.log())
        counted = sum(
            metric_sum(
                scrape(metrics_port + gateway),  # each gateway counts its own streams
                "switchboard:requests_resumed_total",
                engine=str(survivor),
                from_engine=str(victim),
            )
            for gateway in (0, 1)
        )
        assert counted == len(resumed)
        spans = receiver.wait_for_request(resumed[0], num_spans=9)
        (completion,) = [s for s in spans if s.name.startswith("text_completion")]
        engine_ids = completion.attributes["switchboard.request.engine_ids"]
        assert len(engine_ids) == 2 and engine_ids[0] != engine_ids[1], engine_ids
        assert completion.attributes["switchboard.request.num_resumes"] == 1
        assert completion.attributes["switchboard.engine.index"] == survivor  # where it ended
        (cut,) = [s for s in spans if s.name == "engine.resumed"]
        assert cut.attributes["switchboard.resume.from_engine.index"] == victim
        assert cut.attributes["switchboard.engine.index"] == survivor
        assert completion.start_ns <= cut.start_ns <= cut.end_ns <= completion.end_ns
        print(f"\ndp2 kill -9 DP{victim}: {len(resumed)} of 6 constrained streams resumed")
    finally:
        resume_processes(workers)  # a failed check must not leave a worker stopped for good
        assert server.stop() == 0, server.log()
        receiver.stop()


def resume_processes(pids: list[int]) -> None:
    """SIGCONT to each (gone already: nothing to do)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


class SseStream:
    """One greedy OpenAI completion streamed over HTTP (SSE) on a thread: its text chunks as
    they come, and how it ended (``code`` None while in flight)."""

    def __init__(self, server: RunningServer, prompt: list[int], **extra: Any) -> None:
        self.tokens: list[str] = []  # one chunk per token (stream interval 1)
        self.finish_reason: str | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._server, self._prompt, self._extra = server, prompt, extra
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        url = f"{self._server.http_url}/v1"
        try:
            with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=180) as client:
                (model,) = client.models.list().data
                for chunk in client.completions.create(
                    model=model.id,
                    prompt=self._prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body=self._extra,
                ):
                    for choice in chunk.choices:
                        if choice.text:
                            self.tokens.append(choice.text)
                        self.finish_reason = choice.finish_reason or self.finish_reason
            self.code = grpc.StatusCode.OK
        except openai.OpenAIError as error:
            self.code, self.details = grpc.StatusCode.UNKNOWN, str(error)

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    def join(self, timeout_s: float = 180.0) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"


def test_http_sse_streams_resume_on_the_restarted_engine(tiny_model: str, tmp_path: Path) -> None:
    """DP = 1, kill -9 the worker while two SSE completions (one free, one guided by a regex)
    are held mid-stream: the engine is restarted and both streams continue on it, ending as an
    undisturbed run does, on the same connection."""
    server = start_server(tiny_model, tmp_path)
    held: list[int] = []
    try:
        kinds: list[dict[str, Any]] = [{"ignore_eos": True}, {"guided_regex": PAIRS}]
        expected = []
        for extra in kinds:
            reference = SseStream(server, PROMPTS[0], **extra)
            reference.join()
            assert reference.code == grpc.StatusCode.OK, reference.details
            expected.append((reference.text, reference.finish_reason))
        assert expected[0][1] == "length" and expected[1][1] == "stop"
        worker = server.titled_processes()["switchboard::Worker_DP0_PP0_TP0"]
        held.append(worker)
        streams = held_up_streams(
            [worker], lambda: [SseStream(server, PROMPTS[0], **extra) for extra in kinds]
        )
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        for stream, (text, finish_reason) in zip(streams, expected, strict=True):
            stream.join()
            assert stream.code == grpc.StatusCode.OK, (stream.details, server.log())
            assert (stream.text, stream.finish_reason) == (text, finish_reason)
        assert re.fullmatch(PAIRS, streams[1].text)
        assert len(resumed_request_ids(server.log())) == 2
        done_s = time.monotonic() - killed
        print(f"\nSSE kill -9 worker: both streams resumed, done {done_s:.1f}s after the kill")
    finally:
        resume_processes(held)
        assert server.stop() == 0, server.log()
