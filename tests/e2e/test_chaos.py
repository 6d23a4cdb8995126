"""A bounded chaos run: random kill -9s of engines and workers under load with -dp 2, and no
request lost — every stream completes with the tokens an undisturbed run gives, or ends with a
clear, retryable UNAVAILABLE that says how much it delivered; none is silently cut short.

127.0.0.1 only; about 45 s of load; kills only processes this server started (by pid).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import grpc
import pytest

from tests.e2e.server import start_server
from tests.e2e.test_resilience import PROMPTS, SMALL_KV, Stream, generate_tokens

pytestmark = pytest.mark.slow

LOAD_S = 40.0
KILL_EVERY_S = 8.0
CONCURRENCY = 6
MAX_TOKENS = 120
VICTIMS = (
    "switchboard::EngineCore_DP0",
    "switchboard::EngineCore_DP1",
    "switchboard::Worker_DP0_PP0_TP0",
    "switchboard::Worker_DP1_PP0_TP0",
)


def test_random_kills_under_load_lose_no_request(tiny_model: str, tmp_path: Path) -> None:
    rng = random.Random(20261201)
    server = start_server(tiny_model, tmp_path, "-dp", "2", "--max-restarts", "50", *SMALL_KV)
    try:
        expected = [generate_tokens(server, prompt, MAX_TOKENS) for prompt in PROMPTS]
        running: list[tuple[int, Stream]] = []
        ended: list[tuple[int, Stream]] = []
        kills: list[str] = []
        started = time.monotonic()
        next_kill = started + KILL_EVERY_S / 2
        sent = 0
        while time.monotonic() - started < LOAD_S:
            for item in [r for r in running if not r[1]._thread.is_alive()]:
                running.remove(item)
                ended.append(item)
            while len(running) < CONCURRENCY:
                index = sent % len(PROMPTS)
                running.append((index, Stream(server, PROMPTS[index], MAX_TOKENS)))
                sent += 1
            if time.monotonic() >= next_kill:
                alive = server.titled_processes()
                candidates = [name for name in VICTIMS if name in alive]
                if candidates:
                    victim = rng.choice(candidates)
                    os.kill(alive[victim], signal.SIGKILL)
                    kills.append(victim)
                next_kill += KILL_EVERY_S
            time.sleep(0.05)
        for item in running:
            item[1].join()
            ended.append(item)

        completed = [s for i, s in ended if s.code == grpc.StatusCode.OK]
        identical = [
            s for i, s in ended if s.code == grpc.StatusCode.OK and s.tokens == expected[i]
        ]
        refused = [
            s
            for _, s in ended
            if s.code == grpc.StatusCode.UNAVAILABLE and "delivered" in s.details
        ]
        lost = [
            (i, s.code, s.details, len(s.tokens))
            for i, s in ended
            if not (s.code == grpc.StatusCode.OK and s.tokens == expected[i])
            and not (s.code == grpc.StatusCode.UNAVAILABLE and "delivered" in s.details)
        ]
        print(
            f"\nchaos: {len(kills)} kills ({', '.join(k.split('::')[1] for k in kills)}); "
            f"{len(ended)} requests: {len(identical)} complete and identical, "
            f"{len(refused)} refused with UNAVAILABLE saying what they delivered, {len(lost)} lost"
        )
        assert kills, "nothing was killed"
        assert lost == [], lost
        assert len(completed) >= len(ended) // 2  # most streams rode through the kills
        # Afterwards both engines serve again.
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            assert generate_tokens(server, prompt, MAX_TOKENS) == tokens
    finally:
        assert server.stop() == 0, server.log()
