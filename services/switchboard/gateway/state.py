"""What the servicers of one gateway share: config, tokenizer, model facts, engines, a pool."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from switchboard.config import GatewayRoleConfig
from switchboard.gateway.admission import Admission
from switchboard.gateway.chat.template import ChatTemplate
from switchboard.gateway.engines.engine_client import EngineClient
from switchboard.gateway.lora_lookup import AdapterLookup
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
    # The most text bytes one token stands for (request_bounds.longest_token_bytes), once at
    # start: the prompt byte limit is max_model_len x this. 0: no limit.
    longest_token_bytes: int = 0
    admission: Admission = dataclasses.field(default_factory=lambda: Admission(0, 0))
    facts: ModelFacts = dataclasses.field(init=False)  # checkpoint facts + the engine's READY
    adapter_lookup: AdapterLookup = dataclasses.field(init=False)  # names loaded elsewhere

    def __post_init__(self) -> None:
        self.refresh_facts()
        self.adapter_lookup = AdapterLookup(self)

    def refresh_facts(self) -> None:
        """Called when engines come and go: the lowest-ranked live engine's READY wins."""
        live = sorted(self.engines.live_engines, key=lambda e: e.ready.data_parallel_rank)
        facts = self.checkpoint_facts
        self.facts = facts.with_engine(live[0].ready) if live else facts

    @property
    def max_prompt_bytes(self) -> int:
        """The most bytes of prompt text that can fit max_model_len (0: no limit)."""
        return self.facts.max_model_len * self.longest_token_bytes

    async def in_pool(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))
