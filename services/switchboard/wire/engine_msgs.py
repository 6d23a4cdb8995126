"""Wire 1 contract: messages between a gateway and an engine core.

Every body is a ``msgspec.Struct(array_like=True, omit_defaults=True, gc=False)``: a field is
identified by its position and the garbage collector does not track the objects (msgspec 0.23
still writes trailing defaults of an array-like struct; a decoder accepts a shorter array). New
fields are only ever appended, with a default, so an older peer still decodes a newer message.
Text never crosses this wire: the engine core is tokens in, tokens out.

Frames gateway -> engine (ROUTER -> DEALER)::

    [engine identity][1 type byte][msgpack body][tensor frame 0][tensor frame 1]...

Frames engine -> gateway:

* on the DEALER, first and once: ``[msgpack EngineReady]`` (a ROUTER can only address peers it
  has heard from, so the engine speaks first), later utility replies travel on the PUSH;
* on the PUSH: ``[msgpack EngineCoreOutputs][tensor frames...]`` once per engine step, or
  ``[b"ENGINE_CORE_DEAD"][msgpack EngineDead]`` as the engine's last word (older engines send
  the first frame alone).

Beside wire 1 proper (appended for several engines and hosts): ``EngineLoad``/``LoadReport``
between engines, the coordinator and the gateways, and the TCP handshake
(``GatewayHello``/``GatewayAddresses``) of engines that run on other hosts.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class RequestType(bytes, enum.Enum):
    """The type byte of a gateway -> engine frame (frame 1)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"  # internal sentinel: never sent by a gateway
    WAKEUP = b"\x05"  # internal sentinel: unblocks an idle busy loop


class FinishReason(enum.IntEnum):
    """Why a request ended; an integer on the wire, a word in the API."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class EventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire-1 body."""


class SamplingParams(_Wire):
    """What the engine and worker need to pick and stop tokens (already validated)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    eos_token_ids: list[int] = []  # from the model; ignored when ignore_eos
    ignore_eos: bool = False
    # Appended (with defaults, so older peers still decode) for the rest of the sampling
    # surface: penalties, masks, logprobs, repetition detection; each default is the knob's no-op.
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI/vLLM: over output tokens only
    frequency_penalty: float = 0.0  # OpenAI/vLLM: over output tokens only
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt + output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Token-id sequences: the last token of one is banned when the others end the output.
    bad_words_token_ids: list[list[int]] | None = None
    logprobs: int | None = None  # top-N alternatives per output token (0 = the chosen only)
    prompt_logprobs: int | None = None  # top-N per prompt token (all but the first)
    repetition_detection: RepetitionDetectionParams | None = None
    # Appended for constrained decoding: the output must match this (engine-side grammar).
    structured_output: StructuredOutputParams | None = None


class StructuredOutputParams(_Wire):
    """A constraint on the output (``switchboard/common/constraint_grammar.py`` lists the kinds):
    the engine compiles it, masks the logits each step and ends the request with STOP when the
    output is complete."""

    kind: str  # json_schema | json_object | regex | grammar | choice | structural_tag
    spec: str = ""  # schema JSON / regex / grammar text / JSON list of choices / tag JSON


class RepetitionDetectionParams(_Wire):
    """End a request (REPETITION) whose last output tokens repeat one pattern of
    ``min_pattern_size..max_pattern_size`` tokens at least ``min_count`` times back to back."""

    min_pattern_size: int = 1
    max_pattern_size: int = 1
    min_count: int = 2


class EngineCoreEvent(_Wire):
    """A state change of a request, stamped with the engine's monotonic clock (ns)."""

    type: EventType
    timestamp_ns: int


class EngineCoreRequest(_Wire):
    request_id: str
    prompt_token_ids: list[int]
    mm_features: list[Any] | None = None
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None  # set: an embedding request (prefill only)
    arrival_time: float = 0.0  # gateway wall clock, seconds
    lora_request: dict[str, Any] | None = None
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    prompt_embeds: TensorRef | None = None
    client_index: int = 0
    priority: int = 0
    trace_context: dict[str, str] | None = None  # W3C traceparent / tracestate
    # Appended for resumed streams (gateway/engines/resume.py): output tokens another engine
    # already generated (and the client received) before it died. The engine continues after
    # them exactly as after a preemption: they count as output (max_tokens, min_tokens,
    # penalties, a seed's draw position), never as prompt, and are not sent again.
    output_token_ids: list[int] = []


class TensorRef(_Wire):
    """A tensor that travels as its own zero-copy frame after the msgpack body."""

    dtype: str  # numpy dtype string, e.g. "<f4"
    shape: list[int]
    frame_index: int  # index into the tensor frames that follow the body


class TokenLogprobs(_Wire):
    """Logprobs at one position: the chosen (sampled or prompt) token first, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # each token's rank in the vocabulary at this position (1 = most likely)


class EngineCoreOutput(_Wire):
    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it
    events: list[EngineCoreEvent] | None = None
    num_cached_tokens: int = 0  # prefill stat: prompt tokens served from the prefix cache
    num_preemptions: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # first output only, when asked for
    pooled_output: list[float] | None = None  # embedding (pooling requests), final output only
    # Appended for speculative decoding: tokens proposed for this request by the steps of this
    # output, and how many of them were accepted (0 and 0 without speculation).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Appended: with finish ERROR, the LoRA adapter the request named that this engine does
    # not hold (e.g. unloaded through another gateway); the gateway answers NOT_FOUND.
    lora_not_loaded: str = ""


class UtilityOutput(_Wire):
    call_id: int
    failure_message: str | None = None
    result: Any = None


# Bucket bounds of SchedulerStats.iteration_tokens_counts (vLLM's iteration_tokens buckets).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SchedulerStats(_Wire):
    """Sent with every step's outputs and every heartbeat: gauges of now, counters (and the
    iteration histogram) cumulative since the engine started."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_num_tokens: int = 0
    # Appended for the gateway's iteration-tokens histogram: tokens per engine step since
    # start-up, as a count per bucket of ITERATION_TOKENS_BUCKETS (count i: steps of at most
    # bucket i tokens and more than bucket i-1; the last count: more than the last bucket), and
    # their sum.
    iteration_tokens_counts: list[int] = []
    iteration_tokens_sum: int = 0
    # Appended: a worker that has not answered the current step within the step timeout
    # (rank -1: none), its pid, and for how long it had not answered when this was sent.
    stalled_worker_rank: int = -1
    stalled_worker_pid: int = 0
    stalled_for_s: float = 0.0
    # Appended for speculative decoding, cumulative since start-up: requests' steps with
    # proposals, the tokens proposed, those accepted, and accepted ones by proposal position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: list[int] = []
    # Appended for LoRA: the adapters of the running and of the waiting requests, sorted.
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # Appended: what a proposed row costs as a share of a decode step's fixed part, as the
    # engine measures it (engine/speculation/step_cost.py; 0.0 while speculation is off).
    spec_decode_row_cost: float = 0.0


class EngineCoreOutputs(_Wire):
    """One message per engine step per gateway."""

    engine_index: int = 0
    timestamp_ns: int = 0  # the engine's monotonic clock when the step's outputs were made
    outputs: list[EngineCoreOutput] = []
    utility_output: UtilityOutput | None = None
    scheduler_stats: SchedulerStats | None = None
    heartbeat: bool = False  # a keep-alive with no outputs: silence means death
    # Appended for metrics, set with scheduler_stats: the receiving gateway is the one
    # that exports this engine's engine-level series (the engine names exactly one of the
    # gateways it talks to, the lowest client_index), so none is missing or counted twice.
    exports_engine_stats: bool = False


class UtilityCall(_Wire):
    """Body of a UTILITY frame: call an allow-listed engine method."""

    client_index: int
    call_id: int
    method_name: str
    args: list[Any] = []


class EngineReady(_Wire):
    """The engine's first message to every gateway: facts that may differ from configuration."""

    engine_id: str
    data_parallel_rank: int
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    kv_capacity_tokens: int
    wall_clock_ns: int  # time.time_ns() taken together with ...
    monotonic_ns: int  # ... time.monotonic_ns(): places engine events on the wall clock
    vocab_size: int = 0
    dtype: str = ""
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    engine_version: str = ""
    enable_prefix_caching: bool = True  # appended: vllm:cache_config_info
    # appended: the weights kept quantized for decode, as the worker did it ("none", "int8",
    # "gguf Q4_1, Q8_0"); "" from an engine that does not say
    quantization: str = ""
    # appended: this engine's KV-event publisher (wire/kv_events.py) as it bound it, offset by
    # its rank ("" = events off; a wildcard host is this engine's host)
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""


# ---- appended for DP > 1 and engines on other hosts: death notice, load, TCP handshake -------


class EngineDead(_Wire):
    """Second frame of ``ENGINE_CORE_DEAD`` (``[b"ENGINE_CORE_DEAD"][msgpack EngineDead]``): which
    engine died, so a gateway with several engines fails only that engine's requests. A
    single-frame ``ENGINE_CORE_DEAD`` (older engines) names no engine."""

    engine_index: int
    engine_id: str = ""


class EngineLoad(_Wire):
    """Engine -> coordinator (PUSH -> PULL), sent when the counts change, at most every 100 ms."""

    engine_index: int
    num_waiting_reqs: int
    num_running_reqs: int
    kv_cache_usage: float = 0.0  # 0..1
    engine_id: str = ""


class LoadReport(_Wire):
    """Coordinator -> gateways (PUB -> SUB): the freshest load of every engine it heard from,
    published every 100 ms when something changed and every 5 s otherwise (a keep-alive)."""

    sequence: int  # increases by one per publication
    engines: list[EngineLoad] = []


class GatewayHello(_Wire):
    """Engine -> gateway on the gateway's fixed TCP handshake port (DEALER -> ROUTER)."""

    engine_index: int
    engine_id: str = ""


class GatewayAddresses(_Wire):
    """Gateway -> engine, the answer to ``GatewayHello``: the ports the kernel gave the
    gateway's data sockets (the engine connects to them on the address it reached the
    handshake port at), and the ``client_index`` that routes outputs back to this gateway."""

    gateway_id: str  # changes when the gateway restarts: the engine then reconnects
    client_index: int
    input_port: int  # the gateway's ROUTER: the engine connects a DEALER and sends READY
    output_port: int  # the gateway's PULL: the engine connects a PUSH
    coordinator_address: str = ""  # where the engine pushes EngineLoad ("" = nowhere)


# ---- appended for embeddings: what a pooling request wants -----------------------------------


class PoolingType(enum.StrEnum):
    """How a sequence's final hidden states become one vector."""

    LAST = "last"  # the last token's (decoders: the only one that saw the whole input)
    MEAN = "mean"  # the average over every token
    CLS = "cls"  # the first token's (BERT's [CLS])
    MAX = "max"  # the element-wise maximum over every token
    MEAN_SQRT_LEN = "mean_sqrt_len"  # the sum over every token divided by sqrt(tokens)


class PoolingParams(_Wire):
    """An embedding request (``EngineCoreRequest.pooling_params``), validated by the gateway.

    The engine runs its prompt only (prefill; no sampling, ``max_tokens`` irrelevant) and
    finishes it with STOP and ``EngineCoreOutput.pooled_output`` once every prompt token is
    computed. The worker pools, keeps the first ``dimensions`` values (Matryoshka), then
    L2-normalizes when ``normalize``.
    """

    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True
    dimensions: int | None = None  # None = every dimension of the hidden state
