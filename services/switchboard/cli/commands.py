"""The `switchboard` command: serve | gateway | engine | coordinator | keys | topology |
generate | chat | ps.

Flag names follow vLLM's where the concept is the same, so a vLLM user's command line works.
"""

# This module imports only the standard library at the top: the client commands (generate,
# chat) run on the client install (grpcio + protobuf, `pip install switchboard`); the server
# commands' flags come from the configs (msgspec), so they are added only where the `server`
# extra is installed, and without it each says how to get it.

from __future__ import annotations

import argparse
import logging
import sys

from switchboard.cli import client_commands
from switchboard.cli.help import HelpFormatter

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SERVER_COMMANDS = {
    "serve": "start gateway, engine core and workers on this machine",
    "gateway": "run one gateway; engines on other hosts join it",
    "engine": "run one engine core and its workers for gateways",
    "coordinator": "run the coordinator for engines and gateways on other hosts (DP > 1)",
    "keys": "make the CURVE keys that authenticate gateways, engines and coordinator over TCP",
    "topology": "print the process table of a topology",
}
SERVER_INSTALL_HINT = "pip install 'switchboard[server]'"


def _server_import_error() -> ImportError | None:
    """Why the server commands cannot run here (the client install lacks the ``server``
    extra), or None."""
    try:
        import switchboard.cli.server_commands  # noqa: F401  (msgspec, pyzmq)
    except ImportError as exc:
        return exc
    return None


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchboard", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="this process's log level (under serve the children log at INFO; workers read "
        "$SWITCHBOARD_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)

    missing = _server_import_error()
    if missing is None:
        from switchboard.cli.server_commands import add_server_commands

        add_server_commands(lambda name: command(name, SERVER_COMMANDS[name]))
    else:  # the client install: the server commands only say how to get them
        for name, text in SERVER_COMMANDS.items():
            stub = command(name, f"{text} (needs the server: {SERVER_INSTALL_HINT})")
            stub.set_defaults(server_missing=missing)

    client_commands.add_generate(
        command(
            "generate",
            "stream a raw completion of the prompt text from a running server (no chat "
            "template: to talk to an instruct model, use `switchboard chat`)",
        )
    )
    client_commands.add_chat(
        command(
            "chat",
            "chat with a running server's model through its chat template: interactive "
            "(history kept; Ctrl-C ends the answer, Ctrl-D leaves), or one question given on "
            "the command line",
        )
    )
    client_commands.add_ps(command("ps", "list running switchboard processes"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args, unknown = parser.parse_known_args(argv)
    missing = getattr(args, "server_missing", None)
    if unknown and missing is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    if missing is not None:  # a server command on the client install
        print(
            f"switchboard {args.command}: the server is not installed in this environment "
            f"({missing}); install it with {SERVER_INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    code: int = args.run(parser, args)
    return code
