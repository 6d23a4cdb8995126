"""Request intake of the engine core: check and prepare an ADD, admit it, or end it with ERROR.

An ADD is checked and prepared on the input thread (``prepare_add``), so that the work overlaps
with the forward pass; the busy loop then admits it to the scheduler (``add_request``). A
constrained request waits outside the scheduler while its grammar compiles (``core.compiling``)
and is admitted, in arrival order, when the compile pool says GRAMMAR_READY. Aborts reach both
places. A request that fails any of this ends alone, with ERROR (``reject``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from switchboard.common.log_limits import WarningLimit
from switchboard.engine import clock
from switchboard.engine.request import Request
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from switchboard.wire.request_rules import check_engine_request

if TYPE_CHECKING:
    from switchboard.engine.core import EngineCore

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)  # a client can have its requests refused on purpose

GRAMMAR_READY = "grammar-ready"  # input-queue kind: a structured-output grammar finished compiling
GATEWAY_LOST = "gateway-lost"  # input-queue kind: a gateway went away; payload its client_index


def prepare_add(core: EngineCore, request: EngineCoreRequest) -> Request | None:
    """Input thread: build the scheduler's request (and hash its prompt blocks) here, so the
    work overlaps with the forward pass. A bad request fails alone, with ERROR: the wire's
    rules are checked here, whoever sent it, before the scheduler or a worker sees any of it
    (``wire/request_rules.py``)."""
    try:
        check_engine_request(request, core.ready.vocab_size, core.max_model_len)
        if core.embed_only and request.pooling_params is None:
            raise ValueError("the model is an encoder: it embeds and cannot generate")
        prepared = Request.from_engine_core_request(
            request,
            core.block_size,
            clock.monotonic_ns(),
            hash_blocks=core.config.cache.enable_prefix_caching,
        )
        params = request.sampling_params
        if params is not None and params.structured_output is not None:
            assert core.structured_output is not None
            prepared.grammar = core.structured_output.start(  # compiles in the pool
                params.structured_output,
                params.eos_token_ids,
                # Compile pool: wake the busy loop (it may be blocked on an empty input queue).
                lambda: core.input_queue.put((GRAMMAR_READY, None)),
                replay=request.output_token_ids or (),  # a resumed stream's tokens
            )
        return prepared
    except Exception as exc:
        reject(core, request.request_id, request.client_index, exc)
        return None


def reject(
    core: EngineCore,
    request_id: str,
    client_index: int,
    error: Exception,
    lora_not_loaded: str = "",
) -> None:
    """End one request with ERROR (called from the input thread or the busy loop);
    ``lora_not_loaded``: the adapter it names that this engine does not hold (the gateway
    answers NOT_FOUND naming it)."""
    limited.warning("rejected request", "Rejected request %.300r: %s", request_id, error)
    failed = EngineCoreOutput(
        request_id,
        finish_reason=FinishReason.ERROR,
        stop_reason=str(error)[:1000],
        lora_not_loaded=lora_not_loaded,
    )
    outputs = EngineCoreOutputs(core.engine_index, clock.monotonic_ns(), [failed])
    core.output_queue.put((client_index, outputs))


def add_request(core: EngineCore, request: Request) -> None:
    """Busy loop: admit a prepared request to the scheduler, or hold it while its grammar
    compiles."""
    lora_refusal = core.loras.refusal(request)  # here, in order with remove_lora
    if lora_refusal is not None:
        reject(
            core,
            request.request_id,
            request.client_index,
            LookupError(lora_refusal),
            lora_not_loaded=request.lora_name,
        )
        return
    grammar = request.grammar
    if grammar is not None:
        if request.request_id in core.compiling:
            reject(
                core,
                request.request_id,
                request.client_index,
                ValueError(f"request {request.request_id!r} is already in the engine"),
            )
            return
        if not grammar.ready:
            core.compiling[request.request_id] = request  # GRAMMAR_READY admits it
            return
        error = grammar.resolve()
        if error is not None:  # e.g. a bad spec that came in on the wire
            reject(core, request.request_id, request.client_index, ValueError(error))
            return
    try:
        core.scheduler.add_request(request)
    except ValueError as exc:  # e.g. a request id already in flight: fail it alone
        reject(core, request.request_id, request.client_index, exc)


def admit_compiled(core: EngineCore) -> None:
    """Move the requests whose grammar is ready to the scheduler, in arrival order."""
    ready = [r for r in core.compiling.values() if r.grammar.ready]
    for request in ready:
        del core.compiling[request.request_id]
        add_request(core, request)


def abort(core: EngineCore, request_ids: list[str] | str) -> None:
    if core.compiling:
        for rid in (request_ids,) if isinstance(request_ids, str) else request_ids:
            core.compiling.pop(rid, None)
    core.scheduler.finish_requests(request_ids, FinishReason.ABORT)


def abort_requests_of(core: EngineCore, client_index: int) -> None:
    """A gateway went away: its requests' outputs have no reader, so they end now (their KV
    blocks are freed) rather than running to their last token."""
    requests = [*core.scheduler.requests.values(), *core.compiling.values()]
    ids = [r.request_id for r in requests if r.client_index == client_index]
    if ids:
        logger.warning("Gateway %d went away: aborted its %d request(s)", client_index, len(ids))
        abort(core, ids)
