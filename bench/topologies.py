"""What the topologies cost on this machine: output tokens/s at 32 concurrent streams for TP=1 vs
TP=2 and DP=1 vs DP=2, and the latency the shared-memory ring adds per step with 1, 2, 4 readers.

    python bench/topologies.py                 # tiny random checkpoint (measures the overhead)
    python bench/topologies.py --model DIR     # a real checkpoint (e.g. the built-in default)
    python bench/topologies.py --quick         # fewer tokens and steps

Throughput: a real `switchboard serve` per topology (gateway(s), engine core(s), workers,
coordinator), 32 greedy streams started together, each generating ``--max-tokens`` tokens; the
rate is all output tokens over the wall time from the first request to the last response.
With TP=2 both workers hold half the heads and MLP columns of every layer and meet in an
all-reduce (gloo on CPU) twice per layer per step. On 2 cores no topology can gain much: the
point is to see what each one costs. (The built-in SmolLM2-135M has 9 heads: TP=2 refuses it.)

Ring: one writer (as the engine core) and N reader processes (as workers). Each step the writer
broadcasts a 2 KiB message (a decode step's delta for a few dozen requests), every reader
dequeues it, and reader 0 answers on a ZeroMQ PUSH, as ``output_rank`` does; the writer waits
for the answer, then pauses 1 ms (the engine scheduling the next step). Reported: median and
p90 of the step round trip (enqueue -> answer received) and of the time until the slowest
reader had the message.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.wire.shm_ring import ShmRingReader, ShmRingWriter

STREAMS = 32
CTX = mp.get_context("spawn")
STAMP = struct.Struct("<qq")  # step, perf_counter_ns at enqueue
WAIT_S = 120.0


# ---- throughput -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as channel:
            request = health_pb2.HealthCheckRequest(service="switchboard.v1.GenerationService")
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
            return status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _stream(target: str, max_tokens: int, i: int) -> int:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5 + i % 50, 6, 7, 8, 9, 10]))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    with grpc.insecure_channel(target) as channel:
        responses = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=600))
    return responses[-1].usage.completion_tokens


def measure_throughput(model: str, args: list[str], max_tokens: int, log: Path) -> float:
    port = _free_port()
    target = f"127.0.0.1:{port}"
    run_base = tempfile.mkdtemp(prefix="sbbench-")
    env = dict(os.environ, SWITCHBOARD_RPC_BASE_PATH=run_base)
    cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + WAIT_S
        while not _ready(target):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server {args} did not start; see {log}")
            time.sleep(0.5)
        time.sleep(2.0)  # let every gateway hear every engine's READY
        _stream(target, 4, 0)  # warm-up
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            started = time.perf_counter()
            tokens = sum(pool.map(lambda i: _stream(target, max_tokens, i), range(STREAMS)))
            elapsed = time.perf_counter() - started
        return tokens / elapsed
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(run_base, ignore_errors=True)


# ---- ring latency ---------------------------------------------------------------------------


def _reader(handle, rank: int, reply_address: str, steps: int, ctrl) -> None:
    reader = ShmRingReader(handle, rank)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(reply_address)
    arrivals = []
    for _ in range(steps):
        message = reader.dequeue(timeout=WAIT_S)
        step, sent_ns = STAMP.unpack_from(message)
        arrivals.append(time.perf_counter_ns() - sent_ns)
        if rank == 0:
            push.send(STAMP.pack(step, 0))
    ctrl.send(arrivals)
    push.close(linger=1000)
    ctx.term()
    reader.close()


def measure_ring(n_readers: int, steps: int) -> tuple[list[float], list[float]]:
    run_dir = tempfile.mkdtemp(prefix="sbring-")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    reply_address = f"ipc://{run_dir}/replies"
    pull.bind(reply_address)
    writer = ShmRingWriter(n_readers, run_dir)
    pipes, procs = [], []
    try:
        for rank in range(n_readers):
            mine, theirs = CTX.Pipe()
            proc = CTX.Process(
                target=_reader, args=(writer.handle, rank, reply_address, steps, theirs)
            )
            proc.start()
            pipes.append(mine)
            procs.append(proc)
        writer.wait_for_readers(WAIT_S)
        payload = bytearray(2048)
        round_trips = []
        for step in range(steps):
            sent = time.perf_counter_ns()
            STAMP.pack_into(payload, 0, step, sent)
            writer.enqueue(payload, timeout=WAIT_S)
            if not pull.poll(int(WAIT_S * 1000)):
                raise TimeoutError("reader 0 did not answer")
            pull.recv()
            round_trips.append((time.perf_counter_ns() - sent) / 1000)
            time.sleep(0.001)
        per_reader = [pipe.recv() for pipe in pipes]
        slowest = [max(r[i] for r in per_reader) / 1000 for i in range(steps)]
        return round_trips, slowest
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        writer.close()
        pull.close(linger=0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-servers", action="store_true", help="only the ring")
    args = parser.parse_args()
    max_tokens = 32 if args.quick else 128
    steps = 300 if args.quick else 2000
    print(f"machine: {os.cpu_count()} CPUs")

    if not args.skip_servers:
        workdir = Path(tempfile.mkdtemp(prefix="sbtopo-"))
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.tiny_checkpoint import make_tiny_llama

            model = make_tiny_llama(str(workdir / "tiny"))
        common = ["--max-num-seqs", str(STREAMS), "--kv-cache-memory-bytes", str(256 << 20)]
        topologies = [
            ("TP=1 DP=1", []),
            ("TP=2 DP=1", ["-tp", "2"]),
            ("TP=1 DP=2", ["-dp", "2"]),
        ]
        print(f"\n{STREAMS} concurrent greedy streams x {max_tokens} tokens, model {model}")
        print(f"{'topology':<12} {'processes':>9} {'output tok/s':>13}")
        for name, extra in topologies:
            rate = measure_throughput(
                model, [*extra, *common], max_tokens, workdir / f"{name}.log".replace(" ", "_")
            )
            processes = {"TP=1 DP=1": 3, "TP=2 DP=1": 4, "TP=1 DP=2": 7}[name]
            print(f"{name:<12} {processes:>9} {rate:>13.1f}")
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\nring, {steps} steps of a 2 KiB broadcast, reader 0 answers (microseconds)")
    print(f"{'readers':>7} {'round trip p50':>15} {'p90':>8} {'slowest reader p50':>19} {'p90':>8}")
    for n in (1, 2, 4):
        round_trips, slowest = measure_ring(n, steps)
        print(
            f"{n:>7} {statistics.median(round_trips):>15.0f} {_pct(round_trips, 90):>8.0f} "
            f"{statistics.median(slowest):>19.0f} {_pct(slowest, 90):>8.0f}"
        )


if __name__ == "__main__":
    main()
