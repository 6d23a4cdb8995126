"""An adapter name this gateway does not know, asked of the engines before it is NOT_FOUND.

Each gateway names the adapters of ``--lora-modules`` and those loaded through it
(``lora_admin.py``). With ``--api-servers`` > 1 an adapter loaded through another gateway is
held by the engines (they are shared) but unknown here: a request naming a name this gateway
does not know asks one live engine (``list_loras``, a UTILITY call) and learns every adapter
it holds, then is checked as usual, so it is NOT_FOUND only when the engines do not hold the
adapter either. The same goes for a gateway restarted after adapters were loaded.

A client naming unknown models cannot make this gateway flood the engines: one lookup at a time
(the requests that miss meanwhile wait for it and read its answer), and a name the engines did
not hold is not asked about again for ``MISS_TTL_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from switchboard.api.v1 import generation_service_pb2 as pb

if TYPE_CHECKING:
    from switchboard.gateway.state import GatewayState

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 10.0
MISS_TTL_S = 1.0


class AdapterLookup:
    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self._lookup: asyncio.Future[None] | None = None  # the lookup in flight
        self._missed: dict[str, float] = {}  # name -> when the engines did not hold it

    async def learn(self, request: pb.GenerateRequest) -> None:
        """Learn the adapter ``request`` names from the engines where this gateway does not
        know it; never raises (an unknown name is refused afterwards, as before)."""
        await self.learn_names(request.model, request.lora_adapter)

    async def learn_names(self, *wanted_names: str) -> None:
        """``learn`` for the names a call gives as its model (Tokenize, GetModelInfo)."""
        facts = self._state.facts
        names = facts.loras
        if not names.enabled:
            return
        wanted = {n for n in wanted_names if n and n != facts.name}
        unknown = {n for n in wanted if n not in names.adapters}
        now = time.monotonic()
        if not unknown or all(now - self._missed.get(n, -MISS_TTL_S) < MISS_TTL_S for n in unknown):
            return
        if self._lookup is None:
            self._lookup = asyncio.ensure_future(self._ask_an_engine())
            self._lookup.add_done_callback(self._lookup_done)
        await asyncio.shield(self._lookup)
        now = time.monotonic()
        for name in unknown - names.adapters.keys():
            self._missed[name] = now
        if len(self._missed) > 1024:  # a client's stream of made-up names: keep the fresh ones
            self._missed = {n: t for n, t in self._missed.items() if now - t < MISS_TTL_S}

    def _lookup_done(self, _: asyncio.Future[None]) -> None:
        self._lookup = None

    async def _ask_an_engine(self) -> None:
        engines = self._state.engines
        live = engines.live_engines
        if not live:
            return
        try:
            held = await engines.call_utility(live[0], "list_loras", [], LOOKUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the request is refused as before; logged
            logger.warning("LoRA adapters of engine %s not listed: %s", live[0].engine_id, exc)
            return
        names = self._state.facts.loras
        if not isinstance(held, dict):
            return
        learnt = {n: p for n, p in held.items() if isinstance(n, str) and n not in names.adapters}
        if learnt:
            names.adapters.update(learnt)
            logger.info("LoRA adapters loaded through another gateway: %s", sorted(learnt))
