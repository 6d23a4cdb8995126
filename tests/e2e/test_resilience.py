"""Failures a server survives (docs/operations.md, "Failure"): a stalled worker, a dead engine
under DP > 1 and under DP = 1 with restarts, streams resumed across an engine's death with the
tokens an undisturbed run gives, and a SIGTERM that drains the streams in flight.

Each test prints what it measured (``-s`` shows it); the times in the failure table come from
these lines.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import pytest
from grpc_health.v1 import health_pb2

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.client_calls import greedy_request, metric_sum, scrape
from tests.e2e.server import RunningServer, free_port, start_server, wait_until

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SMALL_KV = ("--kv-cache-memory-bytes", str(8 << 20))
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
STALLED_STREAM_TOKENS = 500  # of the tiny model's 512 positions
STALLED_STREAMS = 3  # run one after another (--max-num-seqs 1): ~1,500 decode steps in all


class Stream:
    """One greedy Generate stream on a thread: its token ids as they come, and how it ended."""

    def __init__(
        self,
        server: RunningServer,
        prompt: list[int],
        max_tokens: int,
        delay_s: float = 0.0,
        request: pb.GenerateRequest | None = None,
        **fields: object,
    ):
        self.tokens: list[int] = []
        self.text = ""
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._request = request or greedy_request(
            prompt, max_tokens, return_token_ids=True, **fields
        )
        self._server = server
        self._delay_s = delay_s  # a slow reader keeps the request in the engine for a while
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._server.channel() as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            try:
                for response in stub.Generate(self._request, timeout=180):
                    for output in response.outputs:
                        self.tokens += output.token_ids
                        self.text += output.text
                    time.sleep(self._delay_s)
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code, self.details = exc.code(), exc.details() or ""

    def join(self, timeout_s: float = 180.0) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"


def generate_tokens(
    server: RunningServer, prompt: list[int], max_tokens: int, **fields: object
) -> list[int]:
    stream = Stream(server, prompt, max_tokens, **fields)
    stream.join()
    assert stream.code == grpc.StatusCode.OK, stream.details
    return stream.tokens


def health(server: RunningServer) -> int | None:
    try:
        return server.health()
    except grpc.RpcError:
        return None  # not answering: not ready either


class HeldStream(Protocol):
    """A stream on a thread (gRPC ``Stream``, or another front's): what holding one reads."""

    tokens: list[Any]
    code: grpc.StatusCode | None

    def join(self, timeout_s: float = 180.0) -> None: ...


def wait_for_tokens(streams: Sequence[HeldStream], at_least: int) -> None:
    """Until each stream has ``at_least`` tokens, or has ended (a client that falls behind may
    get the rest of a stream in one message: the caller sees it ended)."""

    def going() -> bool:
        failed = [s for s in streams if s.code not in (None, grpc.StatusCode.OK)]
        assert not failed, [(s.code, getattr(s, "details", "")) for s in failed]
        return all(len(s.tokens) >= at_least or s.code is not None for s in streams)

    wait_until(going, "streams are going", 60)


def test_a_stalled_worker_is_seen_and_recovers(tiny_model: str, tmp_path: Path) -> None:
    """SIGSTOP a worker mid-stream: readiness NOT_SERVING within the step timeout (+ one
    heartbeat), new requests UNAVAILABLE at once, the log names the worker; SIGCONT: SERVING
    again and the stream completes."""
    metrics_port = free_port()
    server = start_server(
        tiny_model,
        tmp_path,
        "--step-timeout-s",
        "1",
        "--step-timeout-per-token-s",
        "0",
        "--metrics-port",
        str(metrics_port),
        "--max-num-seqs",
        "1",
    )
    try:
        worker = server.titled_processes()["switchboard::Worker_DP0_PP0_TP0"]
        # Fast readers and long streams that run one at a time: the worker is stopped a few
        # tokens into the first, with over a thousand steps still to go (a decode step of
        # tiny-llama takes 1-2 ms, so a single stream could end before the signal lands).
        streams = [
            Stream(server, PROMPTS[0], STALLED_STREAM_TOKENS) for _ in range(STALLED_STREAMS)
        ]
        wait_until(lambda: any(len(s.tokens) >= 5 for s in streams), "a stream is going", 60)
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_until(lambda: health(server) == NOT_SERVING, "NOT_SERVING", 15)
            seen_s = time.monotonic() - stopped
            with server.channel() as channel:
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as refused:
                    list(
                        pb_grpc.GenerationServiceStub(channel).Generate(
                            greedy_request(PROMPTS[1], 4), timeout=30
                        )
                    )
                refused_s = time.monotonic() - t0
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "has not answered" in (refused.value.details() or "")
            stalled = metric_sum(scrape(metrics_port), "switchboard:engine_worker_stalled")
            assert stalled == 1.0
        finally:
            os.kill(worker, signal.SIGCONT)
        continued = time.monotonic()
        wait_until(lambda: health(server) == SERVING, "SERVING again", 15)
        back_s = time.monotonic() - continued
        for stream in streams:
            stream.join()
            assert stream.code == grpc.StatusCode.OK, stream.details
            assert len(stream.tokens) == STALLED_STREAM_TOKENS
        assert len(generate_tokens(server, PROMPTS[1], 4)) == 4
        assert metric_sum(scrape(metrics_port), "switchboard:engine_worker_stalled") == 0.0
        log = server.log()
        assert f"rank 0 (pid {worker}) has not answered" in log
        assert "stall over" in log
        print(
            f"\nstall: NOT_SERVING {seen_s:.2f}s after SIGSTOP (step timeout 1 s), new request "
            f"refused in {refused_s * 1000:.0f} ms, SERVING {back_s:.2f}s after SIGCONT"
        )
    finally:
        assert server.stop() == 0, server.log()


def references(server: RunningServer, max_tokens: int) -> list[list[int]]:
    """What an undisturbed run gives for each of PROMPTS (greedy)."""
    return [generate_tokens(server, prompt, max_tokens) for prompt in PROMPTS]


def test_dp2_an_engine_dies_the_other_serves_and_it_comes_back(
    tiny_model: str, tmp_path: Path
) -> None:
    """-dp 2, kill -9 EngineCore_DP1 mid-load: readiness stays SERVING, every greedy stream
    completes with the tokens of an undisturbed run (those on DP1 resumed on DP0), new requests
    succeed meanwhile, and DP1 is restarted and READY again (the restart is a fresh engine
    start: ~1 s backoff + interpreter, workers, model load, on two shared cores)."""
    max_tokens = 400
    server = start_server(tiny_model, tmp_path, "-dp", "2", *SMALL_KV)
    try:
        expected = references(server, max_tokens)
        engine = server.titled_processes()["switchboard::EngineCore_DP1"]
        streams = [Stream(server, p, max_tokens) for p in PROMPTS for _ in range(2)]
        wait_for_tokens(streams, 3)
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        statuses = []
        t0 = time.monotonic()
        fresh = generate_tokens(server, PROMPTS[0], 8)  # served by DP0 meanwhile
        new_request_s = time.monotonic() - t0
        assert fresh == expected[0][:8]
        for stream in streams:
            stream.join()
            statuses.append(health(server))
        completed_s = time.monotonic() - killed
        for i, stream in enumerate(streams):
            assert stream.code == grpc.StatusCode.OK, (stream.details, server.log())
            assert stream.tokens == expected[i // 2], f"stream {i} differs"
        assert set(statuses) == {SERVING}, statuses
        # The launcher tells the gateways before it logs the restart: resumed streams of the
        # tiny model can all end before the line is written.
        wait_until(
            lambda: "EngineCore_DP1" in (log := server.log()) and "restarting it in" in log,
            "the launcher logs DP1's restart",
            30,
        )
        resumed = server.log().count("resumed on engine")
        wait_until(
            lambda: server.log().count("(DP rank 1) READY") >= 4,  # 2 gateways x 2 starts
            "DP1 is READY again",
            120,
        )
        back_s = time.monotonic() - killed
        assert generate_tokens(server, PROMPTS[1], 8, data_parallel_rank=1) == expected[1][:8]
        for _ in range(4):  # both engines take requests again
            assert generate_tokens(server, PROMPTS[2], 4) == expected[2][:4]
        print(
            f"\ndp2 kill -9 DP1: a new request served in {new_request_s:.2f}s, all "
            f"{len(streams)} streams identical ({resumed} resumed), done {completed_s:.1f}s "
            f"after the kill; DP1 READY again {back_s:.1f}s after the kill"
        )
    finally:
        assert server.stop() == 0, server.log()


def test_dp1_a_dead_worker_restarts_its_engine_and_the_stream_resumes(
    tiny_model: str, tmp_path: Path
) -> None:
    """DP = 1, kill -9 the worker mid-stream: the engine fails (ENGINE_CORE_DEAD), readiness is
    NOT_SERVING while the supervisor restarts it, and the stream resumes on the restarted
    engine with exactly the greedy tokens of an undisturbed run; a seeded sampled stream too.
    A request that arrives while no engine is ready waits for the restarted one."""
    max_tokens = 300
    metrics_port = free_port()
    server = start_server(tiny_model, tmp_path, "--metrics-port", str(metrics_port))
    try:
        expected = generate_tokens(server, PROMPTS[0], max_tokens)
        seeded = greedy_request(PROMPTS[1], max_tokens, return_token_ids=True)
        seeded.sampling.temperature = 1.0
        seeded.sampling.seed = 1234
        seeded_expected = generate_tokens(server, [], 0, request=seeded)
        arriving_expected = generate_tokens(server, PROMPTS[2], 20)
        worker = server.titled_processes()["switchboard::Worker_DP0_PP0_TP0"]
        # both held mid-stream (a stream of the tiny model could end before the kill on its own)
        greedy_stream, seeded_stream = held_up_streams(
            [worker],
            lambda: [Stream(server, PROMPTS[0], max_tokens), Stream(server, [], 0, request=seeded)],
        )
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: health(server) == NOT_SERVING, "NOT_SERVING while it restarts", 30)
        down_s = time.monotonic() - killed
        arriving = Stream(server, PROMPTS[2], 20)  # no engine is ready: it waits for one
        greedy_stream.join()
        seeded_stream.join()
        arriving.join()
        assert arriving.code == grpc.StatusCode.OK, (arriving.details, server.log())
        assert arriving.tokens == arriving_expected
        resumed_s = time.monotonic() - killed
        assert greedy_stream.code == grpc.StatusCode.OK, (greedy_stream.details, server.log())
        assert greedy_stream.tokens == expected
        assert seeded_stream.code == grpc.StatusCode.OK, seeded_stream.details
        assert seeded_stream.tokens == seeded_expected
        wait_until(lambda: health(server) == SERVING, "SERVING again", 60)
        assert server.log().count("resumed on engine") == 2
        assert metric_sum(scrape(metrics_port), "switchboard:requests_resumed_total") == 2
        print(
            f"\ndp1 kill -9 worker: NOT_SERVING {down_s:.2f}s after the kill, both streams "
            f"resumed and complete (identical) {resumed_s:.1f}s after it"
        )
    finally:
        assert server.stop() == 0, server.log()


def test_no_resume_fails_the_stream_saying_what_it_delivered(
    tiny_model: str, tmp_path: Path
) -> None:
    """--no-resume: the cut-off stream fails UNAVAILABLE at once, saying how many tokens it had
    delivered; the server still restarts the engine."""
    server = start_server(tiny_model, tmp_path, "--no-resume")
    try:
        engine = server.titled_processes()["switchboard::EngineCore_DP0"]
        worker = server.titled_processes()["switchboard::Worker_DP0_PP0_TP0"]
        # held mid-stream: a stream of the tiny model could end before the kill on its own
        stream = held_up_stream(server, worker, 400)
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        os.kill(worker, signal.SIGCONT)  # it sees its engine gone and exits
        stream.join()
        failed_s = time.monotonic() - killed
        assert stream.code == grpc.StatusCode.UNAVAILABLE
        assert f"({len(stream.tokens)} tokens were delivered)" in stream.details, stream.details
        wait_until(lambda: health(server) == SERVING, "SERVING after the restart", 120)
        assert len(generate_tokens(server, PROMPTS[1], 4)) == 4
        print(f"\n--no-resume kill -9 engine: UNAVAILABLE {failed_s:.2f}s after the kill")
    finally:
        assert server.stop() == 0, server.log()


def http_ready(server: RunningServer) -> int | None:
    try:
        with urllib.request.urlopen(f"{server.http_url}/ready", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None  # refused: not ready either


def held_up_stream(server: RunningServer, worker: int, max_tokens: int) -> Stream:
    """A stream that is going (3 tokens seen) and then held up by SIGSTOP of ``worker``."""
    (stream,) = held_up_streams([worker], lambda: [Stream(server, PROMPTS[0], max_tokens)])
    return stream


def held_up_streams(workers: list[int], start: Callable[[], list[HeldStream]]) -> list[Any]:
    """Streams that are going (3 tokens seen each) and then held up by SIGSTOP of ``workers``
    (the caller kills or continues them). On a loaded machine a stream may finish between the
    two: then SIGCONT and try again with new streams (on a machine busy with other work the
    clients may see their streams late: ten tries, each costing only its streams)."""
    for _ in range(10):
        streams = start()
        wait_for_tokens(streams, 3)
        for worker in workers:
            os.kill(worker, signal.SIGSTOP)
        time.sleep(0.5)  # tokens made before the stop still reach the client meanwhile
        if all(stream.code is None for stream in streams):
            return streams
        for worker in workers:
            os.kill(worker, signal.SIGCONT)
        for stream in streams:
            stream.join()
    raise AssertionError("every try's streams finished before their worker could be stopped")


def test_sigterm_drains_the_streams_in_flight(tiny_model: str, tmp_path: Path) -> None:
    """SIGTERM: not ready at once (gRPC health refuses or says NOT_SERVING, HTTP /ready 503),
    the stream in flight (held up by a stopped worker for 2 s, so it is surely in flight)
    completes whole, and the server then exits 0 well within --shutdown-grace."""
    server = start_server(tiny_model, tmp_path, "--shutdown-grace", "20")
    worker = server.titled_processes()["switchboard::Worker_DP0_PP0_TP0"]
    stream = held_up_stream(server, worker, 400)
    try:
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: health(server) != SERVING, "not ready after SIGTERM", 5)
        not_ready_s = time.monotonic() - signalled
        assert http_ready(server) != 200
        time.sleep(2.0)
        assert stream.code is None, "the stream is still in flight"
    finally:
        os.kill(worker, signal.SIGCONT)
    stream.join()
    assert stream.code == grpc.StatusCode.OK, (stream.details, server.log())
    assert len(stream.tokens) == 400
    code = server.process.wait(40)
    exited_s = time.monotonic() - signalled
    assert code == 0, server.log()
    assert exited_s < 20, exited_s
    assert server.stop() == 0
    assert server.leftovers == []
    print(
        f"\nSIGTERM: not ready {not_ready_s * 1000:.0f} ms after it, the stream in flight "
        f"completed, exit 0 {exited_s:.1f}s after it (grace 20 s, 2 s of it held up)"
    )


def test_a_frozen_engine_is_declared_dead_and_restarted(tiny_model: str, tmp_path: Path) -> None:
    """SIGSTOP the engine core past the gateway's heartbeat timeout (10 s): the gateway declares
    it dead (NOT_SERVING; the stream waits to resume), the woken engine sees it was frozen and
    exits, the supervisor restarts it and the stream resumes with the undisturbed tokens."""
    max_tokens = 300
    server = start_server(tiny_model, tmp_path)
    try:
        expected = generate_tokens(server, PROMPTS[0], max_tokens)
        engine = server.titled_processes()["switchboard::EngineCore_DP0"]
        stream = Stream(server, PROMPTS[0], max_tokens)
        wait_for_tokens([stream], 3)
        os.kill(engine, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_until(lambda: health(server) == NOT_SERVING, "declared dead", 30)
            dead_s = time.monotonic() - stopped
        finally:
            os.kill(engine, signal.SIGCONT)
        stream.join()
        done_s = time.monotonic() - stopped
        assert stream.code == grpc.StatusCode.OK, (stream.details, server.log())
        assert stream.tokens == expected
        # The woken engine's I/O thread sees the gap within a heartbeat interval; the stream may
        # have ended before that (all its tokens out before the freeze took hold).
        wait_until(lambda: "frozen for" in server.log(), "the engine saw it was frozen", 30)
        wait_until(lambda: health(server) == SERVING, "SERVING again", 60)
        print(
            f"\nSIGSTOP engine: declared dead {dead_s:.1f}s after it (heartbeat timeout 10 s), "
            f"the stream resumed and complete {done_s:.1f}s after it"
        )
    finally:
        assert server.stop() == 0, server.log()
