"""The steps of ``prepare.py`` that need no gateway state: GenerateRequest -> GeneratePlan ->
EngineCoreRequest, or INVALID_ARGUMENT naming the field and the rule.

``plan_generate`` checks everything that does not need the prompt's tokens: the wire's rules on
single fields and the API's own (``api_field_rules.py``), structured output's
(``constraint_check.py``, whose grammar check runs in the thread pool later). Once the prompt
is tokenized, ``resolve_prompt`` truncates and checks it, and ``build_engine_request`` fits
max_tokens / min_tokens into the room it leaves. Knobs the engine cannot honour yet
(extra_args) are rejected, not silently ignored.
"""

from __future__ import annotations

import dataclasses
import time

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import invalid_argument, model_not_found, not_supported
from switchboard.gateway.chat.prompt import ChatPrompt, plan_chat
from switchboard.gateway.chat.template import ChatTemplate
from switchboard.gateway.model_facts import ModelFacts
from switchboard.gateway.pipeline.api_field_rules import (
    check_fields,
    check_ids,
    check_repetition_detection,
    check_sampling,
)
from switchboard.gateway.pipeline.constraint_check import plan_structured_output
from switchboard.gateway.pipeline.request_bounds import check_model_name
from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    RepetitionDetectionParams,
    SamplingParams,
    StructuredOutputParams,
)
from switchboard.wire.field_rules import MAX_REQUEST_ID_CHARS, PROMPT_IN_VOCABULARY
from switchboard.wire.lora import lora_request

_OUTPUT_KINDS = frozenset(pb.OutputKind.values())


@dataclasses.dataclass(frozen=True)
class GeneratePlan:
    """A validated request, waiting for its prompt's token ids."""

    request_id: str
    prompt_text: str | None  # exactly one of prompt_text / prompt_token_ids / chat is set
    prompt_token_ids: list[int] | None
    truncate_prompt_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_tokens: int | None  # None = the room max_model_len leaves after the prompt
    min_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    output_kind: int  # pb.OutputKind, UNSPECIFIED resolved to DELTA
    return_token_ids: bool
    detokenize: bool
    skip_special_tokens: bool
    priority: int
    cache_salt: str | None
    labels: dict[str, str]
    # The rest of the sampling surface (penalties, masks, n, logprobs, repetition detection);
    # defaults are the no-op values, so a request that leaves them unset samples as before.
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    allowed_token_ids: list[int] = dataclasses.field(default_factory=list)
    bad_words: list[str] = dataclasses.field(default_factory=list)  # tokenized at submit
    n: int = 1  # sequences (unset in the proto = 1)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    data_parallel_rank: int | None = None  # pinned engine core (DP > 1); None: engine_pool picks
    chat: ChatPrompt | None = None  # chat messages, rendered by the chat template at submit
    lora_name: str = ""  # the LoRA adapter it runs with ("" = the base model)
    # The output constraint; its grammar is checked in the thread pool at submit.
    structured_output: StructuredOutputParams | None = None

    @property
    def prompt_field(self) -> str:
        """The request field the prompt came from, for errors about it."""
        if self.chat is not None:
            return "messages"
        return "text" if self.prompt_text is not None else "token_ids.ids"


def check_model(model: str, facts: ModelFacts) -> None:
    """The request names the served model (or none). Its size and characters first: the
    NOT_FOUND error echoes the name, and a long one would overflow the client's trailer limit
    (8 KiB in grpc: the call would end RESOURCE_EXHAUSTED)."""
    check_model_name(model)
    if model and model != facts.name:
        raise model_not_found(model, facts.name)


def check_model_or_adapter(model: str, facts: ModelFacts) -> str:
    """``check_model`` for the calls an adapter answers as its base model does (it shares the
    base model's tokenizer): the adapter ``model`` names, or "" for the base model."""
    check_model_name(model)
    if not model or model == facts.name:
        return ""
    if model not in facts.loras.adapters:
        raise model_not_found(model, facts.loras.served(facts.name))
    return model


def _check_stopping(st: pb.StoppingCriteria) -> None:
    if st.HasField("max_tokens") and st.min_tokens > st.max_tokens:
        raise invalid_argument(
            "stopping.min_tokens",
            f"stopping.min_tokens ({st.min_tokens}) must be <= stopping.max_tokens "
            f"({st.max_tokens})",
        )
    for i, stop in enumerate(st.stop):
        if not stop:
            raise invalid_argument(f"stopping.stop[{i}]", f"stopping.stop[{i}] must not be empty")


def _check_output(o: pb.OutputOptions) -> None:
    if o.kind not in _OUTPUT_KINDS:
        raise invalid_argument("output.kind", f"output.kind: unknown OutputKind value {o.kind}")


def _check_prompt(request: pb.GenerateRequest, is_chat: bool) -> None:
    which = request.WhichOneof("prompt")
    if which is None and not is_chat:
        raise invalid_argument("prompt", "prompt: set either text or token_ids (or messages)")
    if which == "text" and not request.text:
        raise invalid_argument("text", "text: the prompt must not be empty")
    if which == "token_ids" and not request.token_ids.ids:
        raise invalid_argument("token_ids.ids", "token_ids.ids: the prompt must not be empty")
    if request.HasField("truncate_prompt_tokens") and request.truncate_prompt_tokens < 1:
        raise invalid_argument(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be >= 1, got {request.truncate_prompt_tokens}",
        )


def plan_generate(
    request: pb.GenerateRequest,
    request_id: str,
    facts: ModelFacts,
    chat_template: ChatTemplate | None = None,
) -> GeneratePlan:
    """Check everything that does not need the prompt's tokens; raise ApiError on a violation.
    ``chat_template``: the model's, for requests that send chat messages."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid_argument(
            "request_id", f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters"
        )
    check_model_name(request.model)
    check_model_name(request.lora_adapter)
    lora_name = facts.loras.choose(request.model, request.lora_adapter, facts.name)
    chat = plan_chat(request, chat_template, facts.name)
    _check_prompt(request, chat is not None)
    check_fields(request, facts.vocab_size)
    check_sampling(request.sampling)
    _check_stopping(request.stopping)
    _check_output(request.output)
    structured_output = plan_structured_output(request.structured_output)
    if request.HasField("extra_args") and request.extra_args.fields:
        raise not_supported("extra_args", "engine passthrough arguments")
    s, st, o = request.sampling, request.stopping, request.output
    detokenize = o.detokenize if o.HasField("detokenize") else True
    if st.stop and not detokenize:
        raise invalid_argument(
            "stopping.stop", "stopping.stop needs detokenized text: unset output.detokenize=false"
        )
    default = facts.sampling_defaults.get
    repetition_detection = (
        check_repetition_detection(st.repetition_detection)
        if st.HasField("repetition_detection")
        else None
    )
    return GeneratePlan(
        request_id=request_id,
        prompt_text=request.text if request.WhichOneof("prompt") == "text" else None,
        prompt_token_ids=list(request.token_ids.ids) if request.HasField("token_ids") else None,
        truncate_prompt_tokens=(
            request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
        ),
        temperature=s.temperature if s.HasField("temperature") else default("temperature", 1.0),
        top_p=s.top_p if s.HasField("top_p") else default("top_p", 1.0),
        top_k=s.top_k if s.HasField("top_k") else int(default("top_k", 0)),
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=st.max_tokens if st.HasField("max_tokens") else None,
        min_tokens=st.min_tokens,
        stop=list(st.stop),
        stop_token_ids=list(st.stop_token_ids),
        include_stop_str_in_output=st.include_stop_str_in_output,
        ignore_eos=st.ignore_eos,
        output_kind=o.kind or pb.OUTPUT_KIND_DELTA,
        return_token_ids=o.return_token_ids,
        detokenize=detokenize,
        skip_special_tokens=o.skip_special_tokens if o.HasField("skip_special_tokens") else True,
        priority=request.priority,
        cache_salt=request.cache_salt or None,
        labels=dict(request.labels),
        min_p=s.min_p if s.HasField("min_p") else float(default("min_p", 0.0)),
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=(
            s.repetition_penalty
            if s.HasField("repetition_penalty")
            else float(default("repetition_penalty", 1.0))
        ),
        logit_bias=dict(s.logit_bias),
        allowed_token_ids=list(s.allowed_token_ids),
        bad_words=list(s.bad_words),
        n=s.n if s.HasField("n") else 1,
        logprobs=o.logprobs if o.HasField("logprobs") else None,
        prompt_logprobs=o.prompt_logprobs if o.HasField("prompt_logprobs") else None,
        repetition_detection=repetition_detection,
        data_parallel_rank=(
            request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        ),
        chat=chat,
        structured_output=structured_output,
        lora_name=lora_name,
    )


def resolve_prompt(plan: GeneratePlan, token_ids: list[int], facts: ModelFacts) -> list[int]:
    """Truncate and check the tokenized prompt; return the ids the engine gets."""
    if plan.truncate_prompt_tokens is not None:
        token_ids = token_ids[-plan.truncate_prompt_tokens :]
    field = plan.prompt_field
    if not token_ids:
        raise invalid_argument(field, f"{field}: the prompt has no tokens after tokenization")
    if plan.prompt_token_ids is not None:
        check_ids(PROMPT_IN_VOCABULARY, "token_ids.ids", token_ids, facts.vocab_size)
    if len(token_ids) >= facts.max_model_len:
        raise invalid_argument(
            field,
            f"{field}: the prompt has {len(token_ids)} tokens but max_model_len is "
            f"{facts.max_model_len}, which leaves no room for output",
            reason="PROMPT_TOO_LONG",
        )
    return token_ids


def build_engine_request(
    plan: GeneratePlan,
    prompt_token_ids: list[int],
    facts: ModelFacts,
    *,
    client_index: int = 0,
    arrival_time: float | None = None,
    trace_context: dict[str, str] | None = None,
    bad_words_token_ids: list[list[int]] | None = None,
) -> EngineCoreRequest:
    """The wire-1 request for a checked prompt (see ``resolve_prompt``); ``bad_words_token_ids``
    are the plan's bad words, tokenized (``bad_words.tokenize_bad_words``)."""
    room = facts.max_model_len - len(prompt_token_ids)
    # Unset: as much as the room allows, capped by generation_config.json's max_new_tokens.
    default_max_tokens = min(room, int(facts.sampling_defaults.get("max_tokens", room)))
    max_tokens = plan.max_tokens if plan.max_tokens is not None else default_max_tokens
    if max_tokens > room:
        raise invalid_argument(
            "stopping.max_tokens",
            f"stopping.max_tokens: the prompt ({len(prompt_token_ids)} tokens) + max_tokens "
            f"({max_tokens}) exceeds max_model_len ({facts.max_model_len})",
        )
    if plan.min_tokens > max_tokens:
        raise invalid_argument(
            "stopping.min_tokens",
            f"stopping.min_tokens ({plan.min_tokens}) exceeds the {max_tokens} tokens "
            "max_model_len leaves after the prompt",
        )
    sampling = SamplingParams(
        temperature=float(plan.temperature),
        top_p=float(plan.top_p),
        top_k=int(plan.top_k),
        seed=plan.seed,
        max_tokens=max_tokens,
        min_tokens=plan.min_tokens,
        stop_token_ids=plan.stop_token_ids,
        eos_token_ids=list(facts.eos_token_ids),
        ignore_eos=plan.ignore_eos,
        min_p=float(plan.min_p),
        presence_penalty=float(plan.presence_penalty),
        frequency_penalty=float(plan.frequency_penalty),
        repetition_penalty=float(plan.repetition_penalty),
        logit_bias=dict(plan.logit_bias) or None,
        allowed_token_ids=list(plan.allowed_token_ids) or None,
        bad_words_token_ids=bad_words_token_ids or None,
        logprobs=plan.logprobs,
        prompt_logprobs=plan.prompt_logprobs,
        repetition_detection=plan.repetition_detection,
        structured_output=plan.structured_output,
    )
    return EngineCoreRequest(
        request_id=plan.request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling,
        arrival_time=arrival_time if arrival_time is not None else time.time(),
        cache_salt=plan.cache_salt,
        client_index=client_index,
        priority=plan.priority,
        trace_context=trace_context,
        data_parallel_rank=plan.data_parallel_rank,
        lora_request=lora_request(plan.lora_name),
    )
