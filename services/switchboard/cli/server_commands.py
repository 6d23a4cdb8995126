"""The server commands (serve, gateway, engine, coordinator, keys, topology): their parsers,
built from the flags the configs declare, and what each runs. Imported only where the `server`
extra is installed."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from switchboard.cli import role_commands, serve
from switchboard.cli.struct_flags import Layout, add_flags
from switchboard.common.flags import Group
from switchboard.config import ParallelConfig

# `switchboard topology` sizes a deployment by its parallel sizes and gateway count.
TOPOLOGY = Layout(
    (ParallelConfig,), (Group.PARALLEL, Group.GATEWAY), frozenset({Group.PARALLEL, Group.GATEWAY})
)


def add_server_commands(command: Callable[[str], argparse.ArgumentParser]) -> None:
    """Add each server command's parser, made by ``command(name)``."""
    parser = command("serve")
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as vLLM's `vllm serve MODEL`: the same as --model",
    )
    add_flags(parser, serve.SERVE)
    parser.set_defaults(run=serve.run_serve)
    for name, layout in (("gateway", role_commands.GATEWAY), ("engine", role_commands.ENGINE)):
        parser = command(name)
        add_flags(parser, layout)
        parser.set_defaults(run=run_role)
    parser = command("coordinator")
    add_flags(parser, role_commands.COORDINATOR)
    parser.set_defaults(run=lambda _, args: role_commands.cmd_coordinator(args))
    parser = command("keys")
    role_commands.add_keys_args(parser)
    parser.set_defaults(run=lambda _, args: role_commands.cmd_keys(args))
    parser = command("topology")
    add_flags(parser, TOPOLOGY)
    parser.set_defaults(run=run_topology)


def run_role(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`switchboard gateway` / `switchboard engine`: one role in this process."""
    gateway, engine = serve.prepare(parser, args)
    if args.command == "gateway":
        return role_commands.cmd_gateway(args, gateway)
    return role_commands.cmd_engine(args, engine)


def run_topology(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from switchboard.supervisor.processes import Topology, format_topology

    topology = Topology(
        api_servers=args.api_servers or args.data_parallel_size,
        data_parallel=args.data_parallel_size,
        pipeline_parallel=args.pipeline_parallel_size,
        tensor_parallel=args.tensor_parallel_size,
    )
    print(format_topology(topology))
    return 0
