"""A small asyncio HTTP/1.1 client for the OpenAI servers of vLLM and llama.cpp, as
bench/vs_vllm.py uses it: a keep-alive connection, a readiness probe (the status of a GET) and
the streaming ``/v1/completions`` call that counts the tokens each server-sent event carries.

Not run by itself; bench/serving_clients.py and bench/server_procs.py import it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any


class HttpError(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


class HttpConnection:
    """One keep-alive HTTP/1.1 connection to 127.0.0.1; one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def request(self, method: str, path: str, body: bytes = b"") -> AsyncIterator[bytes]:
        """Yield the response body in pieces as they arrive; raise on a status other than 200.
        A reused connection the server has closed meanwhile is reopened once."""
        reused = self._writer is not None
        try:
            status, headers = await self._send(method, path, body)
        except (ConnectionError, asyncio.IncompleteReadError):
            await self.close()
            if not reused:
                raise
            status, headers = await self._send(method, path, body)
        if status != 200:
            text = b"".join([piece async for piece in self._body(headers)])
            await self.close()
            raise HttpError(status, text[:300].decode(errors="replace"))
        done = False
        try:
            async for piece in self._body(headers):
                yield piece
            done = True
        finally:
            if not done or headers.get("connection", "").lower() == "close":
                await self.close()

    async def _send(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, str]]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Accept: text/event-stream, application/json\r\n\r\n"
        )
        self._writer.write(head.encode() + body)
        await self._writer.drain()
        status_line = await self._reader.readuntil(b"\r\n")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await self._reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        reader = self._reader
        assert reader is not None
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                        pass
                    return
                piece = await reader.readexactly(size)
                await reader.readexactly(2)
                yield piece
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                piece = await reader.read(min(left, 65536))
                if not piece:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(piece)
                yield piece
        else:
            headers["connection"] = "close"  # the body ends when the server closes
            while piece := await reader.read(65536):
                yield piece


async def http_status(host: str, port: int, path: str, timeout_s: float = 2.0) -> int | None:
    """The status of GET ``path`` (None when nothing answers in time)."""
    conn = HttpConnection(host, port)
    try:
        async with asyncio.timeout(timeout_s):
            async for _ in conn.request("GET", path):
                pass
            return 200
    except HttpError as e:
        return e.status
    except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError):
        return None
    finally:
        await conn.close()


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What one server-sent event said: the tokens it carries, and the request's output token
    count where the event reports usage (the last one, when the server sends it)."""

    tokens: int
    total: int | None = None


async def stream_completion(
    conn: HttpConnection, model: str, prompt: list[int], max_tokens: int
) -> AsyncIterator[Chunk]:
    """Stream one greedy completion of the token-id ``prompt``; yield each server-sent event
    that carries tokens or usage, as it arrives. A choice carries its ``token_ids`` (vLLM), else
    one token where it has text and does not finish (llama.cpp: a chunk a token, then one
    that only finishes)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    buffered = b""
    async for piece in conn.request("POST", "/v1/completions", json.dumps(body).encode()):
        buffered += piece
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"server error: {str(event['error'])[:300]}")
            tokens = sum(_choice_tokens(choice) for choice in event.get("choices") or [])
            total = (event.get("usage") or {}).get("completion_tokens")
            if tokens or total is not None:
                yield Chunk(tokens, total)


def _choice_tokens(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    if ids is not None:
        return len(ids)
    text = choice.get("text")
    return int(bool(text) or (text is not None and choice.get("finish_reason") is None))
