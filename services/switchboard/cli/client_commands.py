"""The commands of the client install (`pip install switchboard`): generate, chat, ps. Standard
library at the top: their modules are imported when they run."""

import argparse

from switchboard.common.defaults import DEFAULT_GRPC_PORT


def _add_client_args(
    parser: argparse.ArgumentParser, *, max_tokens: int, max_tokens_help: str
) -> None:
    """What the client commands (generate, chat) share: where the server is, how much to say."""
    parser.add_argument(
        "--target", default=f"127.0.0.1:{DEFAULT_GRPC_PORT}", help="the gateway's HOST:PORT"
    )
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help)
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the model's generation_config.json, else 1.0)",
    )


def add_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the text to complete, sent as is")
    _add_client_args(parser, max_tokens=64, max_tokens_help="output tokens at most")
    parser.set_defaults(run=run_generate)


def run_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from switchboard.cli import client

    return client.run_generate(
        args.target,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )


def add_chat(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "message",
        nargs="?",
        default=None,
        help="ask this, print the answer and exit (default: an interactive chat)",
    )
    _add_client_args(parser, max_tokens=512, max_tokens_help="tokens per answer at most")
    parser.add_argument(
        "--system",
        default=None,
        help="a system message opening the chat (default: none; the template may add its own)",
    )
    parser.set_defaults(run=run_chat)


def run_chat(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from switchboard.cli import chat_client

    return chat_client.run_chat(
        args.target,
        args.message,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        system=args.system,
    )


def add_ps(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pid",
        type=int,
        default=None,
        help="only this process and its descendants (default: every switchboard process)",
    )
    parser.set_defaults(run=run_ps)


def run_ps(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from switchboard.supervisor.processes import format_ps, list_processes

    print(format_ps(list_processes(args.pid)))
    return 0
