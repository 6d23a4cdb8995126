"""The client side of bench/vs_vllm.py: the prompts, a closed loop of clients that time every
streamed request (time to first token, the gaps between messages that carry tokens, end to
end), one client for switchboard's gRPC GenerationService and one for the OpenAI HTTP servers
(vLLM's, llama.cpp's), and the summary of a level's results (throughput and percentiles).

Not run by itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import vllm_http  # bench/vllm_http.py, beside this file

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc

HOST = "127.0.0.1"
BOS, FIRST_REGULAR_ID = 1, 4  # ids 0..3: <unk> <s> </s> <pad>


def make_prompts(n: int, length: int, vocab: int, key: str) -> list[list[int]]:
    rng = random.Random(key)
    return [
        [BOS] + [rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(length - 1)]
        for _ in range(n)
    ]


def pct(xs: list[float], p: float) -> float | None:
    """The p-th percentile (linear interpolation); None when there is nothing."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclasses.dataclass
class RequestResult:
    ttft_s: float | None = None
    itls_s: list[float] = dataclasses.field(default_factory=list)
    e2e_s: float = 0.0
    tokens: int = 0
    error: str | None = None


class StreamTimer:
    def __init__(self) -> None:
        self.result = RequestResult()
        self.t0 = self.last = time.perf_counter()

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.result.ttft_s is None:
            self.result.ttft_s = now - self.t0
        else:
            self.result.itls_s.append(now - self.last)
        self.last = now
        self.result.tokens += n

    def done(self) -> RequestResult:
        self.result.e2e_s = time.perf_counter() - self.t0
        return self.result


Send = Callable[[list[int]], Awaitable[RequestResult]]


class SbClient:
    """switchboard's GenerationService over one gRPC channel (HTTP/2: every stream shares it)."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"{HOST}:{port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.max_tokens = max_tokens

    async def sender(self) -> tuple[Send, Callable[[], Awaitable[None]]]:
        async def nothing() -> None:
            pass

        return self.send, nothing

    async def send(self, prompt: list[int]) -> RequestResult:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=self.max_tokens, ignore_eos=True),
            output=pb.OutputOptions(return_token_ids=True),
        )
        timer = StreamTimer()
        async for response in self.stub.Generate(request):
            if n := sum(len(out.token_ids) for out in response.outputs):
                timer.tokens(n)
        return timer.done()

    async def close(self) -> None:
        await self.channel.close()


class OpenAIClient:
    """An OpenAI ``/v1/completions`` server (vLLM's, llama.cpp's): one keep-alive HTTP/1.1
    connection per closed-loop client, or a new one per request (``reconnect``: llama.cpp's
    server closes a kept-alive connection between requests). Output tokens: the usage the last
    event reports where the server sends it, else those counted as they streamed."""

    def __init__(self, port: int, model: str, max_tokens: int, reconnect: bool = False) -> None:
        self.port, self.model, self.max_tokens = port, model, max_tokens
        self.reconnect = reconnect

    async def sender(self) -> tuple[Send, Callable[[], Awaitable[None]]]:
        conn = vllm_http.HttpConnection(HOST, self.port)

        async def send(prompt: list[int]) -> RequestResult:
            timer = StreamTimer()
            try:
                async for chunk in vllm_http.stream_completion(
                    conn, self.model, prompt, self.max_tokens
                ):
                    if chunk.tokens:
                        timer.tokens(chunk.tokens)
                    if chunk.total is not None:
                        timer.result.tokens = chunk.total
            except BaseException:
                await conn.close()
                raise
            if self.reconnect:
                await conn.close()
            return timer.done()

        return send, conn.close

    async def close(self) -> None:
        pass


Client = SbClient | OpenAIClient


async def closed_loop(
    client: Client, prompts: list[list[int]], concurrency: int, timeout_s: float
) -> tuple[list[RequestResult], float]:
    todo = iter(prompts)
    results: list[RequestResult] = []

    async def loop() -> None:
        send, close = await client.sender()
        try:
            for prompt in todo:  # one iterator for all: each client takes the next prompt
                t0 = time.perf_counter()
                try:
                    results.append(await asyncio.wait_for(send(prompt), timeout_s))
                except Exception as e:  # noqa: BLE001 - counted, the level goes on
                    error = f"{type(e).__name__}: {e}"[:300]
                    results.append(RequestResult(e2e_s=time.perf_counter() - t0, error=error))
        finally:
            await close()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def summarize(results: list[RequestResult], wall: float, output_len: int) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [x * 1e3 for r in ok for x in r.itls_s]
    e2e = [r.e2e_s * 1e3 for r in ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "short_outputs": sum(r.tokens != output_len for r in ok),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        "e2e_ms_p50": pct(e2e, 50),
        "e2e_ms_p99": pct(e2e, 99),
        "messages_per_request": (sum(len(r.itls_s) + 1 for r in ok) / len(ok)) if ok else None,
    }
