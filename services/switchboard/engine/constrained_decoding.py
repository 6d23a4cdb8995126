"""Constrained decoding in the engine core: compile grammars, make each step's token bitmask,
advance each request's matcher with its accepted tokens (llguidance, no torch).

Where the work happens (docs/architecture.md, "Structured output")::

    input thread   prepare_add -> StructuredOutputManager.start(request): compile in the pool
    pool thread    the tokenizer table (once), the grammar (cached by (kind, spec, eos)),
                   a fresh matcher per request (a copy of the cached one); done -> wakes the loop
    busy loop      a request waits outside the scheduler until its grammar is ready (others are
                   not held back); schedule -> bitmask of the constrained requests that sample
                   this step (LLExecutor, threads, GIL released) -> SchedulerOutput.grammar_bitmask
                   -> workers mask the logits -> update: each accepted token advances the matcher

A matcher is per request (per sequence: ``n`` > 1 sends one request per sequence) and only ever
advances on accepted tokens, so a preempted request resumes with its matcher where its output
is: recompute, prefix-cache hits and chunked prefill change nothing about it (a prefill chunk
that samples nothing gets no mask row).

A resumed stream (an ADD whose ``output_token_ids`` another engine generated and the client
already has) gets a matcher that has consumed those tokens, in the compile pool, before the
request is scheduled: it continues from where the cut-off engine's matcher was. Tokens the
grammar rejects fail the request (ERROR) rather than continuing an output that is not valid.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from switchboard.common.constraint_grammar import StructuredOutputError, to_grammar
from switchboard.engine.request import Request
from switchboard.wire.engine_msgs import StructuredOutputParams
from switchboard.wire.step_msgs import SchedulerOutput

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (LRU), by (kind, spec, eos ids)


class RequestGrammar:
    """One request's constraint: its compile future, then its matcher."""

    __slots__ = ("future", "matcher", "error")

    def __init__(self, future: Future[Any]) -> None:
        self.future = future
        self.matcher: Any = None  # llguidance.LLMatcher once compiled
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        return self.future.done()

    def resolve(self) -> str | None:
        """Once ``ready``: take the matcher; the compile error (a message) if it failed."""
        if self.matcher is None and self.error is None:
            try:
                self.matcher = self.future.result()
            except Exception as exc:  # a bad spec from the wire: this request fails alone
                self.error = f"structured_output: {exc}"
        return self.error

    def accept(self, token_id: int) -> bool:
        """Advance on an accepted token; False if the grammar rejects it."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The output is complete: nothing (but EOS) may follow."""
        return bool(self.matcher.is_stopped())

    def error_message(self) -> str:
        return f"structured output: {self.matcher.get_error() or 'token rejected by the grammar'}"


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: str, vocab_size: int, max_workers: int | None = None) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        workers = max_workers or min(4, max(1, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._tokenizers: dict[tuple[int, ...], Any] = {}
        self._cache: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()
        self._executor: Any = None  # llguidance.LLExecutor, made on first use
        self.compiled = 0  # grammars compiled (cache misses), for tests and stats
        self.cache_hits = 0

    def start(
        self,
        params: StructuredOutputParams,
        eos_token_ids: Iterable[int],
        on_done: Callable[[], None] | None = None,
        replay: Iterable[int] = (),
    ) -> RequestGrammar:
        """Compile in the pool (cached); ``on_done`` runs in the pool thread when finished.
        ``replay``: output tokens already generated (a resumed stream), consumed by the new
        matcher before it makes a mask."""
        future = self._pool.submit(
            self._matcher, params.kind, params.spec, tuple(eos_token_ids), tuple(replay)
        )
        if on_done is not None:
            future.add_done_callback(lambda _: on_done())
        return RequestGrammar(future)

    def _tokenizer(self, eos: tuple[int, ...]) -> Any:
        import llguidance

        with self._lock:
            tokenizer = self._tokenizers.get(eos)
            if tokenizer is None:
                path = os.path.join(self.tokenizer_dir, "tokenizer.json")
                if not os.path.isfile(path):
                    raise StructuredOutputError(f"the model has no tokenizer.json ({path})")
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                tokenizer = llguidance.LLTokenizer(
                    text, n_vocab=self.vocab_size, eos_token=list(eos) or None
                )
                self._tokenizers[eos] = tokenizer
                logger.info("structured output: tokenizer table built (%d tokens)", self.vocab_size)
            return tokenizer

    def _matcher(
        self, kind: str, spec: str, eos: tuple[int, ...], replay: tuple[int, ...] = ()
    ) -> Any:
        import llguidance

        key = (kind, spec, eos)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
        if template is None:
            tokenizer = self._tokenizer(eos)
            template = llguidance.LLMatcher(tokenizer, to_grammar(kind, spec), log_level=0)
            if template.is_error():
                raise StructuredOutputError(f"{kind}: {template.get_error().strip()}")
            with self._lock:
                self.compiled += 1
                self._cache[key] = template
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        matcher = template.deep_copy()  # the cached one never advances
        _replay(matcher, replay)
        return matcher

    def bitmask(self, grammars: list[RequestGrammar]) -> bytes:
        """The next-token bitmask rows of these requests, packed (``SchedulerOutput``)."""
        import llguidance
        import llguidance.numpy as lnp

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        mask = np.full((len(grammars), self.words), -1, dtype="<i4")
        lnp.fill_next_token_bitmask_par(
            self._executor, [(g.matcher, row) for row, g in enumerate(grammars)], mask
        )
        return mask.tobytes()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _replay(matcher: Any, token_ids: tuple[int, ...]) -> None:
    """Advance a fresh matcher over a resumed stream's delivered tokens."""
    for position, token_id in enumerate(token_ids):
        if matcher.is_stopped():
            raise StructuredOutputError(
                f"the resumed output is already complete after {position} of its "
                f"{len(token_ids)} tokens"
            )
        if not matcher.consume_token(token_id):
            error = (matcher.get_error() or "token rejected by the grammar").split("\n")[0]
            raise StructuredOutputError(
                f"the resumed output's token {position} ({token_id}) does not fit: {error}"
            )


def attach_bitmask(
    manager: StructuredOutputManager, output: SchedulerOutput, requests: dict[str, Request]
) -> None:
    """Give the step's ``SchedulerOutput`` the bitmask rows of its constrained requests that
    sample in it (their computed tokens, already advanced by the commit, reach their end)."""
    grammars: list[RequestGrammar] = []
    ids: list[str] = []
    for rid in output.num_scheduled_tokens:
        request = requests.get(rid)
        if (
            request is not None
            and request.grammar is not None
            and request.num_computed_tokens >= request.num_tokens
        ):
            grammars.append(request.grammar)
            ids.append(rid)
    if grammars:
        output.grammar_bitmask = manager.bitmask(grammars)
        output.structured_request_ids = ids
