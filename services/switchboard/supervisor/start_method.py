"""How switchboard starts its processes, and the guard that keeps library use from fork-bombing.

Every child (gateway, engine core, coordinator, worker) is a fresh interpreter started with
``python -m switchboard.<role>``: the ``spawn`` start method in effect. Nothing of the parent's
state is inherited (no CUDA context, no locks, no threads), and no child re-imports the
caller's ``__main__``, so the children themselves can never recurse.

The caller's script can, though, when it also uses :mod:`multiprocessing` with ``spawn``
(the default on macOS and Windows, and required once CUDA is initialised): every spawned helper
re-imports the script as ``__mp_main__``, and a script that starts a server at import time
would start one more server per helper, each starting more. A library entry point therefore
calls :func:`require_main_process` first, and a script must keep its start-up under the guard::

    from switchboard.supervisor.launcher import serve

    if __name__ == "__main__":
        raise SystemExit(serve(gateway_config, engine_config))
"""

from __future__ import annotations

import multiprocessing
import sys

GUARD_HELP = (
    "switchboard was asked to start a server from a multiprocessing child process "
    "({detail}). This happens when a script starts switchboard at import time and is "
    "re-imported by multiprocessing's spawn start method, which would start one more server "
    "per child process. Put the start-up under the main guard:\n\n"
    '    if __name__ == "__main__":\n'
    "        serve(...)\n"
)


class MissingMainGuard(RuntimeError):
    """A server start-up from a spawned child: the caller's script lacks the main guard."""


def require_main_process() -> None:
    """Raise :class:`MissingMainGuard` when called from a multiprocessing child process."""
    main_module = sys.modules.get("__main__")
    if getattr(main_module, "__name__", "__main__") == "__mp_main__":
        raise MissingMainGuard(GUARD_HELP.format(detail="__main__ is being re-imported"))
    process = multiprocessing.current_process()
    if process.name != "MainProcess" or multiprocessing.parent_process() is not None:
        raise MissingMainGuard(GUARD_HELP.format(detail=f"process {process.name!r}"))
