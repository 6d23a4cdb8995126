from google.protobuf import struct_pb2 as _struct_pb2
from switchboard.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_STARTING: _ClassVar[EngineState]
    ENGINE_STATE_READY: _ClassVar[EngineState]
    ENGINE_STATE_DRAINING: _ClassVar[EngineState]
    ENGINE_STATE_SLEEPING: _ClassVar[EngineState]
    ENGINE_STATE_DEAD: _ClassVar[EngineState]
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_STARTING: EngineState
ENGINE_STATE_READY: EngineState
ENGINE_STATE_DRAINING: EngineState
ENGINE_STATE_SLEEPING: EngineState
ENGINE_STATE_DEAD: EngineState

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("name", "aliases", "parent", "tasks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    parent: str
    tasks: _containers.RepeatedScalarFieldContainer[_common_pb2.ModelTask]
    def __init__(self, name: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., parent: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[_common_pb2.ModelTask, str]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("card", "model_path", "max_model_len", "vocab_size", "eos_token_ids", "bos_token_id", "dtype", "quantization", "max_loras", "generation_defaults")
    CARD_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    card: ModelCard
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    dtype: str
    quantization: str
    max_loras: int
    generation_defaults: _struct_pb2.Struct
    def __init__(self, card: _Optional[_Union[ModelCard, _Mapping]] = ..., model_path: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., max_loras: _Optional[int] = ..., generation_defaults: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("gateway_version", "api_version", "engines")
    GATEWAY_VERSION_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    gateway_version: str
    api_version: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, gateway_version: _Optional[str] = ..., api_version: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "state", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "kv_block_size", "num_gpu_blocks", "num_running", "num_waiting", "kv_cache_usage", "engine_version", "data_parallel_rank", "kv_capacity_tokens")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    state: EngineState
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    kv_block_size: int
    num_gpu_blocks: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    engine_version: str
    data_parallel_rank: int
    kv_capacity_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., state: _Optional[_Union[EngineState, str]] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., data_parallel_size: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., engine_version: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ...) -> None: ...
