"""Replay the default model's greedy answers to bench/spec_decode.py's repetitive workload through
the n-gram speculator, without serving: how many steps each proposer needs, and what they would
cost at a given price per proposed row.

    .venv/bin/python bench/spec_replay.py                        # answers cached in --answers
    .venv/bin/python bench/spec_replay.py --row-cost 0.12 --max-len 4 8 --prompt-lookup-max 4 8
    .venv/bin/python bench/spec_replay.py --best-choice   # and the best the candidates allow

The answers (``--output-len`` greedy tokens per prompt) are generated once in process and kept
as JSON. Each replay walks every answer as the engine would: at each step the request's
speculation state (``engine/speculation/speculator.py``) asks for a proposal, the tokens that
match the answer are accepted plus one, and the state records the verdict. Printed per variant:
tokens per step, proposed and accepted tokens, and the speed-up over one token per step when a
step of ``1 + k`` rows costs ``1 + row_cost * k`` one-row steps. ``--best-choice`` replays each
variant a second time with the proposer's choice made by looking at the answer: among the
earlier occurrences of the longest matching suffix (the proposer takes the most recent), the one
whose continuation the answer follows longest, the proposal lengths and pauses unchanged: the
most any choice among those candidates could give.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode import repetitive_prompts  # noqa: E402

from switchboard.checkpoint import resolve_model  # noqa: E402
from switchboard.engine.speculation.ngram import (  # noqa: E402
    TokenIndex,
    continuation,
    propose_ngram,
)
from switchboard.engine.speculation.speculator import SpeculationState  # noqa: E402

BLOCK_SIZE = 16


def greedy_answers(prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Each prompt's greedy answer from the default model, one token per step, in process."""
    from switchboard.config import ModelConfig
    from switchboard.wire.engine_msgs import SamplingParams
    from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
    from switchboard.worker.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig(model=resolve_model(None)), torch.device("cpu"))
    runner.load_model()
    longest = max(len(p) for p in prompts) + output_len + 1
    blocks = -(-longest // BLOCK_SIZE)
    runner.initialize_kv_cache(blocks + 1, BLOCK_SIZE)
    answers, step_id = [], 0
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        step_id += 1
        out = runner.execute_model(
            SchedulerOutput(
                step_id=step_id,
                new_requests=[
                    NewRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=output_len),
                        block_ids=list(range(blocks)),
                        num_computed_tokens=0,
                    )
                ],
                num_scheduled_tokens={rid: len(prompt)},
                total_num_scheduled_tokens=len(prompt),
            )
        )
        answer = list(out.sampled_token_ids[0])
        while len(answer) < output_len:
            step_id += 1
            out = runner.execute_model(
                SchedulerOutput(
                    step_id=step_id,
                    cached_requests=[CachedRequest(rid, [], len(prompt) + len(answer) - 1)],
                    num_scheduled_tokens={rid: 1},
                    total_num_scheduled_tokens=1,
                )
            )
            answer += out.sampled_token_ids[0]
        step_id += 1
        runner.execute_model(SchedulerOutput(step_id=step_id, finished_request_ids=[rid]))
        answers.append(answer[:output_len])
    return answers


def propose_best(
    tokens: list[int],
    index: TokenIndex,
    num_tokens: int,
    min_n: int,
    max_n: int,
    future: list[int],
) -> list[int]:
    """What the n-gram proposer could propose at best: among every earlier occurrence of the
    longest suffix of ``min_n..max_n`` tokens (the ones ``propose_ngram`` picks the most recent
    of), the continuation that matches ``future`` longest (the most recent of equals)."""
    index.update(tokens)
    end = len(tokens)
    if num_tokens <= 0 or end < min_n + 1:
        return []
    found: dict[int, list[int]] = {}  # suffix length -> continuation starts
    for pos in index.occurrences(tokens[-1])[:-1]:  # the last is the suffix itself
        length = 1
        while length < min(max_n, pos + 1) and tokens[pos - length] == tokens[end - 1 - length]:
            length += 1
        found.setdefault(length, []).append(pos + 1)
    longest = max(found, default=0)
    if longest < min_n:
        return []

    def matched(proposal: list[int]) -> int:
        n = 0
        while n < len(proposal) and n < len(future) and proposal[n] == future[n]:
            n += 1
        return n

    proposals = [continuation(tokens, start, num_tokens) for start in reversed(found[longest])]
    return max(proposals, key=matched)


def replay(
    prompt: list[int],
    answer: list[int],
    max_len: int,
    min_n: int,
    max_n: int,
    best_choice: bool = False,
) -> tuple[int, list[int], int, int]:
    """(steps, rows of each step, proposed, accepted) to produce ``answer`` after ``prompt``;
    ``best_choice``: each proposal the best the candidates allow (``propose_best``), the
    speculation state's lengths and pauses as they are."""
    state = SpeculationState(True, max_len)
    index = TokenIndex()
    tokens = list(prompt)
    steps, rows, proposed, accepted = 0, [], 0, 0
    # the first output comes from the prefill
    tokens.append(answer[0])
    done = 1
    while done < len(answer):
        drafts: list[int] = []
        if done >= max(state.paused_until, 1):
            want = min(state.proposal_len(), len(answer) - done - 1)
            if want <= 0:
                drafts = []
            elif best_choice:
                drafts = propose_best(tokens, index, want, min_n, max_n, answer[done:])
            else:
                drafts = propose_ngram(tokens, index, want, min_n, max_n)
            if not drafts:
                state.record(0, 0, done)
        n = 0
        while n < len(drafts) and drafts[n] == answer[done + n]:
            n += 1
        if drafts:
            state.record(len(drafts), n, done + n + 1)
        emitted = answer[done : done + n + 1]
        tokens += emitted
        done += len(emitted)
        steps += 1
        rows.append(1 + len(drafts))
        proposed += len(drafts)
        accepted += n
    return steps, rows, proposed, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--answers", type=Path, default=Path("/tmp/spec_replay_answers.json"))
    parser.add_argument("--row-cost", type=float, nargs="+", default=[0.12, 0.19])
    parser.add_argument("--max-len", type=int, nargs="+", default=[4, 7, 8])
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--best-choice",
        action="store_true",
        help="also replay each variant choosing, among the proposer's candidates, the one that "
        "matches the answer longest: how much a better choice could give",
    )
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(resolve_model(None)) / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in repetitive_prompts()]
    cached = json.loads(args.answers.read_text()) if args.answers.exists() else None
    if cached is None or cached["prompts"] != prompts or cached["output_len"] != args.output_len:
        answers = greedy_answers(prompts, args.output_len)
        cached = {"prompts": prompts, "output_len": args.output_len, "answers": answers}
        args.answers.write_text(json.dumps(cached))
    answers = cached["answers"]
    choices = (False, True) if args.best_choice else (False,)
    for max_n in args.prompt_lookup_max:
        for max_len in args.max_len:
            for best_choice in choices:
                label = f"lookup max {max_n}, k {max_len}{', best choice' if best_choice else ''}"
                print(
                    f"{label}: "
                    + summary(
                        prompts,
                        answers,
                        max_len,
                        args.prompt_lookup_min,
                        max_n,
                        best_choice,
                        args.row_cost,
                    )
                )


def summary(
    prompts: list[list[int]],
    answers: list[list[int]],
    max_len: int,
    min_n: int,
    max_n: int,
    best_choice: bool,
    row_costs: list[float],
) -> str:
    """One variant replayed over every answer: tokens per step, proposals accepted, and the
    speed-up at each row cost."""
    steps, proposed, accepted = 0, 0, 0
    rows: list[int] = []
    for prompt, answer in zip(prompts, answers, strict=True):
        s, r, p, a = replay(prompt, answer, max_len, min_n, max_n, best_choice)
        steps, proposed, accepted = steps + s, proposed + p, accepted + a
        rows += r
    total = sum(len(a) for a in answers)
    speedups = []
    for cost in row_costs:
        step_cost = sum(1 + cost * (r - 1) for r in rows) + len(answers)  # + prefills
        speedups.append(f"{total / step_cost:.2f}x at {cost}")
    per_step = total / (steps + len(answers))
    return (
        f"{per_step:.2f} tokens/step, "
        f"{accepted}/{proposed} accepted ({accepted / max(proposed, 1):.0%}); "
        + ", ".join(speedups)
    )


if __name__ == "__main__":
    main()
