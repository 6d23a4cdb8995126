"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

from aiohttp import web

from switchboard.gateway.http.openai_errors import dumps


async def open_stream(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # a proxy in front must not hold the tokens back
            **headers,
        },
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, obj: object) -> None:
    await response.write(f"data: {dumps(obj)}\n\n".encode())


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
