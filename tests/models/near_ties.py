"""The quality rule for approximate decode matmuls: greedy output equals the float32 model's
except where the float32 model's top two tokens nearly tie. Each sequence is compared token by
token up to where the two part (after that their contexts differ); a parting is allowed only
where the reference's best two log-probabilities are less than ``tie`` apart, and up to it the
reference's five best log-probabilities must move by less than ``moved``. With ``relative``
both bounds are fractions of the step's range of log-probabilities (the rounding of the rows
moves logits in proportion to their size, and a tiny random model's logits span from tens to
hundreds)."""

from __future__ import annotations

from collections.abc import Callable

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
        agreed += _agreed_from(mine, theirs, 0, tie, moved, relative)
    return agreed


def _agreed_from(
    mine: DrivenRequest,
    theirs: DrivenRequest,
    first: int,
    tie: float,
    moved: float,
    relative: bool,
    top: int = 5,
) -> int:
    """``mine`` against ``theirs`` from ``theirs``'s token ``first`` on (``mine`` continued
    ``theirs``'s first ``first`` tokens): the tokens agreed before a parting, ``theirs``'s
    ``top`` best log-probabilities moved less than ``moved``."""
    for step, token in enumerate(mine.output):
        position = first + step
        logprobs = theirs.logprobs[position]
        unit = float(logprobs.max() - logprobs.min()) if relative else 1.0
        best = logprobs.topk(max(top, 2))
        if token != theirs.output[position]:  # only a near-tie may part them
            gap = float(best.values[0] - best.values[1])
            assert gap < tie * unit, (mine.request_id, position, gap, unit)
            return step
        values, indices = best.values[:top], best.indices[:top]
        change = float((mine.logprobs[step][indices] - values).abs().max())
        assert change < moved * unit, (mine.request_id, position, change, unit)
    return len(mine.output)


def agreed_in_reference_context(
    run: Callable[[list[DrivenRequest]], None],
    reference: list[DrivenRequest],
    tie: float,
    moved: float,
    top: int = 1,
) -> tuple[int, int]:
    """Every token of the reference's sequences compared, (agreed, parted): where ours parts
    from the reference (at a near-tie only), ``run`` continues it from the reference's tokens up
    to and including that one (the prompt extended by them), so the tokens after a parting are
    compared in the reference's context rather than left out. Which near-ties part the two
    depends on float rounding (the order of a kernel's sums), so counting only the tokens
    before a first parting would not say how often they agree. ``moved`` bounds the reference's
    ``top`` best log-probabilities (by default its best token's, the one a greedy pick takes:
    over every position, the runners-up of a flat step move much further)."""
    first = {theirs.request_id: 0 for theirs in reference}
    agreed = parted = 0
    pending = list(reference)
    while pending:
        continued = [
            DrivenRequest(
                f"{theirs.request_id}@{first[theirs.request_id]}",
                theirs.prompt + theirs.output[: first[theirs.request_id]],
                len(theirs.output) - first[theirs.request_id],
                join_step=i,
            )
            for i, theirs in enumerate(pending)
        ]
        run(continued)
        still = []
        for mine, theirs in zip(continued, pending, strict=True):
            start = first[theirs.request_id]
            same = _agreed_from(mine, theirs, start, tie, moved, relative=False, top=top)
            agreed += same
            if start + same < len(theirs.output):  # parted at a near-tie: on from the next one
                parted += 1
                first[theirs.request_id] = start + same + 1
                if first[theirs.request_id] < len(theirs.output):
                    still.append(theirs)
        pending = still
    return agreed, parted
