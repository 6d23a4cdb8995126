"""Benchmark wire 2's transport: the shared-memory ring vs multiprocessing.Queue vs ZeroMQ PUB/SUB.

    python bench/ring.py            # about a minute
    python bench/ring.py --quick    # fewer messages, 2 s idle window

For 1 and 2 reader processes and 1 KiB, 64 KiB and 4 MiB messages it measures
- broadcast latency: the writer stamps CLOCK_MONOTONIC into each message, every reader takes the
  difference once the receive call has returned the bytes; the writer waits for every reader's
  ack plus 1 ms before the next message, so readers are idle when it arrives (the engine-step
  pattern: workers wait while the engine core schedules);
- throughput: messages sent back to back, until the last reader has the last one;
- idle CPU: process CPU seconds (user + system, all threads, from the reader's own getrusage)
  while a reader waits for a message that does not come, right after it received one.

multiprocessing.Queue gets one queue per reader (the writer puts each message into every queue).
ZeroMQ is an ipc:// XPUB/SUB pair with unbounded queues. "vLLM-style spin" is our ring with its
spin window set to vLLM's 1 s, to show what spinning after each message costs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import resource
import shutil
import struct
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

from switchboard.wire import shm_ring
from switchboard.wire.shm_ring import ShmRingReader, ShmRingWriter

CTX = mp.get_context("spawn")
STAMP = struct.Struct("<q")
WAIT_S = 60.0
GAP_S = 0.001
SIZES = {"1 KiB": 1024, "64 KiB": 64 * 1024, "4 MiB": 4 * 1024 * 1024}
RING, QUEUE, ZMQ = "shm ring", "mp.Queue", "zmq PUB/SUB"
VLLM_SPIN = "vLLM-style spin"
# (latency messages, throughput messages) per size, full and --quick.
COUNTS = {False: {"1 KiB": (1000, 20000), "64 KiB": (1000, 5000), "4 MiB": (150, 200)},
          True: {"1 KiB": (100, 1000), "64 KiB": (100, 400), "4 MiB": (15, 20)}}  # fmt: skip


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- reader side (child processes) ----


class _Inbox:
    """One reader's end of a transport; ``recv`` returns None on timeout."""

    def __init__(self, kind: str, endpoint: Any, rank: int) -> None:
        self.kind = kind
        if kind == RING:
            self.reader = ShmRingReader(endpoint, rank)
        elif kind == QUEUE:
            self.queue = endpoint
        else:
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.SUB)
            self.sock.setsockopt(zmq.RCVHWM, 0)
            self.sock.setsockopt(zmq.SUBSCRIBE, b"")
            self.sock.connect(endpoint)

    def recv(self, timeout: float) -> bytes | None:
        if self.kind == RING:
            try:
                return self.reader.dequeue(timeout=timeout)
            except TimeoutError:
                return None
        if self.kind == QUEUE:
            try:
                return self.queue.get(timeout=timeout)
            except queue.Empty:
                return None
        return self.sock.recv() if self.sock.poll(int(timeout * 1000)) else None

    def must_recv(self) -> bytes:
        data = self.recv(WAIT_S)
        if data is None:
            raise TimeoutError(f"{self.kind}: no message within {WAIT_S} s")
        return data

    def close(self) -> None:
        if self.kind == RING:
            self.reader.close()
        elif self.kind == ZMQ:
            self.sock.close(linger=0)
            self.ctx.term()


def _reader_main(kind: str, endpoint: Any, rank: int, ctrl: Connection, spin_s: float) -> None:
    shm_ring.READER_SPIN_S = spin_s
    inbox = _Inbox(kind, endpoint, rank)
    ctrl.send("attached")
    while True:
        command, arg = ctrl.recv()
        if command == "latency":
            for _ in range(arg):
                message = inbox.must_recv()
                ctrl.send_bytes(STAMP.pack(time.perf_counter_ns() - STAMP.unpack_from(message)[0]))
        elif command == "throughput":
            ctrl.send("ready")
            for _ in range(arg):
                inbox.must_recv()
            ctrl.send(time.perf_counter_ns())
        elif command == "idle":
            inbox.must_recv()  # the wake-up message: idle starts right after a message
            before = _cpu_s()
            if inbox.recv(arg) is not None:
                raise RuntimeError("a message arrived during the idle window")
            ctrl.send(_cpu_s() - before)
        else:
            break
    inbox.close()


# ---- writer side (this process) ----


class _Group:
    """One writer and its reader processes over one transport."""

    def __init__(self, kind: str, n_readers: int, run_dir: str, spin_s: float | None = None):
        self.kind, self.n_readers = kind, n_readers
        if kind == RING:
            self.ring = ShmRingWriter(n_readers, run_dir)
            endpoints = [self.ring.handle] * n_readers
        elif kind == QUEUE:
            self.queues = [CTX.Queue() for _ in range(n_readers)]
            endpoints = self.queues
        else:
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.XPUB)
            self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.sock.setsockopt(zmq.SNDHWM, 0)
            address = f"ipc://{run_dir}/zmq-{n_readers}"
            self.sock.bind(address)
            endpoints = [address] * n_readers
        self.ctrls: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        spin = shm_ring.READER_SPIN_S if spin_s is None else spin_s
        for rank, endpoint in enumerate(endpoints):
            mine, theirs = CTX.Pipe()
            proc = CTX.Process(
                target=_reader_main, args=(kind, endpoint, rank, theirs, spin), daemon=True
            )
            proc.start()
            self.ctrls.append(mine)
            self.procs.append(proc)

    def wait_ready(self) -> None:
        for ctrl in self.ctrls:
            if not ctrl.poll(WAIT_S):
                raise TimeoutError(f"{self.kind}: a reader did not start")
            ctrl.recv()
        if self.kind == RING:
            self.ring.wait_for_readers(WAIT_S)
        elif self.kind == ZMQ:  # slow joiner: publish only once every SUB has subscribed
            for _ in range(self.n_readers):
                if not self.sock.poll(int(WAIT_S * 1000)):
                    raise TimeoutError("zmq: a reader did not subscribe")
                self.sock.recv()

    def send(self, data: bytes | bytearray) -> None:
        if self.kind == RING:
            self.ring.enqueue(data, timeout=WAIT_S)
        elif self.kind == QUEUE:
            for q in self.queues:
                q.put(data)
        else:
            self.sock.send(data)

    def command(self, command: str, arg: Any) -> None:
        for ctrl in self.ctrls:
            ctrl.send((command, arg))

    def replies(self) -> list[Any]:
        out = []
        for ctrl in self.ctrls:
            if not ctrl.poll(WAIT_S):
                raise TimeoutError(f"{self.kind}: a reader did not answer")
            out.append(ctrl.recv())
        return out

    def latency_us(self, size: int, count: int) -> list[float]:
        self.command("latency", count)
        samples = []
        for _ in range(count):
            payload = bytearray(size)  # fresh: mp.Queue pickles it later, in its feeder thread
            STAMP.pack_into(payload, 0, time.perf_counter_ns())
            self.send(payload)
            samples += [STAMP.unpack(ctrl.recv_bytes())[0] / 1000 for ctrl in self.ctrls]
            time.sleep(GAP_S)
        return samples

    def throughput(self, size: int, count: int) -> float:
        """Messages per second until the last reader has the last message."""
        self.command("throughput", count)
        self.replies()  # every reader is now waiting in its receive call
        payload = bytes(size)
        started = time.perf_counter_ns()
        for _ in range(count):
            self.send(payload)
        finished = max(self.replies())
        return count / ((finished - started) / 1e9)

    def close(self) -> None:
        self.command("stop", None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        if self.kind == RING:
            self.ring.close()
        elif self.kind == QUEUE:
            for q in self.queues:
                q.close()
                q.join_thread()
        else:
            self.sock.close(linger=0)
            self.ctx.term()


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ratio(x: float, ours: float) -> str:
    return f"{x / ours:6.2f}x"


def _print_latency_and_throughput(groups: dict[tuple[str, int], _Group], quick: bool) -> None:
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; latency: readers idle "
        f"{GAP_S * 1000:.0f} ms between messages; ratios > 1 mean ours is better "
        "(latency: other / ours, throughput: ours / other)"
    )
    header = (f"{'rdr':>3} {'size':>6}  {'transport':<12} {'p50 us':>9} {'p99 us':>9} "
              f"{'p50 ratio':>9}  {'msg/s':>9} {'MiB/s':>8} {'thr ratio':>9}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for n_readers in (1, 2):
        for label, size in SIZES.items():
            n_latency, n_throughput = COUNTS[quick][label]
            rows = {}
            for kind in (RING, QUEUE, ZMQ):
                group = groups[(kind, n_readers)]
                samples = group.latency_us(size, n_latency)
                rate = group.throughput(size, n_throughput)
                rows[kind] = (_percentile(samples, 0.5), _percentile(samples, 0.99), rate)
            ours_p50, _, ours_rate = rows[RING]
            for kind, (p50, p99, rate) in rows.items():
                print(
                    f"{n_readers:>3} {label:>6}  {kind:<12} {p50:9.1f} {p99:9.1f} "
                    f"{_ratio(p50, ours_p50):>9}  {rate:9.0f} {rate * size / 2**20:8.1f} "
                    f"{_ratio(ours_rate, rate):>9}"
                )
        print()


def _print_idle_cpu(groups: dict[tuple[str, int], _Group], idle_s: float) -> None:
    """All groups idle at once: each reader measures only its own process's CPU time."""
    for group in groups.values():
        group.command("idle", idle_s)
    for group in groups.values():
        group.send(bytes(64))
    print(f"reader CPU while idle for {idle_s:.0f} s after a message (max over readers)")
    for (kind, n_readers), group in groups.items():
        print(f"  {kind:<16} {n_readers} reader(s): {max(group.replies()) * 1000:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages, 2 s idle window")
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="sbbench-")
    groups: dict[tuple[str, int], _Group] = {}
    try:
        for n_readers in (1, 2):
            for kind in (RING, QUEUE, ZMQ):
                groups[(kind, n_readers)] = _Group(kind, n_readers, run_dir)
        groups[(VLLM_SPIN, 1)] = _Group(RING, 1, run_dir, spin_s=1.0)
        for group in groups.values():
            group.wait_ready()
        _print_latency_and_throughput(groups, args.quick)
        _print_idle_cpu(groups, 2.0 if args.quick else 5.0)
    finally:
        for group in groups.values():
            group.close()
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
