from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class ModelTask(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_TASK_UNSPECIFIED: _ClassVar[ModelTask]
    MODEL_TASK_GENERATE: _ClassVar[ModelTask]
    MODEL_TASK_EMBED: _ClassVar[ModelTask]
    MODEL_TASK_CLASSIFY: _ClassVar[ModelTask]
    MODEL_TASK_SCORE: _ClassVar[ModelTask]
    MODEL_TASK_TOKEN_EMBED: _ClassVar[ModelTask]
    MODEL_TASK_TOKEN_CLASSIFY: _ClassVar[ModelTask]
MODEL_TASK_UNSPECIFIED: ModelTask
MODEL_TASK_GENERATE: ModelTask
MODEL_TASK_EMBED: ModelTask
MODEL_TASK_CLASSIFY: ModelTask
MODEL_TASK_SCORE: ModelTask
MODEL_TASK_TOKEN_EMBED: ModelTask
MODEL_TASK_TOKEN_CLASSIFY: ModelTask
