"""Exit codes a child process reports to the supervisor that starts it.

``START_FAILED``: the process could not start serving (its model, configuration or device
refused it) and logged why. On a process's first start the supervisor does not restart it: a
second try would fail the same way, and a fresh machine's first command should end with the
cause on screen, not after a cycle of restarts. A process that already served once and then
fails its restart is on the ordinary restart budget (the cause may be passing: memory still
held by its dead predecessor's workers).
"""

from __future__ import annotations

START_FAILED = 3
