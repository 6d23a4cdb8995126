"""The engine's clock: every timestamp the engine sends is ``monotonic_ns()`` of this module.

Request events (QUEUED, SCHEDULED, PREEMPTED), ``EngineCoreOutputs.timestamp_ns`` and the
monotonic half of READY's clock anchor all come from here. The gateway places them on its wall
clock with that anchor, so they never have to agree with any other process's clock.

Test hook: ``SWITCHBOARD_TEST_CLOCK_OFFSET_NS`` (read once, at import) shifts every stamp by
that many nanoseconds, as if this engine ran on a machine whose monotonic clock started at
another moment. Spans and latencies must come out the same; a test checks that they do.
"""

from __future__ import annotations

import os
import time

TEST_CLOCK_OFFSET_ENV = "SWITCHBOARD_TEST_CLOCK_OFFSET_NS"
TEST_CLOCK_OFFSET_NS = int(os.environ.get(TEST_CLOCK_OFFSET_ENV, "0") or 0)

if TEST_CLOCK_OFFSET_NS:

    def monotonic_ns() -> int:
        return time.monotonic_ns() + TEST_CLOCK_OFFSET_NS

else:
    monotonic_ns = time.monotonic_ns
