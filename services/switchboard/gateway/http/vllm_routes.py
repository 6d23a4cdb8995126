"""The routes vLLM serves beside OpenAI's: ``POST /v1/embeddings`` (OpenAI's shape, through the
Embed call), ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` and ``GET /metrics``
(the gateway's registry, under the rules of ``--metrics-port``: the metrics token when one is
set, never the API keys; 404 while metrics are off)."""

from __future__ import annotations

import array
import asyncio
import base64
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import switchboard
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.auth import Credentials, log_refusal
from switchboard.gateway.http.json_body import parse_body
from switchboard.gateway.http.openai_errors import error_response, json_response
from switchboard.gateway.http.vllm_request import (
    detokenize_request,
    embeddings_request,
    tokenize_request,
)
from switchboard.gateway.pipeline.embed_call import embed
from switchboard.gateway.pipeline.tokenize_call import detokenize, tokenize, tokenize_chat
from switchboard.gateway.state import GatewayState

METRICS_PATH = "/metrics"
_TOKENIZE_PARAMS = {"text": "prompt", "token_ids": "tokens"}


def _embed_params(error: ApiError) -> dict[str, str]:
    """Embed's fields (``inputs[2].text``) -> OpenAI's ``input``."""
    return {error.field: "input"} if error.field.startswith("inputs") else {}


class VllmRoutes:
    def __init__(self, state: GatewayState, credentials: Credentials | None) -> None:
        self._state = state
        self._credentials = credentials or Credentials()

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/embeddings", self.embeddings)
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)
        router.add_get("/version", self.version)
        router.add_get(METRICS_PATH, self.metrics)

    async def embeddings(self, request: web.Request) -> web.Response:
        created = int(time.time())
        request_id = f"embd-{uuid.uuid4().hex}"
        try:
            call = embeddings_request(parse_body(await request.read()), request_id)
            response = await embed(self._state, call.request, None)
        except ApiError as error:
            return error_response(error, _embed_params(error))
        data: list[dict[str, Any]] = []
        for result in response.results:
            vector: Any = list(result.data)
            if call.encoding_format == "base64":  # float32, little-endian, as OpenAI's
                vector = base64.b64encode(array.array("f", result.data).tobytes()).decode()
            data.append({"index": result.index, "object": "embedding", "embedding": vector})
        tokens = response.usage.prompt_tokens
        return json_response(
            {
                "id": request_id,
                "object": "list",
                "created": created,
                "model": self._state.facts.name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            call = tokenize_request(parse_body(await request.read()))
            if call.chat is not None:
                tokenized = await tokenize_chat(
                    self._state, call.chat, call.add_special_tokens, call.return_token_strs
                )
            else:
                assert call.request is not None
                tokenized = await tokenize(self._state, call.request)
        except ApiError as error:
            return error_response(error, _TOKENIZE_PARAMS)
        return json_response(
            {
                "count": len(tokenized.token_ids),
                "max_model_len": tokenized.max_model_len,
                "tokens": list(tokenized.token_ids),
                "token_strs": list(tokenized.token_strs) if call.return_token_strs else None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            detokenized = await detokenize(
                self._state, detokenize_request(parse_body(await request.read()))
            )
        except ApiError as error:
            return error_response(error, _TOKENIZE_PARAMS)
        return json_response({"prompt": detokenized.text})

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": switchboard.__version__})

    async def metrics(self, request: web.Request) -> web.Response:
        gateway_metrics = self._state.observability.metrics
        if gateway_metrics is None:
            raise web.HTTPNotFound(reason="metrics are off: start the gateway with --metrics-port")
        refused = self._credentials.check_metrics(request.headers.items())
        if refused is not None:
            log_refusal(f"{METRICS_PATH} from {request.remote}", refused)
            return web.Response(
                status=401,
                text=f"401 Unauthorized: {refused.message}\n",
                headers={"WWW-Authenticate": "Bearer"},
            )
        loop = asyncio.get_running_loop()  # collectors read the process: off the event loop
        body = await loop.run_in_executor(None, generate_latest, gateway_metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
