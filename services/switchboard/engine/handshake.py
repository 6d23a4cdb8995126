"""Finding the gateways of an engine that runs on another host (Kubernetes).

The engine is given ``name:port``: a DNS name that lists every gateway (a headless Service
resolves to one address per gateway pod) and the gateways' fixed handshake port. Every
``interval_s`` the discovery thread resolves the name again and says hello to each address::

    engine DEALER ──GatewayHello──> gateway ROUTER (tcp://<address>:<handshake port>)
                  <─GatewayAddresses── (client_index, ROUTER port, PULL port, coordinator)

A gateway it has not met (or one whose ``gateway_id`` changed: it restarted) is handed to the
I/O threads, which connect a DEALER and a PUSH to the announced ports on that address and send
READY first. A gateway whose address left the name, or that failed ``MISSES_BEFORE_DROP``
hellos in a row, is dropped. Hellos are cheap (two small messages), so repeating them on every
round is what notices a restarted gateway.

``SWITCHBOARD_HOSTS_FILE`` names a file in /etc/hosts format consulted before DNS: for hosts
without a DNS server for the gateways, and for tests that add a gateway at a new loopback
address while the engine runs.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from switchboard.wire import zmq_channel
from switchboard.wire.codec import GATEWAY_ADDRESSES, GATEWAY_HELLO, DecodeError
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import GatewayAddresses, GatewayHello
from switchboard.wire.zmq_channel import tcp_address

logger = logging.getLogger(__name__)

HOSTS_FILE_ENV = "SWITCHBOARD_HOSTS_FILE"
HELLO_TIMEOUT_S = 2.0
MISSES_BEFORE_DROP = 2


@dataclass(frozen=True)
class GatewayEndpoint:
    """One gateway as an engine connects to it."""

    host: str  # the address the name resolved to
    gateway_id: str
    client_index: int
    input_address: str  # its ROUTER: the engine's DEALER connects here
    output_address: str  # its PULL: the engine's PUSH connects here
    coordinator_address: str


def split_host_port(target: str) -> tuple[str, int]:
    """``name:port`` or ``[v6]:port``."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"gateway address {target!r} is not NAME:PORT")
    return host.strip("[]"), int(port)


def _hosts_file_addresses(name: str) -> list[str] | None:
    path = os.environ.get(HOSTS_FILE_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        logger.warning("Cannot read %s=%s: %s", HOSTS_FILE_ENV, path, exc)
        return None
    found = []
    for line in lines:
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and name in fields[1:]:
            found.append(fields[0])
    return found or None


def resolve_addresses(name: str) -> list[str]:
    """Every address ``name`` resolves to, sorted; [] when it does not resolve (yet)."""
    from_file = _hosts_file_addresses(name)
    if from_file is not None:
        return sorted(set(from_file))
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        logger.warning("Cannot resolve gateway name %r: %s", name, exc)
        return []
    return sorted({str(info[4][0]) for info in infos})


def say_hello(
    ctx: zmq.SyncContext,
    host: str,
    port: int,
    hello: GatewayHello,
    timeout_s: float,
    curve: CurveKeys | None = None,
) -> GatewayAddresses | None:
    """One handshake with the gateway at ``host:port``; None when it does not answer in time."""
    address = tcp_address(host, port)
    sock = zmq_channel.make_socket(ctx, zmq.DEALER, address, bind=False, curve=curve)
    try:
        sock.send(GATEWAY_HELLO.encode(hello))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return GATEWAY_ADDRESSES.decode(sock.recv())
    except (DecodeError, zmq.ZMQError) as exc:
        logger.warning("Bad handshake answer from %s:%d: %s", host, port, exc)
        return None
    finally:
        sock.close(linger=0)


class GatewayDiscovery(threading.Thread):
    def __init__(
        self,
        ctx: zmq.SyncContext,
        target: str,
        hello: GatewayHello,
        on_added: Callable[[GatewayEndpoint], None],
        on_removed: Callable[[GatewayEndpoint], None],
        interval_s: float = 5.0,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(name="GatewayDiscovery", daemon=True)
        self._ctx = ctx
        self._curve = curve
        self.name, self.port = split_host_port(target)
        self._hello = hello
        self._on_added = on_added
        self._on_removed = on_removed
        self._interval_s = interval_s
        self._hello_timeout_s = hello_timeout_s
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._known: dict[str, GatewayEndpoint] = {}  # by host
        self._misses: dict[str, int] = {}

    @property
    def endpoints(self) -> list[GatewayEndpoint]:
        with self._lock:
            return list(self._known.values())

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_s)

    def run(self) -> None:
        logger.info(
            "Discovering gateways at %s:%d every %.1fs", self.name, self.port, self._interval_s
        )
        while not self._stop_event.is_set():
            try:
                self.discover_once()
            except Exception:  # discovery must outlive a bad round
                logger.exception("Gateway discovery round failed")
            self._stop_event.wait(self._interval_s)

    def discover_once(self) -> None:
        hosts = resolve_addresses(self.name)
        for host in [h for h in self._known if h not in hosts]:
            self._drop(host, f"{self.name} no longer resolves to it")
        for host in hosts:
            if self._stop_event.is_set():
                return
            answer = say_hello(
                self._ctx, host, self.port, self._hello, self._hello_timeout_s, self._curve
            )
            if answer is None:
                self._missed(host)
            else:
                self._answered(host, answer)

    def _missed(self, host: str) -> None:
        if host not in self._known:
            return
        self._misses[host] = self._misses.get(host, 0) + 1
        if self._misses[host] >= MISSES_BEFORE_DROP:
            self._drop(host, f"no answer to {MISSES_BEFORE_DROP} hellos")

    def _answered(self, host: str, answer: GatewayAddresses) -> None:
        self._misses.pop(host, None)
        known = self._known.get(host)
        if known is not None and known.gateway_id == answer.gateway_id:
            return
        if known is not None:
            self._drop(host, f"it restarted (now {answer.gateway_id})")
        endpoint = GatewayEndpoint(
            host=host,
            gateway_id=answer.gateway_id,
            client_index=answer.client_index,
            input_address=tcp_address(host, answer.input_port),
            output_address=tcp_address(host, answer.output_port),
            coordinator_address=answer.coordinator_address,
        )
        with self._lock:
            self._known[host] = endpoint
        logger.info(
            "Gateway %s at %s (client_index %d): connecting to %s and %s",
            endpoint.gateway_id,
            host,
            endpoint.client_index,
            endpoint.input_address,
            endpoint.output_address,
        )
        self._on_added(endpoint)

    def _drop(self, host: str, why: str) -> None:
        with self._lock:
            endpoint = self._known.pop(host)
        self._misses.pop(host, None)
        logger.warning("Dropping gateway %s at %s: %s", endpoint.gateway_id, host, why)
        self._on_removed(endpoint)
