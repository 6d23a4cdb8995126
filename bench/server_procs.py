"""The server side of bench/vs_vllm.py: starting a server in a session of its own, waiting for
it to be ready (gRPC health for switchboard, GET /v1/models for vLLM, GET /health for
llama.cpp), stopping its whole process tree, and a sampler of that tree's CPU time and RSS from
/proc.

Not run by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path

import grpc
import vllm_http  # bench/vllm_http.py, beside this file
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_clients import HOST

from switchboard.supervisor.processes import descendants

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
SAMPLE_EVERY_S = 0.5


def free_port() -> int:
    """A free port below the kernel's ephemeral range (``free_port_run``)."""
    return free_port_run(1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def free_port_run(count: int, avoid: Collection[int] = ()) -> int:
    """A port P with P .. P + count - 1 all free (gateways that serve on consecutive ports),
    taken below the kernel's ephemeral range: a port there is not handed to some other
    socket's connect or bind-to-0 between this look and the server's bind (P + 1 next to a free
    ephemeral port was, once: "address already in use")."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    pick = random.Random()
    for _ in range(1000):
        port = pick.randrange(10_000, max(10_001, low - count))
        ports = range(port, port + count)
        if not any(p in avoid for p in ports) and all(_bindable(p) for p in ports):
            return port
    raise RuntimeError(f"no run of {count} free ports below {low}")


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # [0] state, [1] ppid, [2] pgrp, ...


@dataclasses.dataclass
class Server:
    kind: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    started: float
    known: dict[int, str] = dataclasses.field(default_factory=dict)  # pid -> start time

    def track(self) -> None:
        """Remember the server's process tree (switchboard's children run in sessions of their
        own, so its process group is not all of it)."""
        for pid in descendants(self.proc.pid) | {self.proc.pid}:
            try:
                self.known.setdefault(pid, _stat_fields(pid)[19])
            except (OSError, IndexError):
                continue

    def alive(self) -> list[int]:
        """Known processes still running, and any other live member of the server's group."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                pid = int(entry)
                try:
                    fields = _stat_fields(pid)
                except (OSError, IndexError):
                    continue
                ours = self.known.get(pid) == fields[19] or int(fields[2]) == self.proc.pid
                if ours and fields[0] != "Z":  # a zombie is done
                    found.append(pid)
        return found

    def stop(self) -> None:
        """SIGTERM to the server's process group, then SIGKILL after 60 s to whatever of its
        processes is left. Signals only processes this run started."""
        if self.proc.poll() is None:
            self.track()
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:  # the launched process is gone: what it left behind
            self._signal(self.alive(), signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (left := self.alive()) and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.2)
        if left := self.alive():
            print(f"{self.kind}: {len(left)} processes left after 60 s; SIGKILL", flush=True)
            self._signal(left, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    @staticmethod
    def _signal(pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


_STARTED: list[Server] = []  # stopped at exit whatever happens


def stop_all() -> None:
    """Stop every server this run started (those already stopped have nothing left to stop)."""
    for server in _STARTED:
        server.stop()


def start(kind: str, cmd: list[str], env: dict[str, str], log: Path, port: int) -> Server:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log.parent,
            start_new_session=True,
        )
    server = Server(kind, proc, port, log, time.perf_counter())
    _STARTED.append(server)
    return server


def revision_tree(root: Path, rev: str, parent: Path) -> Path:
    """Git revision REV of the repository at ``root``: its services/ and bench/ under
    ``parent``; returns its services folder (put first on PYTHONPATH, a server of that
    revision; its kernels build into a cache entry of their own)."""
    tree = parent / rev.replace("/", "_")
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "services", "bench"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree / "services"


def with_services(env: dict[str, str], services: Path | None) -> dict[str, str]:
    """``env`` serving the code under ``services`` (a ``revision_tree``), when given."""
    if services is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(services), env.get("PYTHONPATH")]))
    return env


def switchboard_command() -> list[str]:
    if importlib.util.find_spec("switchboard.cli") is not None:
        return [sys.executable, "-m", "switchboard.cli"]
    return [str(Path(sys.executable).with_name("switchboard"))]


async def sb_ready(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service="switchboard.v1.GenerationService")
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=2)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def vllm_ready(port: int) -> bool:
    return await vllm_http.http_status(HOST, port, "/v1/models") == 200


async def llamacpp_ready(port: int) -> bool:
    return await vllm_http.http_status(HOST, port, "/health") == 200  # 503 while loading


READY_CHECKS = {"switchboard": sb_ready, "vllm": vllm_ready, "llamacpp": llamacpp_ready}
ROOT_PROCESS = {"switchboard": "launcher", "vllm": "APIServer", "llamacpp": "llama-server"}


async def wait_ready(server: Server) -> float:
    check = READY_CHECKS[server.kind]
    while not await check(server.port):
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"{server.kind} exited ({server.proc.returncode}) before it was ready; "
                f"{server.log}:\n{server.tail()}"
            )
        if time.perf_counter() - server.started > READY_TIMEOUT_S:
            raise TimeoutError(f"{server.kind} not ready after {READY_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.5)
    server.track()
    return time.perf_counter() - server.started


def process_name(pid: int, root: int, kind: str) -> str:
    """switchboard::Gateway_0 -> Gateway_0, VLLM::EngineCore -> EngineCore; the root of the tree
    is switchboard's launcher, vLLM's API server or llama.cpp's server; anything else by its
    comm."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().replace(b"\0", b" ").decode(errors="replace").split()
    if args and "::" in args[0]:
        return args[0].split("::", 1)[1]
    if pid == root:
        return ROOT_PROCESS[kind]
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


class TreeSampler:
    """CPU time and RSS of a process tree, sampled from /proc in a thread."""

    TICK = os.sysconf("SC_CLK_TCK")
    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, root: int, kind: str) -> None:
        self.root, self.kind = root, kind
        self.names: dict[int, str] = {}
        self.base = self._snapshot()
        self.last = dict(self.base)
        self.rss: dict[str, float] = {}
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _snapshot(self) -> dict[int, tuple[int, int]]:
        """pid -> (utime + stime ticks, rss bytes)."""
        snap = {}
        for pid in descendants(self.root) | {self.root}:
            try:
                fields = _stat_fields(pid)
                if pid not in self.names:
                    self.names[pid] = process_name(pid, self.root, self.kind)
            except (OSError, IndexError):
                continue
            snap[pid] = (int(fields[11]) + int(fields[12]), int(fields[21]) * self.PAGE)
        return snap

    def _take(self) -> None:
        for pid, (ticks, rss) in self._snapshot().items():
            self.last[pid] = (ticks, rss)
            name = self.names[pid]
            self.rss[name] = max(self.rss.get(name, 0.0), rss / 2**20)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self._take()

    def finish(self) -> tuple[dict[str, float], dict[str, float], float]:
        """CPU % per process name over the time sampled, peak RSS MB, this process's CPU %."""
        self._stop.set()
        self._thread.join()
        self._take()
        wall = time.perf_counter() - self.wall0
        client = 100 * (time.process_time() - self.cpu0) / wall
        cpu: dict[str, float] = {}
        for pid, (ticks, _) in self.last.items():
            used = ticks - self.base.get(pid, (0, 0))[0]
            name = self.names[pid]
            cpu[name] = cpu.get(name, 0.0) + 100 * used / self.TICK / wall
        return cpu, self.rss, client
