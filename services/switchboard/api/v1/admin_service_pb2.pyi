from google.protobuf import struct_pb2 as _struct_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UtilityRequest(_message.Message):
    __slots__ = ("method", "args", "kwargs", "engine_ids")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    method: str
    args: _struct_pb2.ListValue
    kwargs: _struct_pb2.Struct
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, method: _Optional[str] = ..., args: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class UtilityResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[UtilityResult]
    def __init__(self, results: _Optional[_Iterable[_Union[UtilityResult, _Mapping]]] = ...) -> None: ...

class UtilityResult(_message.Message):
    __slots__ = ("engine_id", "result", "status")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    result: _struct_pb2.Value
    status: _status_pb2.Status
    def __init__(self, engine_id: _Optional[str] = ..., result: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...
