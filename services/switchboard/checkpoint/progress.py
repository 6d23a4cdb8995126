"""A plain progress line on stderr for long one-off jobs (download, conversion).

On a terminal the line is redrawn in place; otherwise (logs, CI) a line is printed each time
another tenth of the work is done, so a log file gets ~10 lines rather than hundreds.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self._label = label
        self._total = max(total, 1)
        self._stream = stream if stream is not None else sys.stderr
        self._interactive = bool(getattr(self._stream, "isatty", lambda: False)())
        self._started = time.monotonic()
        self._last_tenth = -1

    def update(self, done: int, item: str = "") -> None:
        percent = 100 * done // self._total
        tenth = percent // 10
        if not self._interactive and tenth == self._last_tenth and done != self._total:
            return
        self._last_tenth = tenth
        elapsed = time.monotonic() - self._started
        line = f"{self._label}: {done}/{self._total} ({percent:3d}%) {elapsed:5.1f}s {item}"
        if self._interactive:
            self._stream.write("\r\x1b[K" + line)
            if done == self._total:
                self._stream.write("\n")
        else:
            self._stream.write(line + "\n")
        self._stream.flush()
