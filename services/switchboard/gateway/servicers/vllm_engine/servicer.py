"""The ``vllm.grpc.engine.VllmEngine`` servicer: a front like the OpenAI HTTP API. Generate and
Embed become ``switchboard.v1`` requests (``request.py``) and run through the shared pipeline
(validation, bounds, admission, metrics, spans, resume; API keys are the server's interceptor's);
their results go back in vLLM's shapes (``response.py``). The rest answers from what the
gateway knows (``info.py``, ``tokenizer_bundle.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import zmq.asyncio
from smg_grpc_proto import vllm_engine_pb2 as vllm_pb
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc
from smg_grpc_proto.generated import common_pb2

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError, invalid_argument, maps_api_errors
from switchboard.gateway.pipeline.embed_call import embed
from switchboard.gateway.pipeline.generate_call import GenerateCalls
from switchboard.gateway.pipeline.request_bounds import check_request_id
from switchboard.gateway.servicers.vllm_engine import info, kv_events
from switchboard.gateway.servicers.vllm_engine.request import (
    renamed,
    to_generate_request,
    unimplemented,
)
from switchboard.gateway.servicers.vllm_engine.response import ResponseTranslator
from switchboard.gateway.servicers.vllm_engine.tokenizer_bundle import TokenizerArchive, chunks
from switchboard.gateway.state import GatewayState

logger = logging.getLogger(__name__)

SERVICE_NAME = vllm_pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
FLUSH_UTILITY_TIMEOUT_S = 30.0
FLUSH_RETRY_S = 0.1


class VllmEngineServicer(vllm_grpc.VllmEngineServicer):
    def __init__(
        self, state: GatewayState, calls: GenerateCalls, is_ready: Callable[[], bool]
    ) -> None:
        self._state = state
        self._calls = calls
        self._is_ready = is_ready
        self._started = time.monotonic()
        self._last_receive = 0.0
        self._tokenizer_archive = TokenizerArchive(state.facts.model_path)
        self._kv_events_ctx = zmq.asyncio.Context()  # SubscribeKvEvents' sockets

    @maps_api_errors
    async def Generate(
        self, request: vllm_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_pb.GenerateResponse]:
        arrival_time = self._last_receive = time.time()
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        check_request_id(request_id)
        translator = ResponseTranslator(request.stream)
        try:
            translated = to_generate_request(request, request_id, self._state.facts.max_model_len)
            async with self._calls.open(translated, request_id, arrival_time, context) as call:
                async for response in call.responses():
                    for message in translator.translate(response):
                        yield message
        except ApiError as error:
            raise renamed(error) from None

    @maps_api_errors
    async def Embed(
        self, request: vllm_pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb.EmbedResponse:
        self._last_receive = time.time()
        if not request.HasField("tokenized"):
            raise invalid_argument("tokenized", "tokenized: Embed takes the input's token ids")
        translated = pb.EmbedRequest(request_id=request.request_id)
        translated.inputs.add().token_ids.ids.extend(request.tokenized.input_ids)
        try:
            result = await embed(self._state, translated, context.time_remaining())
        except ApiError as error:
            raise renamed(error) from None
        data = list(result.results[0].data)
        return vllm_pb.EmbedResponse(
            embedding=data, prompt_tokens=result.usage.prompt_tokens, embedding_dim=len(data)
        )

    async def HealthCheck(
        self, request: vllm_pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb.HealthCheckResponse:
        if self._is_ready():
            return vllm_pb.HealthCheckResponse(healthy=True, message="ready")
        return vllm_pb.HealthCheckResponse(
            healthy=False, message="no engine core takes requests (starting, stalled or dead)"
        )

    async def Abort(
        self, request: vllm_pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb.AbortResponse:
        aborted, _ = self._calls.abort(request.request_ids, "Abort RPC", context)
        if aborted:
            logger.info("Abort RPC (vLLM engine service): aborted %s", aborted)
        return vllm_pb.AbortResponse()

    async def GetModelInfo(
        self, request: vllm_pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb.GetModelInfoResponse:
        return info.model_info(self._state)

    async def GetServerInfo(
        self, request: vllm_pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb.GetServerInfoResponse:
        return info.server_info(
            self._state,
            self._calls.in_flight_count,
            self._last_receive,
            time.monotonic() - self._started,
        )

    @maps_api_errors
    async def GetLoads(
        self, request: vllm_pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb.GetLoadsResponse:
        return info.loads(self._state, request)

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        data, sha256 = await self._tokenizer_archive.get(self._state)
        for chunk in chunks(data, sha256):
            yield chunk

    @maps_api_errors
    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Reset every live engine's prefix cache. An engine with requests running refuses
        (their blocks are in use); ``timeout_s`` > 0 retries until then."""
        if request.timeout_s < 0:
            raise invalid_argument("timeout_s", f"timeout_s must be >= 0, got {request.timeout_s}")
        deadline = time.monotonic() + request.timeout_s
        pending = list(self._state.engines.live_engines)
        if not pending:
            return common_pb2.FlushCacheResponse(success=False, message="no engine core is ready")
        while True:
            results = await asyncio.gather(
                *(
                    self._state.engines.call_utility(
                        engine, "reset_prefix_cache", [], FLUSH_UTILITY_TIMEOUT_S
                    )
                    for engine in pending
                )
            )
            pending = [e for e, flushed in zip(pending, results, strict=True) if not flushed]
            if not pending or time.monotonic() >= deadline:
                break
            await asyncio.sleep(FLUSH_RETRY_S)
        if pending:
            busy = [engine.engine_id for engine in pending]
            return common_pb2.FlushCacheResponse(
                success=False, message=f"requests still hold KV blocks on {busy}: not flushed"
            )
        logger.info("FlushCache: prefix cache reset on every engine")
        return common_pb2.FlushCacheResponse(success=True, message="prefix cache reset")

    @maps_api_errors
    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        raise unimplemented("StartProfile: this server has no engine profiler to start")

    @maps_api_errors
    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        raise unimplemented("StopProfile: this server has no engine profiler to stop")

    @maps_api_errors
    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Every DP rank's KV cache events (``kv_events.py``); cancelling the call closes
        its sockets."""
        relay = await kv_events.subscribe(
            self._state, self._kv_events_ctx, request.start_sequence_number
        )
        await context.send_initial_metadata(())
        async for batch in relay.stream():
            yield batch
