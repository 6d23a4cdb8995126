"""No single death but the supervisor's stops `switchboard serve` (docs/operations.md, "Failure"):
a gateway or the coordinator killed with -9 under load is restarted at the same addresses.

* the only gateway: its streams end UNAVAILABLE, the engine aborts its requests (nothing is left
  running or waiting), the restarted gateway is re-admitted by the engine and serves;
* one of two gateways (``--api-servers 2``, which share the gRPC port): the other one's streams
  complete untouched, the dead one's end UNAVAILABLE, and it comes back on its own ports;
* the coordinator (``-dp 2``): every stream completes, the gateways route on their own counts
  meanwhile, and the restarted coordinator rebuilds its table from the engines' reports.

Each test prints what it measured (``-s`` shows it).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import grpc
import openai
import pytest

from tests.e2e.client_calls import metric_sum, scrape
from tests.e2e.server import RunningServer, free_port, start_server, wait_until
from tests.e2e.test_resilience import (
    PROMPTS,
    SERVING,
    SMALL_KV,
    Stream,
    generate_tokens,
    health,
    wait_for_tokens,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 400  # of the tiny model's 512 positions
ABORTED = re.compile(r"Gateway (\d+) went away: aborted its (\d+) request")


def restart_line(role: str, pid: int) -> str:
    return (
        f"{role} (pid {pid}) exited with code -9: restarting it in 1.0 s "
        "(restart 1 of 5 within 300 s)"
    )


def aborted_for(server: RunningServer, client_index: int) -> int:
    """How many requests the engines aborted because gateway ``client_index`` went away."""
    return sum(
        int(count) for index, count in ABORTED.findall(server.log()) if int(index) == client_index
    )


def engines_idle(metrics_port: int) -> bool:
    """Nothing running or waiting on any engine (the engine-level gauges, from their stats)."""
    scraped = scrape(metrics_port)
    series = ("switchboard:num_requests_running", "switchboard:num_requests_waiting")
    return all(metric_sum(scraped, name) == 0 for name in series)


def grpc_connections(pid: int, port: int) -> set[int]:
    """The established TCP connections on local ``port`` that process ``pid`` holds (inodes)."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            held.add(int(link[len("socket:[") : -1]))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] == "01" and int(fields[9]) in held:
                    found.add(int(fields[9]))
    return found


class Connection:
    """One gRPC connection of its own, to whichever gateway the kernel gave it (gRPC shares
    one connection per target within a process unless told not to). A ``Stream`` takes it in
    place of the server: its ``channel()`` is this connection, every time."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(
            target, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        grpc.channel_ready_future(self._channel).result(timeout=60)

    def channel(self) -> _Borrowed:
        return _Borrowed(self._channel)

    def close(self) -> None:
        self._channel.close()


class _Borrowed:
    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel

    def __enter__(self) -> grpc.Channel:
        return self._channel

    def __exit__(self, *_exc: object) -> None:
        pass  # the connection outlives the stream: the next one uses it again


def gateway_that_accepted(gateway_pids: list[int], port: int, before: list[set[int]]) -> int:
    """The one gateway that holds a connection on ``port`` it did not hold ``before``."""
    deadline = time.monotonic() + 30
    while True:
        pids = enumerate(gateway_pids)
        grown = [i for i, pid in pids if grpc_connections(pid, port) - before[i]]
        if grown:
            assert len(grown) == 1, grown
            return grown[0]
        assert time.monotonic() < deadline, "no gateway accepted the connection"
        time.sleep(0.05)


def connections_to_each_gateway(
    server: RunningServer, gateway_pids: list[int], per_gateway: int
) -> list[list[Connection]]:
    """``per_gateway`` connections landed on each gateway: connections are opened one at a
    time, and the gateway that accepted each is the one holding a new connection on the port."""
    port = int(server.target.rsplit(":", 1)[1])
    landed: list[list[Connection]] = [[] for _ in gateway_pids]
    spare = []
    for _ in range(20 * per_gateway * len(gateway_pids)):
        if all(len(connections) >= per_gateway for connections in landed):
            break
        before = [grpc_connections(pid, port) for pid in gateway_pids]
        connection = Connection(server.target)
        gateway = gateway_that_accepted(gateway_pids, port, before)
        (landed[gateway] if len(landed[gateway]) < per_gateway else spare).append(connection)
    for connection in spare:
        connection.close()
    assert all(len(connections) >= per_gateway for connections in landed), "connections spread"
    return landed


def held_up_streams(
    connections: list[list[Connection]], workers: list[int]
) -> list[tuple[int, int, Stream]]:
    """(gateway, prompt index, stream) for a greedy stream on every connection, all going (3
    tokens seen) and then held up by SIGSTOP of the ``workers`` (the caller sends SIGCONT). On
    a loaded machine a stream may end between the two: then SIGCONT and try again."""
    for _ in range(5):
        streams = [
            (gateway, i % len(PROMPTS), Stream(connection, PROMPTS[i % len(PROMPTS)], MAX_TOKENS))
            for gateway, on_gateway in enumerate(connections)
            for i, connection in enumerate(on_gateway)
        ]
        wait_for_tokens([stream for _, _, stream in streams], 3)
        for worker in workers:
            os.kill(worker, signal.SIGSTOP)
        time.sleep(0.5)  # tokens made before the stop still reach the clients meanwhile
        if all(stream.code is None for _, _, stream in streams):
            return streams
        for worker in workers:
            os.kill(worker, signal.SIGCONT)
        for _, _, stream in streams:
            stream.join()
    raise AssertionError("every time a stream finished before the workers could be stopped")


def test_the_only_gateway_dies_under_load_and_is_restarted(tiny_model: str, tmp_path: Path) -> None:
    """kill -9 Gateway_0 with streams going and more queued in the engine (--max-num-seqs 1):
    the streams end UNAVAILABLE, `serve` stays up and restarts the gateway, the engine aborts
    the dead gateway's requests (nothing left running or waiting) and sends READY to the new
    one, which serves."""
    metrics_port = free_port()
    server = start_server(
        tiny_model, tmp_path, "--metrics-port", str(metrics_port), "--max-num-seqs", "1"
    )
    try:
        gateway = server.titled_processes()["switchboard::Gateway_0"]
        streams = [Stream(server, PROMPTS[i], MAX_TOKENS, delay_s=0.01) for i in range(4)]
        wait_until(lambda: any(len(s.tokens) >= 3 for s in streams), "a stream is going", 60)
        os.kill(gateway, signal.SIGKILL)
        killed = time.monotonic()
        for stream in streams:
            stream.join()
        codes = [stream.code for stream in streams]
        # A stream the engine had already finished may end OK; every other one fails.
        assert grpc.StatusCode.UNAVAILABLE in codes, (codes, server.log())
        for stream in streams:
            if stream.code == grpc.StatusCode.OK:
                assert len(stream.tokens) == MAX_TOKENS
            else:
                assert stream.code == grpc.StatusCode.UNAVAILABLE, stream.details
                assert len(stream.tokens) < MAX_TOKENS
        wait_until(lambda: restart_line("Gateway_0", gateway) in server.log(), "the restart", 30)
        wait_until(lambda: health(server) == SERVING, "the restarted gateway is SERVING", 120)
        back_s = time.monotonic() - killed
        assert server.process.poll() is None, "serve stays up"
        assert server.titled_processes()["switchboard::Gateway_0"] != gateway
        assert len(generate_tokens(server, PROMPTS[1], 8)) == 8
        assert aborted_for(server, 0) >= 1, server.log()
        wait_until(lambda: engines_idle(metrics_port), "nothing left running or waiting", 30)
        print(
            f"\nkill -9 the only gateway: its {len(streams)} streams UNAVAILABLE, "
            f"{aborted_for(server, 0)} requests aborted by the engine, SERVING again "
            f"{back_s:.1f}s after the kill"
        )
    finally:
        assert server.stop() == 0, server.log()


def test_one_of_two_gateways_dies_the_other_is_untouched(tiny_model: str, tmp_path: Path) -> None:
    """--api-servers 2, -dp 2, greedy streams on both gateways held up mid-stream (SIGSTOP of
    the workers); kill -9 one gateway: exactly its streams end UNAVAILABLE, the other gateway's
    complete with the tokens of an undisturbed run; the engines abort the dead gateway's
    requests, and it comes back on its own HTTP port and serves."""
    metrics_port = free_port()
    server = start_server(
        tiny_model,
        tmp_path,
        "--api-servers",
        "2",
        "-dp",
        "2",
        "--metrics-port",
        str(metrics_port),
        *SMALL_KV,
    )
    connections: list[list[Connection]] = []
    try:
        expected = [generate_tokens(server, prompt, MAX_TOKENS) for prompt in PROMPTS]
        titled = server.titled_processes()
        gateways = [titled[f"switchboard::Gateway_{i}"] for i in (0, 1)]
        workers = [titled[f"switchboard::Worker_DP{rank}_PP0_TP0"] for rank in (0, 1)]
        connections = connections_to_each_gateway(server, gateways, per_gateway=3)
        streams = held_up_streams(connections, workers)
        victim = 1
        try:
            os.kill(gateways[victim], signal.SIGKILL)
            killed = time.monotonic()
            wait_until(
                lambda: all(s.code is not None for g, _, s in streams if g == victim),
                "the dead gateway's streams end",
                30,
            )
        finally:
            for worker in workers:
                os.kill(worker, signal.SIGCONT)
        for _, _, stream in streams:
            stream.join()
        for gateway, prompt, stream in streams:
            if gateway == victim:
                assert stream.code == grpc.StatusCode.UNAVAILABLE, stream.details
                assert 3 <= len(stream.tokens) < MAX_TOKENS
                assert stream.tokens == expected[prompt][: len(stream.tokens)]
            else:
                assert stream.code == grpc.StatusCode.OK, (stream.details, server.log())
                assert stream.tokens == expected[prompt], "the other gateway's stream differs"
        victims = sum(g == victim for g, _, _ in streams)
        wait_until(lambda: aborted_for(server, victim) == victims, "the engines abort them", 30)
        wait_until(
            lambda: restart_line(f"Gateway_{victim}", gateways[victim]) in server.log(),
            "the restart",
            30,
        )
        http_port = int(server.http_url.rsplit(":", 1)[1]) + victim
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0
        ) as client:
            wait_until(lambda: _answers(client), "the restarted gateway answers on its port", 120)
            back_s = time.monotonic() - killed
            (model,) = client.models.list().data
            completion = client.completions.create(
                model=model.id, prompt=PROMPTS[1], max_tokens=8, temperature=0
            )
        assert completion.usage.completion_tokens == 8
        # gRPC readiness waits for every engine's READY at the restarted gateway, which can come
        # after its HTTP port answers (a request needs one engine), and the shared gRPC port may
        # hand this check to either gateway
        wait_until(lambda: health(server) == SERVING, "SERVING on the shared gRPC port", 30)
        assert len(generate_tokens(server, PROMPTS[2], 8)) == 8
        wait_until(lambda: engines_idle(metrics_port), "nothing left running or waiting", 30)
        print(
            f"\n--api-servers 2, kill -9 Gateway_{victim}: its {victims} streams UNAVAILABLE "
            f"and aborted on the engines, the other {len(streams) - victims} complete and "
            f"identical; it serves again {back_s:.1f}s after the kill"
        )
    finally:
        for on_gateway in connections:
            for connection in on_gateway:
                connection.close()
        assert server.stop() == 0, server.log()


def _answers(client: openai.OpenAI) -> bool:
    try:
        client.models.list()
    except openai.APIError:
        return False
    return True


def test_the_coordinator_dies_under_load_and_rebuilds_its_table(
    tiny_model: str, tmp_path: Path
) -> None:
    """-dp 2, kill -9 the coordinator with streams going: every stream completes with the tokens
    of an undisturbed run, the gateway routes on its own counts meanwhile (new requests are
    served), and the restarted coordinator hears from both engines again."""
    server = start_server(tiny_model, tmp_path, "-dp", "2", *SMALL_KV)
    try:
        expected = [generate_tokens(server, prompt, MAX_TOKENS) for prompt in PROMPTS]
        wait_until(lambda: "2 of 2 engines heard from" in server.log(), "the first table", 30)
        coordinator = server.titled_processes()["switchboard::Coordinator"]
        streams = [Stream(server, p, MAX_TOKENS, delay_s=0.005) for p in PROMPTS for _ in (0, 1)]
        wait_for_tokens(streams, 3)
        os.kill(coordinator, signal.SIGKILL)
        killed = time.monotonic()
        assert generate_tokens(server, PROMPTS[0], 8) == expected[0][:8]  # routed meanwhile
        for stream in streams:
            stream.join()
        for i, stream in enumerate(streams):
            assert stream.code == grpc.StatusCode.OK, (stream.details, server.log())
            assert stream.tokens == expected[i // 2], f"stream {i} differs"
        log = server.log
        wait_until(lambda: restart_line("Coordinator", coordinator) in log(), "the restart", 30)
        assert "the coordinator went away: routing on this gateway's own in-flight counts" in log()
        wait_until(
            lambda: log().count("Load table complete: all 2 engines reported") == 2,
            "the restarted coordinator's table has both engines",
            60,
        )
        rebuilt_s = time.monotonic() - killed
        wait_until(
            lambda: log().count("load reports from the coordinator arrive") >= 2,
            "the gateway uses its reports again",
            30,
        )
        assert server.titled_processes()["switchboard::Coordinator"] != coordinator
        for rank in (0, 1):
            tokens = generate_tokens(server, PROMPTS[1], 8, data_parallel_rank=rank)
            assert tokens == expected[1][:8]
        print(
            f"\nkill -9 the coordinator: all {len(streams)} streams complete and identical; "
            f"the restarted coordinator's table complete {rebuilt_s:.1f}s after the kill"
        )
    finally:
        assert server.stop() == 0, server.log()
