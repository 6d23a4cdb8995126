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
from typing import Annotated

import msgspec

from switchboard.cli.serve import FRONT_SECTIONS, SHARED_SECTIONS, SHARED_STRUCTS
from switchboard.cli.struct_flags import Layout, build
from switchboard.common.flags import Flag, Group
from switchboard.config import (
    CoordinatorConfig,
    EngineConfig,
    GatewayRoleConfig,
    encode_config,
)
from switchboard.wire.zmq_channel import tcp_address

DEFAULT_HANDSHAKE_PORT = 50052
DEFAULT_COORDINATOR_LOAD_PORT = 50053  # engines push EngineLoad here
DEFAULT_COORDINATOR_REPORT_PORT = 50054  # gateways subscribe to LoadReport here

logger = logging.getLogger("switchboard.cli")


class GatewayRoleFlags(msgspec.Struct, frozen=True, kw_only=True):
    """`switchboard gateway`'s flags that the gateway's addresses are made of."""

    engine_host: Annotated[
        str,
        Flag(
            "address the handshake port and the data sockets bind on (default: %(default)s, "
            "every interface)",
            Group.ENGINES_ELSEWHERE,
        ),
    ] = "0.0.0.0"
    handshake_port: Annotated[
        int,
        Flag(
            "fixed TCP port engines say hello to; the data sockets bind on port 0",
            Group.ENGINES_ELSEWHERE,
        ),
    ] = DEFAULT_HANDSHAKE_PORT
    coordinator_address: Annotated[
        str,
        Flag(
            "DP > 1: the `switchboard coordinator` whose load reports steer routing (PORT: "
            f"its --report-port, default {DEFAULT_COORDINATOR_REPORT_PORT}) (default: none; "
            "route on this gateway's own in-flight counts)",
            Group.ENGINES_ELSEWHERE,
            metavar="NAME[:PORT]",
        ),
    ] = ""


class EngineRoleFlags(msgspec.Struct, frozen=True, kw_only=True):
    """`switchboard engine`'s flag that an address is made of."""

    coordinator_address: Annotated[
        str,
        Flag(
            "DP > 1: the `switchboard coordinator` this engine reports its load to (PORT: its "
            f"--load-port, default {DEFAULT_COORDINATOR_LOAD_PORT}) (default: the one a "
            "gateway's handshake answer names, if any)",
            Group.GATEWAYS_ELSEWHERE,
            metavar="NAME[:PORT]",
        ),
    ] = ""


class CoordinatorFlags(msgspec.Struct, frozen=True, kw_only=True):
    """`switchboard coordinator`'s flags that its two addresses are made of."""

    host: Annotated[
        str,
        Flag(
            "address both ports bind on (default: %(default)s, every interface)",
            Group.COORDINATOR,
        ),
    ] = "0.0.0.0"
    load_port: Annotated[
        int,
        Flag("engines push their waiting/running counts and KV usage here", Group.COORDINATOR),
    ] = DEFAULT_COORDINATOR_LOAD_PORT
    report_port: Annotated[
        int,
        Flag("gateways subscribe to the table of every engine's load here", Group.COORDINATOR),
    ] = DEFAULT_COORDINATOR_REPORT_PORT


GATEWAY = Layout(
    (*SHARED_STRUCTS, GatewayRoleFlags, GatewayRoleConfig),
    (*FRONT_SECTIONS, Group.ENGINES_ELSEWHERE),
    frozenset({Group.CHAT_TEMPLATE}),
)
ENGINE = Layout(
    (*SHARED_STRUCTS, GatewayRoleConfig, EngineConfig, EngineRoleFlags),
    (*SHARED_SECTIONS, Group.GATEWAYS_ELSEWHERE),
)
COORDINATOR = Layout(
    (CoordinatorFlags, CoordinatorConfig), (Group.COORDINATOR,), frozenset({Group.COORDINATOR})
)


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
        from switchboard.cli import curve_secret

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


def _check_keys_dir(args: argparse.Namespace) -> None:
    """Exits on a ``--curve-keys-dir`` that is not a directory."""
    path = args.curve_keys_dir
    if path and not os.path.isdir(path):
        raise SystemExit(f"--curve-keys-dir {path}: no such directory")


def hostname_ordinal() -> int:
    match = re.search(r"-(\d+)$", socket.gethostname())
    return int(match.group(1)) if match else 0


def cmd_gateway(args: argparse.Namespace, gateway: GatewayRoleConfig) -> int:
    """Run one gateway in this process (``gateway``: the GatewayRoleConfig of its flags)."""
    from switchboard.gateway.__main__ import main as gateway_main

    _check_keys_dir(args)
    flags = build(GatewayRoleFlags, args)
    client_index = args.client_index
    if client_index is None:
        client_index = random.SystemRandom().randrange(1 << 31)
    config = msgspec.structs.replace(
        gateway,
        client_index=client_index,
        input_address=tcp_address(flags.engine_host, 0),
        output_address=tcp_address(flags.engine_host, 0),
        handshake_address=tcp_address(flags.engine_host, flags.handshake_port),
        exit_when_engines_dead=False,
        coordinator_publish_address=coordinator_tcp_address(
            flags.coordinator_address, DEFAULT_COORDINATOR_REPORT_PORT
        ),
    )
    return gateway_main(["--config-json", encode_config(config)])


def cmd_engine(args: argparse.Namespace, engine: EngineConfig) -> int:
    """Run one engine core (and its workers) in this process."""
    from switchboard.engine.__main__ import main as engine_main
    from switchboard.engine.handshake import split_host_port

    split_host_port(engine.gateway_discovery)  # fail now on a malformed address
    _check_keys_dir(args)
    rank = args.data_parallel_rank
    if rank is None:
        rank = hostname_ordinal()
    config = msgspec.structs.replace(
        engine,
        data_parallel_rank=rank,
        coordinator_address=coordinator_tcp_address(
            build(EngineRoleFlags, args).coordinator_address, DEFAULT_COORDINATOR_LOAD_PORT
        ),
    )
    return engine_main(["--config-json", encode_config(config), "--log-level", args.log_level])


def cmd_coordinator(args: argparse.Namespace) -> int:
    """Run the coordinator in this process (DP > 1 across hosts): both ports on fixed TCP."""
    from switchboard.coordinator.__main__ import main as coordinator_main

    _check_keys_dir(args)
    flags = build(CoordinatorFlags, args)
    config = build(
        CoordinatorConfig,
        args,
        input_address=tcp_address(flags.host, flags.load_port),
        publish_address=tcp_address(flags.host, flags.report_port),
    )
    return coordinator_main(["--config-json", encode_config(config), "--log-level", args.log_level])
