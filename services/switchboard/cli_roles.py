"""`switchboard gateway`, `engine` and `coordinator`: one role per command, for other hosts.

The Kubernetes building blocks (docs/helm.md): gateway pods run ``switchboard gateway``,
engine pods ``switchboard engine --gateway-address <headless service>:<handshake port>``. The
gateway listens on a fixed handshake port and binds its data sockets on port 0; each engine
resolves the name, says hello to every address and connects to the ports it is told
(``engine/handshake.py``).
With DP > 1 one ``switchboard coordinator`` pod binds two fixed ports: engines push their load
to its load port and gateways subscribe to its report port (both given
``--coordinator-address NAME[:PORT]``; the port defaults to the role's side).
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
import os
import random
import re
import socket

import msgspec

from switchboard.config import EngineConfig, GatewayRoleConfig, encode_config
from switchboard.wire.zmq_channel import tcp_address

DEFAULT_HANDSHAKE_PORT = 50052
DEFAULT_DISCOVERY_INTERVAL_S = 5.0
DEFAULT_COORDINATOR_LOAD_PORT = 50053  # engines push EngineLoad here
DEFAULT_COORDINATOR_REPORT_PORT = 50054  # gateways subscribe to LoadReport here

logger = logging.getLogger("switchboard.cli")


CURVE_HELP = (
    "CURVE on every tcp:// ZeroMQ socket, keys from this directory (`switchboard keys "
    "generate DIR`; docs/architecture.md, Trust) (default: none: plain TCP, unauthenticated)"
)


def _add_curve_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument("--curve-keys-dir", default="", metavar="DIR", help=CURVE_HELP)


def add_keys_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["generate", "kubernetes-secret"],
        help="generate: write CURVE key pairs (gateway, coordinator, engine-<r> for each rank) "
        "and the allow-list directories allowed-engines/ and allowed-gateways/ into DIR; "
        "kubernetes-secret: keep the pairs in the Secret SECRET of this pod's namespace, as its "
        "service account (the Helm chart's hook Job): create it, add the pairs it lacks, "
        "replace them all when --generation is newer than the Secret's (docs/helm.md)",
    )
    p.add_argument(
        "target",
        metavar="DIR|SECRET",
        help="generate: the keys directory (created 0700); kubernetes-secret: the Secret's name",
    )
    p.add_argument("--engines", type=int, default=1, help="engine key pairs, one per DP rank")
    p.add_argument(
        "--generation",
        type=int,
        default=1,
        help="kubernetes-secret: the keys' generation; a Secret of an older one gets all new "
        "pairs (rotation)",
    )


def cmd_keys(args: argparse.Namespace) -> int:
    from switchboard.wire import curve

    if args.engines < 1:
        raise SystemExit(f"switchboard keys {args.action}: --engines must be at least 1")
    if args.generation < 1:
        raise SystemExit(f"switchboard keys {args.action}: --generation must be at least 1")
    if args.action == "kubernetes-secret":
        from switchboard import curve_secret

        try:
            api = curve_secret.KubeApi.in_cluster()
            print(curve_secret.store_keys(api, args.target, args.engines, args.generation))
        except (curve_secret.KeysSecretError, curve.CurveKeyError) as exc:
            raise SystemExit(f"switchboard keys kubernetes-secret: {exc}") from None
        return 0
    try:
        written = curve.generate(args.target, args.engines)
    except curve.CurveKeyError as exc:
        raise SystemExit(f"switchboard keys generate: {exc}") from None
    for path in written:
        print(path)
    return 0


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engines on other hosts")
    g.add_argument(
        "--engine-host",
        default="0.0.0.0",
        help="address the handshake port and the data sockets bind on (default: %(default)s, "
        "every interface)",
    )
    g.add_argument(
        "--handshake-port",
        type=int,
        default=DEFAULT_HANDSHAKE_PORT,
        help="fixed TCP port engines say hello to; the data sockets bind on port 0",
    )
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
    _add_curve_arg(g)
    g.add_argument(
        "--coordinator-address",
        default="",
        metavar="NAME[:PORT]",
        help="DP > 1: the `switchboard coordinator` whose load reports steer routing (PORT: "
        f"its --report-port, default {DEFAULT_COORDINATOR_REPORT_PORT}) (default: none; route "
        "on this gateway's own in-flight counts)",
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
        "--discovery-interval",
        type=float,
        default=DEFAULT_DISCOVERY_INTERVAL_S,
        metavar="S",
        help="seconds between two resolutions of --gateway-address (new gateways join then)",
    )
    _add_curve_arg(g)
    g.add_argument(
        "--coordinator-address",
        default="",
        metavar="NAME[:PORT]",
        help="DP > 1: the `switchboard coordinator` this engine reports its load to (PORT: its "
        f"--load-port, default {DEFAULT_COORDINATOR_LOAD_PORT}) (default: the one a gateway's "
        "handshake answer names, if any)",
    )


def add_coordinator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host",
        default="0.0.0.0",
        help="address both ports bind on (default: %(default)s, every interface)",
    )
    p.add_argument(
        "--load-port",
        type=int,
        default=DEFAULT_COORDINATOR_LOAD_PORT,
        help="engines push their waiting/running counts and KV usage here",
    )
    p.add_argument(
        "--report-port",
        type=int,
        default=DEFAULT_COORDINATOR_REPORT_PORT,
        help="gateways subscribe to the table of every engine's load here",
    )
    p.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines expected (the deployment's DP size; for its log lines)",
    )
    _add_curve_arg(p)


def coordinator_tcp_address(target: str, default_port: int) -> str:
    """``tcp://`` of ``NAME``, ``NAME:PORT``, ``[v6]`` or ``[v6]:PORT`` ("" stays "")."""
    if not target:
        return ""
    host, sep, port = target.rpartition(":")
    if not sep or "]" in port or (":" in host and not host.endswith("]")):
        host, port = target, str(default_port)  # no port given (a bare IPv6 address too)
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator address {target!r} is not NAME[:PORT]")
    return tcp_address(host, int(port))


def _keys_dir(args: argparse.Namespace) -> str:
    """``--curve-keys-dir`` as an absolute path ("" when not given); exits on a missing one."""
    path = str(args.curve_keys_dir or "")
    if not path:
        return ""
    if not os.path.isdir(path):
        raise SystemExit(f"--curve-keys-dir {path}: no such directory")
    return os.path.abspath(path)


def hostname_ordinal() -> int:
    match = re.search(r"-(\d+)$", socket.gethostname())
    return int(match.group(1)) if match else 0


def cmd_gateway(args: argparse.Namespace, gateway: GatewayRoleConfig) -> int:
    """Run one gateway in this process (``gateway``: the GatewayRoleConfig of the serve flags)."""
    from switchboard.gateway.__main__ import main as gateway_main

    client_index = args.client_index
    if client_index is None:
        client_index = random.SystemRandom().randrange(1 << 31)
    config = msgspec.structs.replace(
        gateway,
        client_index=client_index,
        input_address=tcp_address(args.engine_host, 0),
        output_address=tcp_address(args.engine_host, 0),
        handshake_address=tcp_address(args.engine_host, args.handshake_port),
        exit_when_engines_dead=False,
        heartbeat_timeout_s=args.engine_heartbeat_timeout,
        coordinator_publish_address=coordinator_tcp_address(
            args.coordinator_address, DEFAULT_COORDINATOR_REPORT_PORT
        ),
        curve_keys_dir=_keys_dir(args),
    )
    return gateway_main(["--config-json", encode_config(config)])


def cmd_engine(args: argparse.Namespace, engine: EngineConfig) -> int:
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
        coordinator_address=coordinator_tcp_address(
            args.coordinator_address, DEFAULT_COORDINATOR_LOAD_PORT
        ),
        curve_keys_dir=_keys_dir(args),
    )
    return engine_main(["--config-json", encode_config(config), "--log-level", args.log_level])


def cmd_coordinator(args: argparse.Namespace) -> int:
    """Run the coordinator in this process (DP > 1 across hosts): both ports on fixed TCP."""
    from switchboard.config import CoordinatorConfig
    from switchboard.coordinator.__main__ import main as coordinator_main

    config = CoordinatorConfig(
        input_address=tcp_address(args.host, args.load_port),
        publish_address=tcp_address(args.host, args.report_port),
        num_engines=args.data_parallel_size,
        curve_keys_dir=_keys_dir(args),
    )
    return coordinator_main(["--config-json", encode_config(config), "--log-level", args.log_level])
