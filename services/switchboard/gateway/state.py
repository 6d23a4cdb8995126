"""What the servicers of one gateway share: config, tokenizer, model facts, engines, a pool."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from switchboard.config import GatewayRoleConfig
from switchboard.gateway.chat.template import ChatTemplate
from switchboard.gateway.engines.client import EngineClient
from switchboard.gateway.model_facts import ModelFacts
from switchboard.gateway.observability.observer import Observability
from switchboard.gateway.text import Tokenizer

T = TypeVar("T")


@dataclasses.dataclass
class GatewayState:
    config: GatewayRoleConfig
    tokenizer: Tokenizer
    checkpoint_facts: ModelFacts  # from the checkpoint directory alone
    engines: EngineClient
    executor: ThreadPoolExecutor  # tokenization runs here, never on the event loop
    observability: Observability  # traces, metrics, the stats log line
    chat_template: ChatTemplate | None = None  # loaded once at start; None: messages refused
    facts: ModelFacts = dataclasses.field(init=False)  # checkpoint facts + the engine's READY

    def __post_init__(self) -> None:
        self.refresh_facts()

    def refresh_facts(self) -> None:
        """Called when engines come and go: the lowest-ranked live engine's READY wins."""
        live = sorted(self.engines.live_engines, key=lambda e: e.ready.data_parallel_rank)
        facts = self.checkpoint_facts
        self.facts = facts.with_engine(live[0].ready) if live else facts

    async def in_pool(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))
