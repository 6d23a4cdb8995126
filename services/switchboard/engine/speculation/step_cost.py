"""What a proposed token costs, and how many are worth proposing.

Every proposed token is a row of the step whether it is accepted or not. Where a row costs
little beside the step's fixed part (one request on a machine whose step is bound by reading the
weights) long proposals pay; where the step is bound by compute (several requests on a 2-core
CPU) a row costs nearly what a decode does, and proposals that are not accepted take time from
every request in the batch. Measured on a 2-core Xeon (the default model from its GGUF file, in
process, ``bench/verify_step.py``): a step of 1 + 8 rows took 3.1x a one-row step, and n-gram
proposals of up to 8 tokens at 4 streams gave 0.84x the tokens per second of no speculation.

:class:`StepCost` keeps a running least-squares fit of the engine's step time on the step's rows
(decode steps only: a prompt chunk's rows cost otherwise), ``time = fixed + per_row * rows``,
each step timed by its period in the engine's busy loop (from the previous step's outputs
applied to its own: with steps scheduled ahead, as while nobody proposes, the rate a step of
these rows sets; the number of decoding requests varies, so the fit keeps learning), and
:func:`worth_proposing` turns it into a length: a request's ``i``-th proposal is accepted with
probability about ``p ** i`` (``p`` its running acceptance per token), so it adds ``p ** i``
expected tokens for ``per_row`` more time, and raises the step's tokens per second when that is
more than the step already makes per unit of time, ``n / (fixed + per_row * n)`` for ``n``
decoding requests. Proposals are cut to the positions that pass.
"""

from __future__ import annotations

import math

# A row's cost against the step's fixed part until the fit has seen enough steps: a sixth, what
# the verify rows of the default model cost on a 2-core AMD EPYC (docs/benchmarks.md)
PRIOR_ROW_SHARE = 1 / 6
# the fit forgets a step's weight by this factor per step (a machine's load drifts)
FORGET = 0.98
MIN_STEPS = 8  # steps seen before the fit replaces the prior
MIN_ROWS_SPREAD = 0.5  # and the rows' weighted standard deviation it needs
# The most a row is taken to cost: the step's whole fixed part (a step bound by compute through
# and through). A fit past it, or with no fixed part at all, says more about the noise of a
# few steps than about rows; with it a lone request still proposes (two tokens at 3 of 4).
MAX_ROW_SHARE = 1.0
# Per-request acceptance: accepted tokens against steps that rejected something, after
# PRIOR_WEIGHT steps' worth of a prior: the recent rate over every request's verdicts, but
# never below FIRST_ACCEPTANCE (a new request on a workload that copies starts as the others did;
# on one that does not, it still tries). A request's own verdicts fade by EVIDENCE_FORGET per
# output token since: one whose proposals failed, and that stopped proposing for it, comes back
# to the prior and tries again (a text may start to repeat itself later)
PRIOR_WEIGHT = 4.0
FIRST_ACCEPTANCE = 0.75
EVIDENCE_FORGET = 0.9
# the rate over every request forgets a verdict by this factor per verdict
ACCEPTANCE_FORGET = 0.99


class StepCost:
    """A running fit of step time against rows (see the module)."""

    def __init__(self) -> None:
        self.steps = 0
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows (decodes and proposals) took ``seconds``."""
        if rows <= 0 or not seconds > 0.0:
            return
        f = FORGET
        self._w = f * self._w + 1.0
        self._x = f * self._x + rows
        self._xx = f * self._xx + rows * rows
        self._y = f * self._y + seconds
        self._xy = f * self._xy + rows * seconds
        self.steps += 1

    def row_share(self) -> float:
        """A row's cost as a share of the step's fixed part (``per_row / fixed``); the prior
        until the fit has enough steps of different sizes, or where it is not a cost."""
        if self.steps < MIN_STEPS:
            return PRIOR_ROW_SHARE
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < MIN_ROWS_SPREAD**2:
            return PRIOR_ROW_SHARE
        per_row = (self._xy / self._w - mean_x * mean_y) / var_x
        fixed = mean_y - per_row * mean_x
        if per_row <= 0.0:
            return 0.0  # rows are free at these sizes: propose what the proposer finds
        if fixed <= 0.0:
            return MAX_ROW_SHARE
        return min(per_row / fixed, MAX_ROW_SHARE)


def acceptance(accepted: float, stops: float, prior: float = FIRST_ACCEPTANCE) -> float:
    """The chance that a proposed token is accepted given the ones before it were: accepted
    tokens against steps that rejected one, after ``PRIOR_WEIGHT`` of ``prior``."""
    return (accepted + PRIOR_WEIGHT * prior) / (accepted + stops + PRIOR_WEIGHT)


class Evidence:
    """A request's verdicts, fading with its output tokens (``EVIDENCE_FORGET``)."""

    def __init__(self) -> None:
        self.accepted = self.stops = 0.0
        self.at = 0  # the output tokens when they were last faded

    def faded(self, num_output_tokens: int) -> float:
        return float(EVIDENCE_FORGET ** max(num_output_tokens - self.at, 0))

    def record(self, num_proposed: int, num_accepted: int, num_output_tokens: int) -> None:
        f = self.faded(num_output_tokens)
        self.accepted = f * self.accepted + num_accepted
        self.stops = f * self.stops + (num_accepted < num_proposed)
        self.at = num_output_tokens

    def rate(self, num_output_tokens: int, prior: float) -> float:
        f = self.faded(num_output_tokens)
        return acceptance(f * self.accepted, f * self.stops, prior)


class AcceptanceRate:
    """The acceptance over every request's recent verdicts: a new request's prior."""

    def __init__(self) -> None:
        self.accepted = self.stops = 0.0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted = ACCEPTANCE_FORGET * self.accepted + num_accepted
        self.stops = ACCEPTANCE_FORGET * self.stops + (num_accepted < num_proposed)

    def rate(self) -> float:
        return acceptance(self.accepted, self.stops)

    def prior(self) -> float:
        """A request's prior: this rate, but never below ``FIRST_ACCEPTANCE``."""
        return max(self.rate(), FIRST_ACCEPTANCE)


def worth_proposing(p: float, decoding: int, row_share: float, most: int) -> int:
    """How many of at most ``most`` proposals raise a step's tokens per second, for a request
    whose proposals are accepted with ``p`` per token, in a step of ``decoding`` decoding
    requests whose rows cost ``row_share`` of its fixed part each."""
    if most <= 0 or row_share <= 0.0:
        return max(most, 0)
    if math.isinf(row_share):
        return 0
    n = max(decoding, 1)
    threshold = row_share * n / (1.0 + row_share * n)  # tokens per row the step makes now
    if p <= threshold:
        return 0
    if p >= 1.0:
        return most
    return min(most, int(math.log(threshold) / math.log(p)))
