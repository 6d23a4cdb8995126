"""Streams that resume: a request cut off by its engine's death is sent again, to a live or the
restarted engine, as the same request continued.

The resumed request is the original (same id, prompt and sampling parameters) with the output
tokens already streamed in ``EngineCoreRequest.output_token_ids``: the engine continues after
them as it does after a preemption, so they count as output for ``max_tokens``, ``min_tokens``,
penalties, bad words, repetition detection and a seed's draw position (``worker/sampler.py``
draws output token ``i`` from (seed, i)). Greedy and seeded requests give exactly the tokens
an undisturbed run gives. The outputs keep coming on the same channel, so the client sees one
unbroken stream.

A structured-output request resumes too: the engine that takes it replays the delivered tokens
through a fresh matcher of its grammar before it samples (``engine/constrained_decoding.py``), so
its output continues exactly as the cut-off engine's would have, and stays valid.

Not resumable (``resume_plan`` says why) once tokens were delivered: a request with prompt
embeddings (they are not kept) and a pooling request. A request
that is not resumed, or that no engine takes within ``resume_timeout_s`` (``Failover``), fails
with UNAVAILABLE saying how many tokens it had delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from switchboard.gateway.api_errors import ApiError, unavailable
from switchboard.gateway.engines.membership import EngineMembership
from switchboard.gateway.engines.routing import RequestRouter
from switchboard.gateway.engines.types import (
    EngineHandle,
    RequestChannel,
    RequestFailed,
    SendRequest,
)
from switchboard.wire.engine_msgs import EngineCoreRequest, RequestType

logger = logging.getLogger(__name__)


def resume_plan(
    request: EngineCoreRequest | None, delivered: list[int]
) -> tuple[EngineCoreRequest | None, str]:
    """(the request to send again, "") or (None, why it cannot be resumed)."""
    if request is None:
        return None, "the request is unknown"
    if not delivered:
        return request, ""  # nothing streamed yet: the same request again
    params = request.sampling_params
    if params is None:
        return None, "a pooling request"
    if request.prompt_embeds is not None:
        return None, "prompt embeddings are not kept"
    if len(delivered) >= params.max_tokens:
        return None, "it had no tokens left to generate"
    return msgspec.structs.replace(request, output_token_ids=list(delivered)), ""


class Failover:
    """What happens to the requests of an engine that died: each is resumed elsewhere or fails."""

    def __init__(
        self,
        membership: EngineMembership,
        router: RequestRouter,
        send: SendRequest,
        resume_timeout_s: float,
    ) -> None:
        self._membership = membership
        self._router = router
        self._send = send
        self.resume_timeout_s = resume_timeout_s
        # (the engine it was cut off on, the engine that took it)
        self.on_resumed: Callable[[EngineHandle, EngineHandle], None] = lambda _dead, _new: None
        self.resuming: set[asyncio.Task] = set()  # requests waiting for an engine to take them

    def engine_died(self, engine: EngineHandle, why: str) -> None:
        failed = self._router.channels_on(engine)
        logger.error(
            "engine %s (DP rank %d) is dead: %s; failing its %d in-flight request(s)",
            engine.engine_id,
            engine.ready.data_parallel_rank,
            why,
            len(failed),
        )
        for channel in failed:
            self.fail_over(channel, f"engine {engine.engine_id} died: {why}")

    def fail_over(self, channel: RequestChannel, why: str) -> None:
        """The engine of ``channel`` died: resume the request elsewhere, or fail it."""
        resumed, not_resumable = resume_plan(channel.request, channel.delivered)
        if self.resume_timeout_s <= 0:
            not_resumable = "resume is off (--no-resume)"
        if resumed is None or not_resumable:
            self._fail(channel, f"{why}; not resumed: {not_resumable}")
            return
        self._router.uncount(channel)  # it waits on no engine
        task = asyncio.get_running_loop().create_task(self._resume(channel, resumed, why))
        self.resuming.add(task)
        task.add_done_callback(self.resuming.discard)

    def _fail(self, channel: RequestChannel, why: str) -> None:
        self._router.forget(channel.request_id)
        delivered = len(channel.delivered)
        channel.put(RequestFailed(unavailable(f"{why} ({delivered} tokens were delivered)")))

    async def _resume(self, channel: RequestChannel, request: EngineCoreRequest, why: str) -> None:
        """Send ``request`` (the cut-off one, continued) to the first engine that takes it
        within ``resume_timeout_s``; fail the stream if none does."""
        deadline = time.monotonic() + self.resume_timeout_s
        while self._router.channel(channel.request_id) is channel:  # not aborted meanwhile
            try:
                engine = self._membership.choose(request.data_parallel_rank, request)
            except ApiError:
                if time.monotonic() >= deadline:
                    self._fail(
                        channel,
                        f"{why}; not resumed: no engine core was ready within "
                        f"{self.resume_timeout_s:g}s",
                    )
                    return
                await asyncio.sleep(0.05)
                continue
            cut_off_on = channel.engine
            self._router.count_on(channel, engine)
            channel.resumes += 1
            logger.warning(
                "request %s resumed on engine %s (DP rank %d) after %d tokens (%s)",
                channel.request_id,
                engine.engine_id,
                engine.ready.data_parallel_rank,
                len(channel.delivered),
                why,
            )
            self.on_resumed(cut_off_on, engine)
            self._send(engine, RequestType.ADD, request)  # a failed send fails it over again
            return
