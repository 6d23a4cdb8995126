"""The OpenAI routes: body -> ``pb.GenerateRequest`` -> the shared call path -> JSON or SSE.

A call runs inside ``GenerateCalls.open`` exactly as a gRPC Generate does. A client that goes
away (aiohttp cancels the handler, or a write to its socket fails) leaves the block with
``CancelledError``: the call path ABORTs the request in the engine and the observer records
a cancelled call, as for a cancelled gRPC stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import grpc
from aiohttp import web

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError, invalid_argument
from switchboard.gateway.http.context import HttpCallContext
from switchboard.gateway.http.json_body import parse_body
from switchboard.gateway.http.openai_errors import error_body, error_response, json_response
from switchboard.gateway.http.openai_request import (
    OpenAIOptions,
    chat_request,
    completion_request,
)
from switchboard.gateway.http.openai_response import ChatShaper, CompletionShaper, Shaper
from switchboard.gateway.http.sse import open_stream, send_done, send_event
from switchboard.gateway.pipeline.generate_call import GenerateCalls
from switchboard.gateway.state import GatewayState
from switchboard.wire.field_rules import MAX_REQUEST_ID_CHARS

REQUEST_ID_HEADER = "X-Request-Id"
# GenerateRequest field -> OpenAI parameter, where the names differ (errors/openai_param).
_RESPONSE_FORMAT_PARAMS = dict.fromkeys(
    ("response_format.type", "response_format.json_schema", "response_format.json_schema.schema"),
    "response_format",
)
_COMPLETION_PARAMS = {"text": "prompt", "token_ids.ids": "prompt", **_RESPONSE_FORMAT_PARAMS}
_CHAT_PARAMS = {
    "text": "messages",
    "token_ids.ids": "messages",
    "logprobs": "top_logprobs",
    **_RESPONSE_FORMAT_PARAMS,
}
_STRUCTURED_OUTPUT_FIELDS = tuple(
    f"structured_output.{kind}"
    for kind in ("json_schema", "regex", "grammar", "choice", "choice.values", "json_object")
)


def _params(base: dict[str, str], options: OpenAIOptions) -> dict[str, str]:
    """The route's renames, plus structured_output.* -> the body field its constraint came from
    (``response_format``, a ``guided_*`` field, or ``tools`` for a forced tool call)."""
    if options.constraint_param is None:
        return base
    return {**base, **dict.fromkeys(_STRUCTURED_OUTPUT_FIELDS, options.constraint_param)}


class OpenAIRoutes:
    def __init__(self, state: GatewayState, calls: GenerateCalls) -> None:
        self._state = state
        self._calls = calls
        self._started = time.time()

    async def models(self, request: web.Request) -> web.Response:
        facts = self._state.facts
        model = {
            "id": facts.name,
            "object": "model",
            "created": int(self._started),
            "owned_by": "switchboard",
            "root": self._state.config.model.model,
            "max_model_len": facts.max_model_len,
            # what the engine runs, as GetModelInfo says it (not in OpenAI's model object)
            "dtype": facts.dtype,
            "quantization": facts.quantization,
            "parent": None,
        }
        adapters = [  # vLLM's entries of LoRA adapters: root = the directory, parent = base
            {**model, "id": name, "root": path, "parent": facts.name}
            for name, path in sorted(facts.loras.adapters.items())
        ]
        return json_response({"object": "list", "data": [model, *adapters]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival_time = time.time()
        try:
            request_id = _request_id(request, "cmpl")
            raw = parse_body(await request.read())
            generate, options = completion_request(raw, request_id)
        except ApiError as error:
            return error_response(error, _COMPLETION_PARAMS)
        shaper = CompletionShaper(*self._shaper_args(generate, options, request_id, arrival_time))
        params = _params(_COMPLETION_PARAMS, options)
        return await self._run(request, generate, options, shaper, arrival_time, params)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival_time = time.time()
        try:
            request_id = _request_id(request, "chatcmpl")
            raw = parse_body(await request.read())
            generate, options = chat_request(raw, request_id)
        except ApiError as error:
            return error_response(error, _CHAT_PARAMS)
        shaper = ChatShaper(
            *self._shaper_args(generate, options, request_id, arrival_time), tools=options.tools
        )
        params = _params(_CHAT_PARAMS, options)
        return await self._run(request, generate, options, shaper, arrival_time, params)

    def _shaper_args(
        self, generate: pb.GenerateRequest, options: OpenAIOptions, request_id: str, arrival: float
    ) -> tuple[Any, ...]:
        n = generate.sampling.n if generate.sampling.HasField("n") else 1
        facts = self._state.facts
        # vLLM's responses name the adapter a request ran with; any other model, the served one
        model = generate.model if generate.model in facts.loras.adapters else facts.name
        return request_id, model, int(arrival), n, options.logprobs

    async def _run(
        self,
        request: web.Request,
        generate: pb.GenerateRequest,
        options: OpenAIOptions,
        shaper: Shaper,
        arrival_time: float,
        params: dict[str, str],
    ) -> web.StreamResponse:
        headers = {REQUEST_ID_HEADER: shaper.request_id}
        context = HttpCallContext(request)
        stream: web.StreamResponse | None = None
        disconnected = False
        try:
            async with self._calls.open(generate, shaper.request_id, arrival_time, context) as call:
                if not options.stream:
                    final = None
                    async for response in call.responses():
                        final = response
                    assert final is not None  # FINAL_ONLY: exactly one message
                    return json_response(shaper.final(final), headers=headers)
                try:
                    stream = await open_stream(request, headers)
                    for chunk in shaper.opening_chunks():
                        await send_event(stream, _with_usage(chunk, options))
                    async for response in call.responses():
                        for chunk in shaper.chunks(response):
                            await send_event(stream, _with_usage(chunk, options))
                except ConnectionError:
                    disconnected = True  # the call path sees a cancelled call: ABORT
                    raise asyncio.CancelledError("the HTTP client disconnected") from None
            with contextlib.suppress(ConnectionError):  # done: nothing left to abort
                if options.include_usage:
                    await send_event(stream, shaper.usage_chunk())
                await send_done(stream)
            return stream
        except asyncio.CancelledError:
            if disconnected and stream is not None:
                return stream
            raise
        except ApiError as error:
            if stream is None:
                return error_response(error, params)
            with contextlib.suppress(ConnectionError):
                await send_event(stream, error_body(error, params))  # in band, as vLLM
                await send_done(stream)
            return stream


def _with_usage(chunk: dict[str, Any], options: OpenAIOptions) -> dict[str, Any]:
    if options.include_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last
    return chunk


def _request_id(request: web.Request, prefix: str) -> str:
    """The client's ``X-Request-Id`` (its key for the Abort RPC), else ``<prefix>-<uuid>``."""
    request_id = request.headers.get(REQUEST_ID_HEADER, "")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid_argument(
            "x-request-id", f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} characters"
        )
    return request_id or f"{prefix}-{uuid.uuid4().hex}"


def internal_error(message: str) -> web.Response:
    return error_response(ApiError(grpc.StatusCode.INTERNAL, message, reason="INTERNAL"))
