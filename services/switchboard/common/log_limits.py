"""Warnings that a client (or any peer) can trigger, at a bounded rate.

A malformed request, a wrong API key or a refused ADD is worth one WARNING line; ten thousand of
them a second are a flood that hides everything else and fills the disk. ``WarningLimit`` lets
``burst`` lines of one *cause* through per ``window_s``; the rest of that window's lines of the
cause are counted, and when the window ends one line says how many were dropped::

    suppressed 995 similar warnings (malformed request) in the last 60.0 s

Causes are fixed words chosen by the caller, never text a client sent (that would make every
request its own cause). The count is also given when the process stops (``report_suppressed``).
Standard library only: the gateway and the engine core both use it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

DEFAULT_BURST = 5  # lines per cause per window
DEFAULT_WINDOW_S = 60.0

_LIMITS: weakref.WeakSet[WarningLimit] = weakref.WeakSet()


@dataclasses.dataclass
class _Window:
    started: float
    emitted: int = 0
    suppressed: int = 0
    timer: threading.Timer | None = None


class WarningLimit:
    """Rate-limited WARNING lines of one logger, per cause (thread-safe)."""

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = DEFAULT_BURST,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        _LIMITS.add(self)

    def warning(self, cause: str, message: str, *args: Any) -> bool:
        """Log ``message % args`` at WARNING unless ``cause`` has had its ``burst`` lines in
        this window; True when it was logged."""
        now = self._clock()
        with self._lock:
            window = self._windows.get(cause)
            if window is None or (now - window.started >= self.window_s and not window.suppressed):
                window = self._windows[cause] = _Window(now)
            if window.emitted < self.burst:
                window.emitted += 1
                emit = True
            else:
                window.suppressed += 1
                emit = False
                if window.timer is None:  # the window's end reports the count, even if quiet
                    delay = max(0.0, window.started + self.window_s - now)
                    window.timer = threading.Timer(delay, self._close, (cause, window))
                    window.timer.daemon = True
                    window.timer.start()
        if emit:
            self.logger.warning(message, *args, stacklevel=2)
        return emit

    def report(self) -> None:
        """Log the suppressed count of every cause now and start every cause afresh (the
        process is stopping, or a test wants the count)."""
        with self._lock:
            windows = list(self._windows.items())
        for cause, window in windows:
            self._close(cause, window)

    def _close(self, cause: str, window: _Window) -> None:
        """``window`` of ``cause`` is over: say what it dropped."""
        with self._lock:
            if self._windows.get(cause) is not window:
                return  # closed already
            del self._windows[cause]
            if window.timer is not None:
                window.timer.cancel()
            elapsed_s = self._clock() - window.started
        if window.suppressed:
            self.logger.warning(
                "suppressed %d similar warning%s (%s) in the last %.1f s",
                window.suppressed,
                "" if window.suppressed == 1 else "s",
                cause,
                elapsed_s,
            )

    def suppressed(self, cause: str) -> int:
        """Lines of ``cause`` dropped in its current window."""
        with self._lock:
            window = self._windows.get(cause)
            return window.suppressed if window is not None else 0


def report_suppressed() -> None:
    """Every limit's counts now (a stopping process: nothing dropped goes unsaid)."""
    for limit in list(_LIMITS):
        limit.report()
