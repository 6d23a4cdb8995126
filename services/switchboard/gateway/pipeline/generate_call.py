"""One Generate call from request to last response, the same for every front (gRPC, HTTP).

Both fronts turn their request into a ``pb.GenerateRequest`` and run it here, so validation,
tokenization, the engine client, ``n`` > 1 grouping, metrics and spans are one code path::

    async with calls.open(request, request_id, arrival_time, context) as call:  # check + ADD
        async for response in call.responses():
            ...

``open`` checks the request in one pass (``prepare.py``) and raises ``ApiError`` before anything
reaches an engine when it is invalid.
However the block is left (normally, an ``ApiError``, the client cancelling or disconnecting,
the front's own error), the call is reported to the observer, and unless it ran to its end its
sequences are ABORTed in the engine at once. ``GenerateCalls`` also remembers the calls in
flight by request id, so the Abort RPC reaches a call whichever front took it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.admission import Ticket
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.auth import Credentials
from switchboard.gateway.engines.types import RequestEvent
from switchboard.gateway.lora_names import AdapterNotLoaded
from switchboard.gateway.observability.observer import RequestObserver
from switchboard.gateway.pipeline.generate_stream import GenerateStream
from switchboard.gateway.pipeline.message_pacing import MessagePacing
from switchboard.gateway.pipeline.prepare import PreparedGenerate, prepare_generate
from switchboard.gateway.pipeline.sequence_group import (
    SequenceGroup,
    child_requests,
    submit_children,
)
from switchboard.gateway.state import GatewayState

logger = logging.getLogger(__name__)

_TRACE_HEADERS = ("traceparent", "tracestate")


class CallContext(Protocol):
    """What the call reads of its front: a ``grpc.aio.ServicerContext`` has all of it; the
    HTTP front supplies the same from the HTTP request (``gateway/http/context.py``)."""

    def invocation_metadata(self) -> Iterable[tuple[str, Any]] | None: ...

    def peer(self) -> str: ...

    def code(self) -> grpc.StatusCode | None: ...

    def time_remaining(self) -> float | None: ...


@dataclasses.dataclass
class _LiveRequest:
    owner: str | None = None  # the identity of its API key (auth.identity_of); None: keys off
    aborted: bool = False  # by the Abort RPC, possibly before the engine got it
    engine_request_ids: list[str] = dataclasses.field(default_factory=list)  # its n sequences


class GenerateCall:
    """A submitted call: its sequence group and the responses it makes."""

    def __init__(
        self,
        group: SequenceGroup,
        observer: RequestObserver,
        ticket: Ticket,
        pacing: MessagePacing | None = None,
    ) -> None:
        self.group = group
        self._observer = observer
        self._ticket = ticket
        self._pacing = pacing
        self.finished = False  # ran to its end: nothing left to abort

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        group = self.group
        single = len(group.streams) == 1
        sent_at: float | None = None  # the event loop's time of the last message
        while not group.finished:
            index, event = await group.next_event()
            self._ticket.prompt_started()  # the engine answered: the prompt left the queue
            if sent_at is not None and self._pacing is not None:
                await self._pacing.wait(group, event, sent_at)
            # Steps that came while the last message was being sent go out with this one: held
            # in the stream, then one message for them all (for n > 1, one event at a time).
            response = self._handle(index, event, hold=single)
            failure: ApiError | None = None
            try:
                while response is None and (ready := group.ready_event()) is not None:
                    response = self._handle(*ready, hold=True)
            except ApiError as error:
                failure = error  # what came before it still goes out first
            if response is None and single:
                response = group.streams[0].flush()
            if response is not None:
                yield response
                sent_at = asyncio.get_running_loop().time()
            if failure is not None:
                raise failure
        self.finished = True
        logger.debug("request %s finished: %s", group.streams[0].plan.request_id, group.usage())

    def _handle(
        self, index: int, event: RequestEvent, hold: bool = False
    ) -> pb.GenerateResponse | None:
        self._observer.on_event(event)
        return self.group.handle(index, event, hold)


class GenerateCalls:
    """The Generate calls in flight on one gateway, whichever front took them."""

    def __init__(self, state: GatewayState, credentials: Credentials | None = None) -> None:
        self.state = state
        self._credentials = credentials or Credentials()
        self._live: dict[str, _LiveRequest] = {}
        budget = state.config.gateway.stream_messages_per_s
        self._pacing = MessagePacing(budget, lambda: len(self._live)) if budget > 0 else None

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._live

    @property
    def in_flight_count(self) -> int:
        return len(self._live)

    @contextlib.asynccontextmanager
    async def open(
        self,
        request: pb.GenerateRequest,
        request_id: str,
        arrival_time: float,
        context: CallContext,
    ) -> AsyncIterator[GenerateCall]:
        """Check the request (``prepare.py``) and ADD it; yield the call (see the module
        docstring)."""
        if request_id in self._live:
            raise ApiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id!r} is already in flight",
                reason="DUPLICATE_REQUEST_ID",
                field="request_id",
            )
        state = self.state
        ticket = state.admission.enter()  # this gateway's room for one more, or RESOURCE_EXHAUSTED
        owner = self._credentials.identity(context.invocation_metadata())
        live = self._live[request_id] = _LiveRequest(owner=owner)
        group: SequenceGroup | None = None
        call: GenerateCall | None = None
        failed = False
        observer = state.observability.begin(request_id, arrival_time, context)
        try:
            prepared = await prepare_generate(
                request,
                request_id,
                state,
                arrival_time=arrival_time,
                trace_context=_trace_context(context),
            )
            group = await self._submit(prepared, context, observer=observer, ticket=ticket)
            observer.submitted({c.request_id: c.engine for c in group.channels})
            live.engine_request_ids = group.request_ids
            if live.aborted:  # the Abort RPC came while the prompt was being tokenized
                state.engines.abort(group.request_ids, "Abort RPC")
            call = GenerateCall(group, observer, ticket, self._pacing)
            yield call
        except ApiError as error:
            failed = True  # the engine client already forgot a failed request
            if isinstance(error, AdapterNotLoaded):  # the next request asks the engines again
                state.facts.loras.forget(error.name)
            if group is not None:  # ... but not its sibling sequences (n > 1)
                state.engines.abort(group.request_ids, "a sibling sequence failed")
            raise
        finally:
            observer.end(group)
            ticket.release()
            del self._live[request_id]
            if group is not None:
                group.close()
            if group is not None and not failed and not (call is not None and call.finished):
                # Cancelled, disconnected or past its deadline: free the engine's slot now.
                state.engines.abort(group.request_ids, "client cancelled or deadline")
                logger.info("request %s: client went away; sent ABORT", request_id)

    def abort(
        self, request_ids: Iterable[str], reason: str, context: CallContext | None = None
    ) -> tuple[list[str], list[str]]:
        """The Abort RPC: (aborted, unknown) request ids. With API keys a call reaches only
        the requests made with its own key; another key's are unknown to it."""
        owner = (
            None if context is None else self._credentials.identity(context.invocation_metadata())
        )
        aborted, unknown = [], []
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None or live.owner != owner:
                unknown.append(request_id)
                continue
            live.aborted = True
            self.state.engines.abort(live.engine_request_ids or [request_id], reason)
            aborted.append(request_id)
        return aborted, unknown

    async def _submit(
        self,
        prepared: PreparedGenerate,
        context: CallContext,
        *,
        observer: RequestObserver,
        ticket: Ticket,
    ) -> SequenceGroup:
        """ADD the checked request's n sequences to the engines."""
        state = self.state
        plan, prompt_token_ids = prepared.plan, prepared.prompt_token_ids
        ticket.queue_prompt(len(prompt_token_ids) * plan.n)  # admission: waits for prefill now
        # an engine that died is being restarted: wait for it (bounded by the call's deadline)
        await state.engines.wait_until_routable(context.time_remaining())
        observer.submitting(plan, prepared.engine_request)  # tracing: the engine's context
        channels = submit_children(
            state.engines.add_request,
            state.engines.abort,
            child_requests(prepared.engine_request, plan.n),
        )
        streams = [
            GenerateStream(
                plan,
                prompt_token_ids,
                state.tokenizer,
                index,
                state.config.gateway.stream_interval,
                abort_engine=functools.partial(
                    state.engines.abort, [channel.request_id], "stop string"
                ),
            )
            for index, channel in enumerate(channels)
        ]
        return SequenceGroup(streams, channels, observer.timeline)


def _trace_context(context: CallContext) -> dict[str, str] | None:
    """The caller's W3C trace headers, for the engine's spans."""
    metadata = dict(context.invocation_metadata() or ())
    return {k: metadata[k] for k in _TRACE_HEADERS if k in metadata} or None
