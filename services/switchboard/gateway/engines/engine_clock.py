"""One engine's monotonic clock, placed on this gateway's wall clock.

The engine stamps everything with its own ``time.monotonic_ns()``, which means nothing outside
its process. Its READY carries an anchor, ``(wall_clock_ns, monotonic_ns)`` read together, so::

    gateway wall ns = engine monotonic ns + offset,  offset = anchor wall - anchor monotonic

That is exact when the engine's wall clock is this gateway's (one machine). Across machines the
two wall clocks may disagree by more than the work being measured, so the offset is also kept
inside what causality allows, from moments both sides saw:

* an engine event caused by a gateway message happened *after* the gateway sent it:
  ``offset >= sent_wall - event_monotonic`` (``not_before``);
* an engine stamp the gateway has received was made *before* it arrived:
  ``offset <= received_wall - stamp_monotonic`` (``not_after``).

Within those bounds the anchor wins; outside them the nearest bound does, so a skewed engine
wall clock costs at most one network transit of accuracy, never a child span outside its
parent. Bounds that contradict each other (a clock was stepped) are dropped and rebuilt.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# A correction larger than this is worth a log line: the engine's wall clock is off.
_REPORT_SKEW_NS = 50_000_000


class EngineClock:
    def __init__(self, engine_id: str, anchor_wall_ns: int, anchor_monotonic_ns: int) -> None:
        self.engine_id = engine_id
        self._anchor_offset = anchor_wall_ns - anchor_monotonic_ns
        self._low: int | None = None  # greatest lower bound on the offset seen so far
        self._high: int | None = None  # least upper bound
        self.offset = self._anchor_offset
        self._reported = False

    def to_wall_ns(self, engine_monotonic_ns: int) -> int:
        return engine_monotonic_ns + self.offset

    def not_before(self, engine_monotonic_ns: int, gateway_wall_ns: int) -> None:
        """The engine stamped ``engine_monotonic_ns`` no earlier than ``gateway_wall_ns``."""
        bound = gateway_wall_ns - engine_monotonic_ns
        if self._low is None or bound > self._low:
            self._low = bound
            if self._high is not None and bound > self._high:
                self._contradiction()
                self._high = None
            self._settle()

    def not_after(self, engine_monotonic_ns: int, gateway_wall_ns: int) -> None:
        """The engine stamped ``engine_monotonic_ns`` no later than ``gateway_wall_ns``."""
        bound = gateway_wall_ns - engine_monotonic_ns
        if self._high is None or bound < self._high:
            self._high = bound
            if self._low is not None and bound < self._low:
                self._contradiction()
                self._low = None
            self._settle()

    def _contradiction(self) -> None:
        # One of the clocks was stepped: the newest bound is kept, the older one dropped.
        logger.warning("engine %s: clock bounds contradict; re-learning them", self.engine_id)

    def _settle(self) -> None:
        low, high = self._low, self._high
        offset = self._anchor_offset
        if low is not None and offset < low:
            offset = low
        if high is not None and offset > high:
            offset = high
        self.offset = offset
        skew = offset - self._anchor_offset
        if abs(skew) > _REPORT_SKEW_NS and not self._reported:
            self._reported = True
            logger.warning(
                "engine %s: its wall clock is about %.3f s off this gateway's; engine "
                "timestamps are corrected by what the gateway observed",
                self.engine_id,
                -skew / 1e9,
            )
