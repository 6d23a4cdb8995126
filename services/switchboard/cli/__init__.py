"""The `switchboard` command: serve | gateway | engine | coordinator | keys | topology |
generate | chat | ps (``commands.py``).

The server commands' flags are declared on the config fields they set (``switchboard.common.flags``)
and turned into parsers by ``struct_flags.py``; the client commands (generate, chat, ps) run on
the client install, without the server's packages.
"""

from switchboard.cli.commands import main, make_parser
from switchboard.cli.help import HelpFormatter

__all__ = ["HelpFormatter", "main", "make_parser"]
