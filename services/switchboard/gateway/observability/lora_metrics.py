"""``lora_requests_info``: the LoRA adapters the engines run and queue, as labels.

vLLM's info-style gauge, the series llm-d's LoRA-affinity scorer reads: labels ``max_lora``
(adapters one engine runs at once; 0 without ``--enable-lora``), ``running_lora_adapters`` and
``waiting_lora_adapters`` (comma-separated names), value the time of the scrape (routers take
the newest). ``vllm:lora_requests_info`` is one series for the gateway's engines together, as
vLLM has one per server; ``switchboard:lora_requests_info`` is the same per engine, with the
``model_name`` and ``engine`` labels of the other engine-level series.
"""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily

from switchboard.wire.engine_msgs import SchedulerStats

LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
HELP = "Running stats on lora requests."


class LoraRequestsInfo:
    """One scrape's ``lora_requests_info``: per engine (``engine_labels``) or all together."""

    def __init__(self, name: str, max_lora: int, engine_labels: tuple[str, ...] = ()) -> None:
        self.max_lora = max_lora
        self.per_engine = bool(engine_labels)
        self.family = GaugeMetricFamily(name, HELP, labels=[*engine_labels, *LORA_LABELS])
        self._running: set[str] = set()
        self._waiting: set[str] = set()

    def add(self, stats: SchedulerStats, engine_label_values: list[str], now: float) -> None:
        if self.per_engine:
            self.family.add_metric(
                [
                    *engine_label_values,
                    *self._labels(stats.running_lora_adapters, stats.waiting_lora_adapters),
                ],
                now,
            )
        else:
            self._running.update(stats.running_lora_adapters)
            self._waiting.update(stats.waiting_lora_adapters)

    def done(self, now: float | None = None) -> GaugeMetricFamily:
        """The family, with the one all-engines series when not per engine."""
        if not self.per_engine:
            stamp = time.time() if now is None else now
            self.family.add_metric(self._labels(self._running, self._waiting), stamp)
        return self.family

    def _labels(self, running: list[str] | set[str], waiting: list[str] | set[str]) -> list[str]:
        return [str(self.max_lora), ",".join(sorted(running)), ",".join(sorted(waiting))]
