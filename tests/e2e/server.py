"""Start and stop a real `switchboard serve` for end-to-end tests."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READINESS_SERVICE = "switchboard.v1.GenerationService"


def descendants(pid: int) -> list[int]:
    """Pids of every process below ``pid`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port() -> int:
    """A port free now, below the kernel's range for outgoing connections when it can: a port
    from that range (what binding port 0 gives) may be taken by any process's outgoing
    connection between this check and the server's bind, which failed a run with "address
    already in use" on the HTTP port."""
    try:
        with open(EPHEMERAL_PORTS) as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    if ephemeral_low > 12_000:
        for _ in range(100):
            port = random.randrange(10_000, ephemeral_low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    target: str
    run_base: Path  # SWITCHBOARD_RPC_BASE_PATH: the server's run directory is created in here
    log_path: Path
    leftovers: list[str] | None = None  # what stop() found in run_base (must be nothing)
    http_url: str = ""  # the OpenAI-compatible HTTP API of gateway 0 ("" = started without)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def titled_processes(self) -> dict[str, int]:
        """switchboard:: title -> pid, for the processes this server started."""
        found = {}
        for pid in descendants(self.process.pid):
            title = process_title(pid)
            if title.startswith("switchboard::"):
                found[title.split()[0]] = pid
        return found

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def health(self, service: str = READINESS_SERVICE) -> int:
        with self.channel() as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the supervisor and wait; returns its exit code. Records what the server left
        in its run base in ``leftovers`` and removes the base."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"server did not stop within {timeout}s\n{self.log()}") from None
        finally:
            self.leftovers = sorted(p.name for p in self.run_base.iterdir())
            shutil.rmtree(self.run_base, ignore_errors=True)


def _free_port_apart(taken: list[int], apart: int = 8) -> int:
    """A free port at least ``apart`` from each of ``taken``."""
    for _ in range(100):
        port = free_port()
        if all(abs(port - other) >= apart for other in taken):
            return port
    raise RuntimeError(f"no free port {apart} apart from {taken}")


def start_server(
    model_dir: str | None,
    workdir: Path,
    *extra_args: str,
    ready_timeout: float = 180.0,
    python: str = sys.executable,
) -> RunningServer:
    """Start `switchboard serve` (model_dir None: the built-in default model) on a free port and
    wait until it reports SERVING for generation. The HTTP API gets a free port too (unless
    ``extra_args`` choose one): never the default 8000, which parallel runs would share.
    ``python``: the interpreter that runs it (another virtual environment's, say)."""
    # gateway i binds --http-port + i and --metrics-port + i: keep the ports 8 apart (the most
    # gateways a test starts), which serve checks before it starts anything
    taken = [int(extra_args[i + 1]) for i, a in enumerate(extra_args) if a == "--metrics-port"]
    port = _free_port_apart(taken)
    http_args: list[str] = []
    if "--http-port" not in extra_args:
        http_args = ["--http-port", str(_free_port_apart([*taken, port]))]
    args = [*http_args, *extra_args]
    http_port = int(args[args.index("--http-port") + 1])
    # ipc:// paths must stay under 107 bytes: a short base in /tmp, not pytest's deep tmp_path.
    run_base = Path(tempfile.mkdtemp(prefix="sb-"))
    log_path = workdir / "server.log"
    env = dict(os.environ, SWITCHBOARD_RPC_BASE_PATH=str(run_base), PYTHONUNBUFFERED="1")
    model_args = ["--model", model_dir] if model_dir else []
    cmd = [python, "-m", "switchboard.cli", "serve", *model_args,
           "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, f"127.0.0.1:{port}", run_base, log_path)
    if http_port >= 0:
        server.http_url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}\n{server.log()}")
        try:
            if server.health() == health_pb2.HealthCheckResponse.SERVING:
                return server
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    server.stop()
    raise AssertionError(f"server not ready within {ready_timeout}s\n{server.log()}")


def served(model_dir: str | None, workdir: Path, *extra_args: str) -> Iterator[RunningServer]:
    """The body of a server fixture (``yield from``): start, hand over, then check that it
    stopped cleanly and left nothing in its run directory."""
    server = start_server(model_dir, workdir, *extra_args)
    yield server
    code = server.stop()
    assert code == 0, server.log()
    assert server.leftovers == [], "the run directory must be removed"


def wait_until(
    condition: Callable[[], bool], what: str, timeout_s: float = 60.0, interval_s: float = 0.05
) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(interval_s)
