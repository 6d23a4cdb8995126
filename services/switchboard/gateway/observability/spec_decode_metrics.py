"""Speculative decoding's engine-level counters, under ``switchboard:`` and vLLM's ``vllm:`` names.

From each engine's ``SchedulerStats`` (cumulative since its start, zero while speculation is
off): steps of a request with proposals (``spec_decode_num_drafts``), tokens proposed
(``..._num_draft_tokens``), tokens accepted (``..._num_accepted_tokens``), and accepted tokens by
their position among a step's proposals (``..._num_accepted_tokens_per_pos``, label
``position``). The acceptance rate is accepted / draft tokens; the mean accepted length per
proposing step is 1 + accepted / drafts. Under ``switchboard:`` only (vLLM has no such series),
the gauge ``spec_decode_row_cost``: a proposed row's cost as a share of a decode step's fixed
part, as the engine measures it, which decides how many tokens a request proposes
(``engine/speculation/step_cost.py``). Exported as the other engine-level series are
(``metrics.EngineStatsCollector``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from switchboard.wire.engine_msgs import SchedulerStats

SWITCHBOARD_PREFIX = "switchboard:"
VLLM_PREFIX = "vllm:"


class SpecDecodeFamilies:
    """One scrape's speculative-decoding families, under one prefix."""

    def __init__(self, prefix: str, labels: list[str]) -> None:
        p = prefix + "spec_decode_"
        self.drafts = CounterMetricFamily(
            p + "num_drafts", "Steps of a request with proposed tokens.", labels=labels
        )
        self.draft_tokens = CounterMetricFamily(
            p + "num_draft_tokens", "Proposed (draft) tokens.", labels=labels
        )
        self.accepted_tokens = CounterMetricFamily(
            p + "num_accepted_tokens", "Proposed tokens the model accepted.", labels=labels
        )
        self.accepted_per_pos = CounterMetricFamily(
            p + "num_accepted_tokens_per_pos",
            "Accepted tokens by their position among a step's proposals.",
            labels=[*labels, "position"],
        )

    def add(self, labels: list[str], stats: SchedulerStats) -> None:
        self.drafts.add_metric(labels, stats.spec_decode_num_drafts)
        self.draft_tokens.add_metric(labels, stats.spec_decode_num_draft_tokens)
        self.accepted_tokens.add_metric(labels, stats.spec_decode_num_accepted_tokens)
        for position, count in enumerate(stats.spec_decode_accepted_per_position):
            self.accepted_per_pos.add_metric([*labels, str(position)], count)

    def families(self) -> Iterator[Metric]:
        yield from (self.drafts, self.draft_tokens, self.accepted_tokens, self.accepted_per_pos)


class SpecDecodeMetrics:
    """Both prefixes' families, filled engine by engine from the same record."""

    def __init__(self, labels: list[str]) -> None:
        self._by_prefix = [
            SpecDecodeFamilies(SWITCHBOARD_PREFIX, labels),
            SpecDecodeFamilies(VLLM_PREFIX, labels),
        ]
        self.row_cost = GaugeMetricFamily(
            SWITCHBOARD_PREFIX + "spec_decode_row_cost",
            "A proposed row's cost as a share of a decode step's fixed part, as the engine "
            "measures it (0 while speculation is off).",
            labels=labels,
        )

    def add(self, labels: list[str], stats: SchedulerStats) -> None:
        for families in self._by_prefix:
            families.add(labels, stats)
        self.row_cost.add_metric(labels, stats.spec_decode_row_cost)

    def families(self) -> Iterator[Metric]:
        for families in self._by_prefix:
            yield from families.families()
        yield self.row_cost
