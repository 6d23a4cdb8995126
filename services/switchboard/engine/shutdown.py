"""How an engine core is asked to stop: SIGTERM/SIGINT, or its parent process dying.

Either one sets a flag the busy loop checks each turn, and wakes the loop if it is blocked on
an empty input queue. ``__main__.run_engine_core`` installs the handlers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from switchboard.engine.io_threads import InputQueue
from switchboard.wire.engine_msgs import RequestType

logger = logging.getLogger(__name__)

PARENT_POLL_INTERVAL_S = 1.0


class ShutdownRequest:
    """Set from a signal handler or the parent watch; wakes an idle busy loop.

    A signal handler runs between two bytecodes of the main thread, which may be holding the
    input queue's (non-reentrant) lock, so the handler only sets flags; a watcher thread puts
    the WAKEUP item on the queue.
    """

    def __init__(self, input_queue: InputQueue) -> None:
        self.requested = False
        self.reason = ""
        self._input_queue = input_queue
        self._event = threading.Event()
        self._parent_pid = os.getppid()
        threading.Thread(target=self._watch, name="ShutdownWatch", daemon=True).start()

    def request(self, reason: str) -> None:
        if not self.requested:  # a second signal must not re-enter Event.set()
            self.requested = True
            self.reason = reason
            self._event.set()

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.request(signal.Signals(signum).name)

    def _watch(self) -> None:
        while not self._event.wait(PARENT_POLL_INTERVAL_S):
            if os.getppid() != self._parent_pid:
                logger.warning("Parent process %d is gone: shutting down", self._parent_pid)
                self.request("parent died")
        self._input_queue.put((RequestType.WAKEUP, None))
