"""Wire 2 contract: what the engine core broadcasts to its workers, and what they answer.

Every message on the ring is one :class:`RpcCall`: call ``method`` with ``args``/``kwargs`` on
every worker; only the worker whose rank equals ``output_rank`` sends a :class:`RpcReply` on the
response queue. Arguments are plain msgpack values; a worker converts them to the structs its
method is annotated with (``msgspec.convert``), so no pickle is ever needed.

The per-step broadcast (:class:`SchedulerOutput`) is a *delta*: requests new to the batch carry
their prompt and block table once; requests already running carry only their new block ids and
the number of tokens computed so far (and, for constrained requests, the step's token bitmask).
Workers keep per-request state between steps and drop it
when a request id appears in ``finished_request_ids``.

A request's tokens in a step are ``tokens[num_computed_tokens : num_computed_tokens + n]``
with ``n = num_scheduled_tokens[request_id]``. When that reaches the end of the tokens the
worker knows, it samples one token (a prefill chunk that stops short samples nothing) and
appends it to its own copy of the request's tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from switchboard.wire.engine_msgs import PoolingParams, SamplingParams, TokenLogprobs


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire-2 body."""


class NewRequest(_Wire):
    """A request joining the batch (first time, or again after preemption)."""

    request_id: str
    prompt_token_ids: list[int]  # after a preemption: prompt + tokens generated so far
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # > 0 when the prefix cache supplied the first blocks
    num_output_tokens: int = 0  # tokens of prompt_token_ids that were generated (resume)
    pooling_params: PoolingParams | None = None  # set: pool the prompt, sample nothing
    lora_name: str = ""  # appended: the LoRA adapter it runs with ("" = the base model)


class CachedRequest(_Wire):
    """A request that was in the previous step's batch too."""

    request_id: str
    new_block_ids: list[int]  # appended to the worker's block table
    num_computed_tokens: int


# A proposal the engine leaves to the workers' draft model (speculative decoding with a draft
# model): the engine reserves the position, the worker fills in the token.
DRAFT_PLACEHOLDER = -1


class SchedulerOutput(_Wire):
    step_id: int
    new_requests: list[NewRequest] = []
    cached_requests: list[CachedRequest] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    finished_request_ids: list[str] = []  # drop their state (finished, aborted or preempted)
    # Appended for structured output: the allowed next tokens of the constrained requests that
    # sample in this step, one row each (in ``structured_request_ids`` order) of
    # ceil(vocab / 32) little-endian int32 words, bit ``t % 32`` of word ``t // 32`` set when
    # token ``t`` is allowed. Every worker gets it; the ones that sample apply it to the logits.
    grammar_bitmask: bytes = b""
    structured_request_ids: list[str] = []
    # Appended for speculative decoding: tokens proposed for a decoding request, computed after
    # its scheduled token (num_scheduled_tokens counts them). The workers sample every one of
    # those positions and return the longest prefix of proposals equal to their samples, plus
    # the sample after it (worker/spec_verify.py). Entries of DRAFT_PLACEHOLDER: the workers'
    # draft model proposes those positions itself, in this step, before verifying them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}


class ModelRunnerOutput(_Wire):
    step_id: int
    request_ids: list[str] = []  # same order as sampled_token_ids
    sampled_token_ids: list[list[int]] = []  # [] for a prefill chunk that sampled nothing
    # Parallel to sampled_token_ids, for requests that asked for logprobs ([] otherwise).
    logprobs: list[list[TokenLogprobs]] = []
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}  # per request, once its prompt is done
    pooled_outputs: dict[str, list[float]] = {}  # pooling requests, once their prompt is done


class ModelSummary(_Wire):
    """What the engine learns from the loaded model (answer to ``load_model``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str  # the dtype the model runs in, e.g. "float32"
    kv_cache_bytes_per_token: int  # over all layers, K and V, on this worker
    device_type: str = "cpu"  # torch's device type the worker computes on: "cpu", "cuda"
    # the weights kept quantized for decode: "none", "gguf Q4_1, Q8_0", "int8"
    quantization: str = "none"
    # The most tokens a step may have for its matmuls to run on the CPU kernels for few rows
    # (0: no such kernel): the engine shares steps in no more (config.with_step_budget).
    few_rows_limit: int = 0


class RpcCall(_Wire):
    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    output_rank: int = 0


class RpcCallHead(_Wire):
    """An :class:`RpcCall` read from the same bytes with its arguments left encoded, so a
    worker can decode them straight into the types its method takes."""

    call_id: int
    method: str
    args: msgspec.Raw = msgspec.Raw(b"\x90")  # an empty msgpack array
    kwargs: dict[str, Any] = {}
    output_rank: int = 0


class RpcReply(_Wire):
    call_id: int
    rank: int
    result: Any = None
    error: str | None = None  # set when the method raised: the call failed on this rank


class WorkerStartup(_Wire):
    """The one argument of ``python -m switchboard.worker --startup-json JSON``."""

    rank: int  # within this engine's workers (0 .. world_size - 1)
    world_size: int
    data_parallel_rank: int
    pp_rank: int
    tp_rank: int
    # msgspec.to_builtins(shm_ring.RingHandle): a list, since RingHandle is array_like (a dict
    # of its fields is accepted too); the worker rebuilds it with msgspec.convert.
    ring_handle: Any
    reply_address: str  # ipc:// address of the engine's PULL for RpcReply (worker connects PUSH)
    engine_config_json: str  # config.EngineConfig, encoded with config.encode_config
    parent_pid: int  # the worker exits when its parent is gone
    # Appended for tensor/pipeline parallelism: where the engine's workers meet for
    # torch.distributed (file:// under the run directory, or tcp://host:port); "" = one worker.
    distributed_init_method: str = ""
