"""The conversations ``bench/prefix_routing.py`` sends: the presets, each turn's lengths and
tokens drawn from a seed (the same for every server), one slot's conversations sent over its own
gRPC channel, and the KV sizing the workload implies."""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass

import grpc

from bench.prefix_cache import Sample, greedy_request
from bench.routing_report import Turn, ideal_hit
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc

RPC_TIMEOUT_S = 600.0
BLOCK_SIZE = 16  # the server's default


@dataclass(frozen=True)
class Preset:
    conversations: int  # at once
    turns: int  # per conversation
    rounds: int  # turns each of the ``conversations`` slots sends in a run
    system_tokens: int
    document_tokens: tuple[int, int]  # the first user message, drawn (inclusive)
    user_tokens: tuple[int, int]  # each later one
    max_tokens: tuple[int, int]  # each answer
    stagger: bool  # slots start mid-conversation (a steady working set), or all at turn 1
    think_ms: float  # mean think time before each later turn
    kv_blocks: int  # 0: sized by kv_share


PRESETS = {
    "capacity": Preset(32, 8, 16, 64, (128, 256), (48, 128), (48, 80), True, 1000.0, 0),
    "small": Preset(16, 6, 6, 128, (128, 128), (128, 128), (64, 64), False, 0.0, 800),
}


def generate(
    stub: pb_grpc.GenerationServiceStub, prompt: list[int], max_tokens: int
) -> tuple[Sample, list[int], str]:
    """One streamed request: its sample, the tokens it answered and the engine that ran it."""
    request = greedy_request(prompt, max_tokens)
    started = time.perf_counter()
    ttft = None
    answer: list[int] = []
    last = None
    for response in stub.Generate(request, timeout=RPC_TIMEOUT_S):
        for output in response.outputs:
            if output.token_ids and ttft is None:
                ttft = time.perf_counter() - started
            answer += output.token_ids
        last = response
    assert last is not None and ttft is not None, "no tokens came back"
    usage = last.usage
    sample = Sample(ttft, usage.completion_tokens, usage.prompt_tokens, usage.cached_prompt_tokens)
    return sample, answer, last.metrics.engine_id


class Workload:
    """The same conversations for every server: each turn's lengths and tokens drawn from a
    seed per conversation and turn. Slot ``j`` runs conversations ``j * 1000``, ``+ 1``, ...
    back to back until it has sent ``rounds`` turns; staggered, its first one starts at turn
    ``j % turns`` with the turns before as history (answers drawn, not asked: a conversation
    already under way, cold on every engine), so that the conversations in flight hold about
    the same context all along rather than all growing together."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.system = self.tokens(random.Random(0), args.system_tokens)

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, self.args.vocab) for _ in range(n)]

    def turn(self, conversation: int, turn: int) -> tuple[list[int], int, float]:
        """A turn's user message, answer length and think time before it (seconds)."""
        args = self.args
        rng = random.Random(conversation * 1000 + turn + 1)
        user = self.tokens(rng, rng.randint(*(args.user_tokens if turn else args.document_tokens)))
        think = rng.expovariate(1000.0 / args.think_ms) if args.think_ms and turn else 0.0
        return user, rng.randint(*args.max_tokens), think

    def context_blocks(self, conversation: int) -> float:
        """The conversation's own blocks (past the system prompt) after each of its turns, on
        average: what it holds in a cache while in flight."""
        total, own = 0, 0
        for turn in range(self.args.turns):
            user, answer, _ = self.turn(conversation, turn)
            own += len(user) + answer
            total += math.ceil((self.args.system_tokens + own) / BLOCK_SIZE)
        return total / self.args.turns - self.args.system_tokens // BLOCK_SIZE

    def run_slot(self, target: str, slot: int, turns: list[Turn]) -> None:
        args = self.args
        sent, conversation = 0, slot * 1000
        first_turn = slot % args.turns if args.stagger else 0
        with grpc.insecure_channel(target) as channel:  # its own connection: any gateway
            stub = pb_grpc.GenerationServiceStub(channel)
            while sent < args.rounds:
                history = list(self.system)
                for turn in range(first_turn):  # the conversation so far
                    user, answer_len, _ = self.turn(conversation, turn)
                    history += user + self.tokens(random.Random(-conversation - turn), answer_len)
                previous: tuple[str, int] | None = None  # its engine, the tokens computed
                for turn in range(first_turn, args.turns):
                    if sent == args.rounds:
                        break
                    user, max_tokens, think = self.turn(conversation, turn)
                    time.sleep(think)
                    history += user
                    sample, answer, engine = generate(stub, history, max_tokens)
                    ideal, reusable = ideal_hit(
                        BLOCK_SIZE,
                        len(history),
                        args.system_tokens,
                        previous[1] if previous else None,
                    )
                    picked_up = previous is None and turn > 0
                    turns.append(
                        Turn(
                            sample,
                            engine,
                            previous[0] if previous else None,
                            picked_up,
                            ideal,
                            reusable,
                        )
                    )
                    history += answer
                    previous = (engine, len(history) - 1)  # the last token was not computed
                    sent += 1
                conversation, first_turn = conversation + 1, 0


@dataclass(frozen=True)
class Sizing:
    """What the conversations in flight hold, and each engine's KV cache."""

    context_blocks: int  # the shared system prompt once, each conversation's own blocks
    kv_blocks: int  # per engine

    def describe(self, dp: int) -> str:
        return (
            f"KV cache: {self.kv_blocks} blocks of {BLOCK_SIZE} tokens per engine "
            f"({self.kv_blocks * BLOCK_SIZE} tokens); the conversations in flight hold about "
            f"{self.context_blocks} blocks = {self.context_blocks / self.kv_blocks:.2f}x one "
            f"engine's cache, {self.context_blocks / (dp * self.kv_blocks):.2f}x all {dp}"
        )


def sizing(workload: Workload) -> Sizing:
    args = workload.args
    own = sum(workload.context_blocks(slot * 1000) for slot in range(args.conversations))
    context = args.system_tokens // BLOCK_SIZE + round(own)
    return Sizing(context, args.kv_blocks or math.ceil(args.kv_share * context))
