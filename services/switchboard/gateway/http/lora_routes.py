"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
with a JSON body ``{"lora_name": ..., "lora_path": ...}`` (unload: the name alone).

They change what the server serves, so they are the control plane's: served only with
``--enable-admin`` (404 otherwise, as vLLM answers while runtime updating is off) and, with an
``--admin-token``, only to that token (the API keys do not open them). Errors are OpenAI-shaped;
unloading an adapter in use is 409 (``gateway/lora_admin.py`` says why it is refused).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from switchboard.gateway.api_errors import ApiError, invalid_argument
from switchboard.gateway.auth import Credentials, log_refusal
from switchboard.gateway.http.json_body import parse_body
from switchboard.gateway.http.openai_errors import error_response
from switchboard.gateway.lora_admin import IN_USE_REASON, LoraAdmin
from switchboard.gateway.state import GatewayState

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
PATHS = frozenset({LOAD_PATH, UNLOAD_PATH})


class LoraRoutes:
    def __init__(self, state: GatewayState, credentials: Credentials | None) -> None:
        self._state = state
        self._credentials = credentials or Credentials()
        self._admin = LoraAdmin(state)

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post(LOAD_PATH, self.load)
        router.add_post(UNLOAD_PATH, self.unload)

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            await self._admin.load(_text(body, "lora_name"), _text(body, "lora_path"))
        except ApiError as error:
            return _error(error)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            await self._admin.unload(_text(body, "lora_name"))
        except ApiError as error:
            return _error(error)
        return web.Response(
            text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully."
        )

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if not self._state.config.gateway.enable_admin:
            raise web.HTTPNotFound(
                reason="runtime LoRA loading is off: start the gateway with --enable-admin"
            )
        refused = self._credentials.check_admin(request.headers.items())
        if refused is not None:
            log_refusal(f"HTTP POST {request.path!r} from {request.remote}", refused)
            raise refused
        return parse_body(await request.read())


def _text(body: dict[str, Any], field: str) -> str:
    value = body.get(field, "")
    if not isinstance(value, str):
        raise invalid_argument(field, f"{field} must be a string")
    return value


def _error(error: ApiError) -> web.Response:
    response = error_response(error)
    if error.reason == IN_USE_REASON:
        response.set_status(409)
    if error.code.name == "UNAUTHENTICATED":
        response.headers["WWW-Authenticate"] = "Bearer"
    return response
