"""GenerationService: Generate, Abort, Embed, Tokenize, Detokenize (the calls themselves run in
``pipeline/``, shared with the HTTP front)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.gateway.api_errors import maps_api_errors
from switchboard.gateway.pipeline.embed_call import embed
from switchboard.gateway.pipeline.generate_call import GenerateCalls
from switchboard.gateway.pipeline.request_bounds import (
    check_labels,
    check_model_name,
    check_request_id,
)
from switchboard.gateway.pipeline.tokenize_call import detokenize, tokenize
from switchboard.gateway.state import GatewayState

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, state: GatewayState, calls: GenerateCalls | None = None) -> None:
        self._state = state
        self._calls = calls if calls is not None else GenerateCalls(state)  # shared with HTTP

    @maps_api_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival_time = time.time()
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        # Before anything is echoed (the x-request-id header, errors naming the model): the
        # fields' sizes and characters.
        check_request_id(request_id)
        check_model_name(request.model)
        check_labels(request.labels)
        # The header goes out while the request is checked and sent to an engine, not before:
        # awaiting it first held the ADD back for a round trip through gRPC's completion queue
        # and the event loop (milliseconds when the loop is busy streaming other requests).
        # It completes before anything else is sent on the call: a response or an error.
        header = asyncio.ensure_future(
            context.send_initial_metadata(((REQUEST_ID_HEADER, request_id),))
        )
        try:
            async with self._calls.open(request, request_id, arrival_time, context) as call:
                await header
                async for response in call.responses():
                    yield response
        finally:  # an error goes out after the header, as it did; a failed header ends the call
            with contextlib.suppress(Exception):
                await asyncio.shield(header)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        aborted, unknown = self._calls.abort(
            request.request_ids, request.reason or "Abort RPC", context
        )
        response = pb.AbortResponse(aborted_request_ids=aborted, unknown_request_ids=unknown)
        if aborted:
            logger.info("Abort RPC (%s): aborted %s", request.reason or "no reason given", aborted)
        return response

    @maps_api_errors
    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        return await embed(self._state, request, context.time_remaining())

    @maps_api_errors
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await tokenize(self._state, request)

    @maps_api_errors
    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        return await detokenize(self._state, request)
