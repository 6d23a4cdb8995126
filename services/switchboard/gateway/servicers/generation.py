"""GenerationService: Generate, Abort, Tokenize, Detokenize; Embed (in ``embedding.py``)."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.gateway.admission import Ticket
from switchboard.gateway.chat.prompt import chat_prompt_token_ids
from switchboard.gateway.errors import ApiError, invalid_argument, maps_api_errors, unavailable
from switchboard.gateway.observability.observer import RequestObserver
from switchboard.gateway.pipeline.bad_words import tokenize_bad_words
from switchboard.gateway.pipeline.generate_stream import GenerateStream
from switchboard.gateway.pipeline.request_bounds import (
    check_data_parallel_rank,
    check_labels,
    check_model_name,
    check_request_id,
    check_text_bytes,
    prompt_bytes,
)
from switchboard.gateway.pipeline.sequence_group import (
    SequenceGroup,
    child_requests,
    submit_children,
)
from switchboard.gateway.pipeline.validation import (
    GeneratePlan,
    build_engine_request,
    check_model,
    plan_generate,
    resolve_prompt,
)
from switchboard.gateway.servicers.embedding import Embedder
from switchboard.gateway.state import GatewayState

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_TRACE_HEADERS = ("traceparent", "tracestate")


@dataclasses.dataclass
class _LiveRequest:
    aborted: bool = False  # by the Abort RPC, possibly before the engine got it
    engine_request_ids: list[str] = dataclasses.field(default_factory=list)  # its n sequences


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self._live: dict[str, _LiveRequest] = {}
        self._embedder = Embedder(state)

    @maps_api_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival_time = time.time()
        state = self._state
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        # Before anything is echoed (the x-request-id header, errors naming the model) or
        # spent: the fields' sizes and characters, then this gateway's room for one more.
        check_request_id(request_id)
        check_model_name(request.model)
        check_labels(request.labels)
        ticket = state.admission.enter()
        # Begun before the first await: a call cancelled at any point is observed (an abort).
        observer = state.observability.begin(request_id, arrival_time, context)
        live: _LiveRequest | None = None
        group: SequenceGroup | None = None
        finished = False
        try:
            await context.send_initial_metadata(((REQUEST_ID_HEADER, request_id),))
            if request_id in self._live:
                raise ApiError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {request_id!r} is already in flight",
                    reason="DUPLICATE_REQUEST_ID",
                    field="request_id",
                )
            live = self._live[request_id] = _LiveRequest()
            if not state.facts.tasks.can_generate:
                raise ApiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"model {state.facts.name!r} is an encoder: it serves Embed only",
                    reason="TASK_NOT_SUPPORTED",
                )
            self._check_bounds(request)
            plan = plan_generate(request, request_id, state.facts, state.chat_template)
            group = await self._submit(
                plan, arrival_time, context, observer=observer, ticket=ticket
            )
            observer.submitted(group.engine)
            live.engine_request_ids = group.request_ids
            if live.aborted:  # the Abort RPC came while the prompt was being tokenized
                state.engines.abort(group.request_ids, "Abort RPC")
            while not group.finished:
                index, event = await group.next_event()
                ticket.prompt_started()  # the engine answered: the prompt left the queue
                observer.on_event(event)
                response = group.handle(index, event)
                stopped = group.take_stopped_request_ids()
                if stopped:
                    state.engines.abort(stopped, "stop string")
                if response is not None:
                    yield response
            finished = True
            logger.debug("request %s finished: %s", request_id, group.usage())
        except ApiError:
            finished = True  # the engine client already forgot a failed request
            if group is not None:  # ... but not its sibling sequences (n > 1)
                state.engines.abort(group.request_ids, "a sibling sequence failed")
            raise  # maps_api_errors ends the RPC with it
        finally:
            observer.end(group)
            ticket.release()
            if live is not None:
                del self._live[request_id]
            if group is not None:
                group.close()
            if group is not None and not finished:
                # Cancelled, disconnected or past its deadline: free the engine's slot now.
                state.engines.abort(group.request_ids, "client cancelled or deadline")
                logger.info("request %s: client went away; sent ABORT", request_id)

    def _check_bounds(self, request: pb.GenerateRequest) -> None:
        """What bounds the work before any of it: the prompt's bytes, the pinned rank."""
        state = self._state
        if state.longest_token_bytes:
            check_text_bytes(
                "messages" if request.messages else "text",
                prompt_bytes(request),
                state.max_prompt_bytes,
            )
        if request.HasField("data_parallel_rank"):
            check_data_parallel_rank(
                request.data_parallel_rank, state.config.num_engines, state.engines.engines
            )

    async def _submit(
        self,
        plan: GeneratePlan,
        arrival_time: float,
        context: grpc.aio.ServicerContext,
        *,
        observer: RequestObserver,
        ticket: Ticket | None = None,
    ) -> SequenceGroup:
        """Tokenize and check; ADD the request's n sequences to the engines."""
        state = self._state
        if not state.engines.live_engines:
            raise unavailable("no engine core is ready")
        if plan.chat is not None and state.chat_template is not None:
            token_ids = await state.in_pool(
                chat_prompt_token_ids, state.chat_template, state.tokenizer, plan.chat
            )
        elif plan.prompt_text is not None:
            token_ids = await state.in_pool(state.tokenizer.encode, plan.prompt_text)
        else:
            token_ids = plan.prompt_token_ids or []
        facts = state.facts
        prompt_token_ids = resolve_prompt(plan, token_ids, facts)
        if ticket is not None:  # admission: the prompt waits for prefill from now on
            ticket.queue_prompt(len(prompt_token_ids) * plan.n)
        bad_words_token_ids = None
        if plan.bad_words:
            bad_words_token_ids = await state.in_pool(
                tokenize_bad_words, state.tokenizer, plan.bad_words, facts.vocab_size
            )
        metadata = dict(context.invocation_metadata() or ())
        trace_context = {k: metadata[k] for k in _TRACE_HEADERS if k in metadata} or None
        engine_request = build_engine_request(
            plan,
            prompt_token_ids,
            facts,
            client_index=state.config.client_index,
            arrival_time=arrival_time,
            trace_context=trace_context,
            bad_words_token_ids=bad_words_token_ids,
        )
        observer.submitting(plan, engine_request)  # with tracing: the engine's trace context
        channels = submit_children(
            state.engines.add_request,
            state.engines.abort,
            child_requests(engine_request, plan.n),
        )
        streams = [
            GenerateStream(plan, prompt_token_ids, state.tokenizer, index)
            for index in range(len(channels))
        ]
        return SequenceGroup(streams, channels, observer.timeline)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        response = pb.AbortResponse()
        for request_id in request.request_ids:
            live = self._live.get(request_id)
            if live is None:
                response.unknown_request_ids.append(request_id)
                continue
            live.aborted = True
            engine_request_ids = live.engine_request_ids or [request_id]
            self._state.engines.abort(engine_request_ids, request.reason or "Abort RPC")
            response.aborted_request_ids.append(request_id)
        if response.aborted_request_ids:
            logger.info(
                "Abort RPC (%s): aborted %s",
                request.reason or "no reason given",
                list(response.aborted_request_ids),
            )
        return response

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        return await self._embedder.embed(request, context)

    @maps_api_errors
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        state = self._state
        check_model_name(request.model)
        check_model(request.model, state.facts)
        if state.longest_token_bytes:
            check_text_bytes("text", len(request.text.encode()), state.max_prompt_bytes)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = await state.in_pool(state.tokenizer.encode, request.text, add_special)
        response = pb.TokenizeResponse(token_ids=token_ids, max_model_len=state.facts.max_model_len)
        if request.return_token_strs:
            response.token_strs.extend(state.tokenizer.token_strs(token_ids))
        return response

    @maps_api_errors
    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        state = self._state
        check_model_name(request.model)
        check_model(request.model, state.facts)
        vocab_size = state.tokenizer.vocab_size
        for i, token_id in enumerate(request.token_ids):
            if token_id >= vocab_size:
                raise invalid_argument(
                    f"token_ids[{i}]",
                    f"token_ids[{i}] = {token_id} is out of range: the tokenizer has "
                    f"{vocab_size} tokens",
                )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await state.in_pool(state.tokenizer.decode, list(request.token_ids), skip)
        return pb.DetokenizeResponse(text=text)
