"""switchboard.v1.ModelService: discovery from the checkpoint directory and the engines' READY."""

from __future__ import annotations

import grpc
from google.protobuf import json_format

import switchboard
from switchboard.api.v1 import common_pb2
from switchboard.api.v1 import model_service_pb2 as pb
from switchboard.api.v1 import model_service_pb2_grpc as pb_grpc
from switchboard.gateway.api_errors import maps_api_errors
from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.pipeline.request_bounds import check_model_name
from switchboard.gateway.pipeline.validation import check_model_or_adapter
from switchboard.gateway.state import GatewayState

API_VERSION = "switchboard.v1"


class ModelServicer(pb_grpc.ModelServiceServicer):
    def __init__(self, state: GatewayState) -> None:
        self._state = state

    def _card(self) -> pb.ModelCard:
        tasks = [common_pb2.MODEL_TASK_EMBED]
        if self._state.facts.tasks.can_generate:
            tasks.insert(0, common_pb2.MODEL_TASK_GENERATE)
        return pb.ModelCard(name=self._state.facts.name, tasks=tasks)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        facts = self._state.facts
        adapters = [_adapter_card(name, facts.name) for name in sorted(facts.loras.adapters)]
        return pb.ListModelsResponse(models=[self._card(), *adapters])

    @maps_api_errors
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        facts = self._state.facts
        check_model_name(request.model)
        await self._state.adapter_lookup.learn_names(request.model)
        adapter = check_model_or_adapter(request.model, facts)
        response = pb.GetModelInfoResponse(
            card=_adapter_card(adapter, facts.name) if adapter else self._card(),
            model_path=facts.model_path,
            max_model_len=facts.max_model_len,
            vocab_size=facts.vocab_size,
            eos_token_ids=list(facts.eos_token_ids),
            dtype=facts.dtype,
            quantization=facts.quantization,
        )
        if facts.bos_token_id is not None:
            response.bos_token_id = facts.bos_token_id
        json_format.ParseDict(
            facts.generation_config, response.generation_defaults, ignore_unknown_fields=True
        )
        return response

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        engines = sorted(
            self._state.engines.engines.values(), key=lambda e: e.ready.data_parallel_rank
        )
        return pb.GetServerInfoResponse(
            gateway_version=switchboard.__version__,
            api_version=API_VERSION,
            engines=[self._engine_info(e, self._state.config.num_engines) for e in engines],
        )

    @staticmethod
    def _engine_info(engine: EngineHandle, data_parallel_size: int) -> pb.EngineInfo:
        ready, stats = engine.ready, engine.scheduler_stats
        info = pb.EngineInfo(
            engine_id=ready.engine_id,
            state=pb.ENGINE_STATE_READY if engine.alive else pb.ENGINE_STATE_DEAD,
            tensor_parallel_size=ready.tensor_parallel_size,
            pipeline_parallel_size=ready.pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            kv_block_size=ready.block_size,
            num_gpu_blocks=ready.num_gpu_blocks,
            engine_version=ready.engine_version,
            data_parallel_rank=ready.data_parallel_rank,
            kv_capacity_tokens=ready.kv_capacity_tokens,
        )
        if stats is not None:
            info.num_running = stats.num_running_reqs
            info.num_waiting = stats.num_waiting_reqs
            info.kv_cache_usage = stats.kv_cache_usage
        return info


def _adapter_card(name: str, base: str) -> pb.ModelCard:
    """A LoRA adapter: it generates, on ``base`` (its ``parent``)."""
    return pb.ModelCard(name=name, parent=base, tasks=[common_pb2.MODEL_TASK_GENERATE])
