"""switchboard.v1.AdminService: engine-core UTILITY calls behind a gateway-side allow-list.

A utility call is a remote method call into the engine core, so the gateway forwards only the
methods named here, whatever the engine would accept. The service is registered only when the
gateway runs with ``enable_admin``; otherwise gRPC answers UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import msgspec
from google.protobuf import json_format, struct_pb2
from google.rpc import status_pb2

from switchboard.api.v1 import admin_service_pb2 as pb
from switchboard.api.v1 import admin_service_pb2_grpc as pb_grpc
from switchboard.gateway.api_errors import ApiError, invalid_argument, maps_api_errors, unavailable
from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.lora_admin import LoraAdmin
from switchboard.gateway.state import GatewayState

logger = logging.getLogger(__name__)

# add_lora / remove_lora go through LoadLoraAdapter / UnloadLoraAdapter, which keep the
# gateway's adapter names in step with the engines.
UTILITY_ALLOW_LIST = frozenset(
    {
        "reset_prefix_cache",
        "sleep",
        "wake_up",
        "is_sleeping",
        "get_stats",
        "get_cached_block_hashes",
        "list_loras",
    }
)
UTILITY_TIMEOUT_S = 60.0


def _to_value(result: Any) -> struct_pb2.Value:
    value = struct_pb2.Value()
    json_format.ParseDict(msgspec.to_builtins(result, str_keys=True), value)
    return value


def lora_adapter_message(described: dict[str, Any]) -> pb.LoraAdapter:
    """An engine's description of an adapter (``wire/lora.py``) as the API's message."""
    return pb.LoraAdapter(
        name=str(described.get("name", "")),
        path=str(described.get("path", "")),
        rank=int(described.get("rank", 0)),
        scaling=float(described.get("scaling", 0.0)),
        target_modules=[str(m) for m in described.get("target_modules", [])],
    )


class AdminServicer(pb_grpc.AdminServiceServicer):
    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self._loras = LoraAdmin(state)

    @maps_api_errors
    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadLoraAdapterResponse:
        described = await self._loras.load(request.lora_name, request.lora_path)
        return pb.LoadLoraAdapterResponse(adapter=lora_adapter_message(described))

    @maps_api_errors
    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        await self._loras.unload(request.lora_name)
        return pb.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoraAdaptersResponse:
        adapters = [
            pb.LoraAdapter(name=n, path=p) for n, p in sorted(self._loras.adapters().items())
        ]
        return pb.ListLoraAdaptersResponse(adapters=adapters)

    @maps_api_errors
    async def Utility(
        self, request: pb.UtilityRequest, context: grpc.aio.ServicerContext
    ) -> pb.UtilityResponse:
        engines = self._check(request)
        args = json_format.MessageToDict(request.args) if request.HasField("args") else []
        logger.info(
            "admin utility %s%s on %s", request.method, args, [e.engine_id for e in engines]
        )
        results = await asyncio.gather(
            *(self._call(engine, request.method, args) for engine in engines)
        )
        return pb.UtilityResponse(results=results)

    def _check(self, request: pb.UtilityRequest) -> list[EngineHandle]:
        if request.method not in UTILITY_ALLOW_LIST:
            raise ApiError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"method {request.method!r} is not on the utility allow-list "
                f"{sorted(UTILITY_ALLOW_LIST)}",
                reason="METHOD_NOT_ALLOWED",
                field="method",
            )
        if request.HasField("kwargs") and request.kwargs.fields:
            raise invalid_argument(
                "kwargs", "kwargs: utility calls take positional args only; use args"
            )
        live = self._state.engines.live_engines
        if not request.engine_ids:
            if not live:
                raise unavailable("no engine core is ready")
            return live
        by_id = {e.engine_id: e for e in live}
        unknown = [i for i in request.engine_ids if i not in by_id]
        if unknown:
            raise ApiError(
                grpc.StatusCode.NOT_FOUND,
                f"engine_ids: no live engine core named {unknown} (live: {sorted(by_id)})",
                reason="ENGINE_NOT_FOUND",
                field="engine_ids",
            )
        return [by_id[i] for i in request.engine_ids]

    async def _call(self, engine: EngineHandle, method: str, args: list) -> pb.UtilityResult:
        result = pb.UtilityResult(engine_id=engine.engine_id)
        try:
            value = await self._state.engines.call_utility(engine, method, args, UTILITY_TIMEOUT_S)
            result.result.CopyFrom(_to_value(value))
        except ApiError as error:
            status = status_pb2.Status(code=error.code.value[0], message=error.message)
            result.status.CopyFrom(status)
        return result
