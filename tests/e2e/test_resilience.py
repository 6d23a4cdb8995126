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
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.client_calls import greedy_request
from tests.e2e.server import RunningServer, start_server, wait_until

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SMALL_KV = ("--kv-cache-memory-bytes", str(8 << 20))
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


class Stream:
    """One greedy Generate stream on a thread: its token ids as they come, and how it ended."""

    def __init__(
        self, server: RunningServer, prompt: list[int], max_tokens: int, delay_s: float = 0.0
    ):
        self.tokens: list[int] = []
        self.text = ""
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._request = greedy_request(prompt, max_tokens, return_token_ids=True)
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


def generate_tokens(server: RunningServer, prompt: list[int], max_tokens: int) -> list[int]:
    stream = Stream(server, prompt, max_tokens)
    stream.join()
    assert stream.code == grpc.StatusCode.OK, stream.details
    return stream.tokens


def health(server: RunningServer) -> int | None:
    try:
        return server.health()
    except grpc.RpcError:
        return None  # not answering: not ready either


def wait_for_tokens(streams: list[Stream], at_least: int) -> None:
    wait_until(lambda: all(len(s.tokens) >= at_least for s in streams), "streams are going", 60)


def test_a_stalled_worker_is_seen_and_recovers(tiny_model: str, tmp_path: Path) -> None:
    """SIGSTOP a worker mid-stream: readiness NOT_SERVING within the step timeout (+ one
    heartbeat), new requests UNAVAILABLE at once, the log names the worker; SIGCONT: SERVING
    again and the stream completes."""
    server = start_server(
        tiny_model, tmp_path, "--step-timeout-s", "1", "--step-timeout-per-token-s", "0"
    )
    try:
        worker = server.titled_processes()["switchboard::Worker_DP0_PP0_TP0"]
        stream = Stream(server, PROMPTS[0], 300, delay_s=0.01)
        wait_for_tokens([stream], 5)
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
        finally:
            os.kill(worker, signal.SIGCONT)
        continued = time.monotonic()
        wait_until(lambda: health(server) == SERVING, "SERVING again", 15)
        back_s = time.monotonic() - continued
        stream.join()
        assert stream.code == grpc.StatusCode.OK, stream.details
        assert len(stream.tokens) == 300
        assert len(generate_tokens(server, PROMPTS[1], 4)) == 4
        log = server.log()
        assert f"rank 0 (pid {worker}) has not answered" in log
        assert "stall over" in log
        print(
            f"\nstall: NOT_SERVING {seen_s:.2f}s after SIGSTOP (step timeout 1 s), new request "
            f"refused in {refused_s * 1000:.0f} ms, SERVING {back_s:.2f}s after SIGCONT"
        )
    finally:
        assert server.stop() == 0, server.log()
