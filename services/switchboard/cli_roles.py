"""`switchboard gateway` and `switchboard engine`: one role per command, for engines on other hosts.

The Kubernetes building blocks (DESIGN.md §1): gateway pods run ``switchboard gateway``, engine
pods ``switchboard engine --gateway-address <headless service>:<handshake port>``. The gateway
listens on a fixed handshake port and binds its data sockets on port 0; each engine resolves the
name, says hello to every address and connects to the ports it is told (``engine/handshake.py``).
Both take the flags of ``switchboard serve`` (a gateway needs the model directory for its
tokenizer, and ``-dp`` as the deployment's DP size for GetServerInfo; an engine the model,
cache, scheduler and parallelism flags).

Unlike ``serve``, a gateway here outlives its engines: it reports NOT_SERVING on the readiness
service while no engine is ready, fails a dead engine's requests with UNAVAILABLE, routes around
it, and re-admits it when its READY arrives again.
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import socket

import msgspec

from switchboard.config import encode_config

DEFAULT_HANDSHAKE_PORT = 50052
DEFAULT_DISCOVERY_INTERVAL_S = 5.0

logger = logging.getLogger("switchboard.cli")


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engines on other hosts")
    g.add_argument(
        "--engine-host",
        default="0.0.0.0",
        help="address the handshake port and the data sockets bind on (default all)",
    )
    g.add_argument("--handshake-port", type=int, default=DEFAULT_HANDSHAKE_PORT)
    g.add_argument(
        "--client-index",
        type=int,
        default=None,
        help="this gateway's index on the engines' wire (default: random, unique in practice)",
    )
    g.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="an engine silent this long (no output, no heartbeat) is dead",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateways on other hosts")
    g.add_argument(
        "--gateway-address",
        required=True,
        help="NAME:PORT: a DNS name listing every gateway (e.g. a headless Service) and their "
        "handshake port; re-resolved periodically",
    )
    g.add_argument(
        "--data-parallel-rank",
        type=int,
        default=None,
        help="this engine's DP rank (default: the ordinal ending the host name, as in a "
        "StatefulSet pod 'engine-3', else 0)",
    )
    g.add_argument(
        "--discovery-interval", type=float, default=DEFAULT_DISCOVERY_INTERVAL_S, metavar="S"
    )


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def hostname_ordinal() -> int:
    match = re.search(r"-(\d+)$", socket.gethostname())
    return int(match.group(1)) if match else 0


def cmd_gateway(args: argparse.Namespace, gateway) -> int:
    """Run one gateway in this process (``gateway``: the GatewayRoleConfig of the serve flags)."""
    from switchboard.gateway.__main__ import main as gateway_main

    client_index = args.client_index
    if client_index is None:
        client_index = random.SystemRandom().randrange(1 << 31)
    config = msgspec.structs.replace(
        gateway,
        client_index=client_index,
        input_address=_tcp(args.engine_host, 0),
        output_address=_tcp(args.engine_host, 0),
        handshake_address=_tcp(args.engine_host, args.handshake_port),
        exit_when_engines_dead=False,
        heartbeat_timeout_s=args.engine_heartbeat_timeout,
    )
    return gateway_main(["--config-json", encode_config(config)])


def cmd_engine(args: argparse.Namespace, engine) -> int:
    """Run one engine core (and its workers) in this process."""
    from switchboard.engine.__main__ import main as engine_main
    from switchboard.engine.handshake import split_host_port

    split_host_port(args.gateway_address)  # fail now on a malformed address
    rank = args.data_parallel_rank
    if rank is None:
        rank = hostname_ordinal()
    config = msgspec.structs.replace(
        engine,
        data_parallel_rank=rank,
        gateway_discovery=args.gateway_address,
        discovery_interval_s=args.discovery_interval,
    )
    return engine_main(["--config-json", encode_config(config), "--log-level", args.log_level])
