"""The quality rule for approximate decode matmuls: greedy output equals the float32 model's
except where the float32 model's top two tokens nearly tie. Each sequence is compared token by
token up to where the two part (after that their contexts differ); a parting is allowed only
where the reference's best two log-probabilities are less than ``tie`` apart, and up to it the
reference's five best log-probabilities must move by less than ``moved``. With ``relative``
both bounds are fractions of the step's range of log-probabilities (the rounding of the rows
moves logits in proportion to their size, and a tiny random model's logits span from tens to
hundreds)."""

from __future__ import annotations

from tests.worker.test_model_runner_parity import DrivenRequest


def agreed_tokens(
    ours: list[DrivenRequest],
    reference: list[DrivenRequest],
    tie: float,
    moved: float,
    relative: bool = False,
) -> int:
    """Tokens agreed before the sequences part; fails where a parting is not a near-tie or a
    top log-probability moved too far."""
    agreed = 0
    for mine, theirs in zip(ours, reference, strict=True):
        for step, (token, expected) in enumerate(zip(mine.output, theirs.output, strict=True)):
            logprobs = theirs.logprobs[step]
            unit = float(logprobs.max() - logprobs.min()) if relative else 1.0
            best = logprobs.topk(5)
            if token != expected:  # the sequences part here: only a near-tie may part them
                gap = float(best.values[0] - best.values[1])
                assert gap < tie * unit, (mine.request_id, step, gap, unit)
                break
            agreed += 1
            change = float((mine.logprobs[step][best.indices] - best.values).abs().max())
            assert change < moved * unit, (mine.request_id, step, change, unit)
    return agreed
