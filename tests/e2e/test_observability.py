"""Observability through the whole system: the spans a real server exports, and its /metrics.

One real server (`switchboard serve`, tiny checkpoint) for the module, with:

* its spans exported over OTLP/gRPC to an in-process receiver (``tests/otlp_receiver.py``);
* an engine whose monotonic clock is deliberately skewed by ``SWITCHBOARD_TEST_CLOCK_OFFSET_NS``
  (every engine timestamp, READY's anchor included, is 30 hours ahead of the real clock): the
  spans must still fall where the request really spent its time;
* 10 KV blocks, so that requests sent together preempt one another;
* ``--metrics-port`` for /metrics behind ``--metrics-token``, and the admin service to hold
  requests while the engine sleeps (the only way to make "all at once" certain);
* ``--stall-warn-s 0.5``: a stream held up by a frozen engine is counted and logged.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from tests.e2e.client_calls import greedy_request, metric_sum, scrape, utility
from tests.e2e.server import RunningServer, free_port, start_server, wait_until
from tests.otlp_receiver import OtlpGrpcReceiver, ReceivedSpan
from tests.tiny_checkpoint import tiny_llama_dir

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
RPC_TIMEOUT_S = 120.0
CLOCK_OFFSET_NS = 30 * 3600 * 10**9  # the engine's clock runs 30 h ahead
METRICS_TOKEN = "e2e-metrics-token"
STALL_WARN_S = 0.5
MS = 1_000_000
GENERATE = "switchboard.v1.GenerationService/Generate"
TILING = [
    "gateway.tokenize",
    "gateway.dispatch",
    "engine.queue",
    "engine.prefill",
    "engine.decode",
    "gateway.respond",
]
PROMPTS = [  # 1 to 6 KV blocks each: all at once do not fit 10 blocks with their outputs
    "def add(a, b):\n    return a + b\n",
    "Split the string into a list of words, keeping quoted phrases together, the way a shell "
    "would do it for the command line.",
    'class TextWrapper:\n    """Object for wrapping and filling text. The public interface '
    "consists of the wrap() and fill() methods; the other methods are just there for "
    'subclasses to override in order to tweak the default behaviour."""\n    width = 70\n',
    "You are a careful assistant for the Python standard library. Answer with short, correct "
    "code and explain each step: the glob module finds path names matching a pattern.",
]


@dataclass
class Observed:
    server: RunningServer
    channel: grpc.Channel
    receiver: OtlpGrpcReceiver
    metrics_port: int


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    receiver = OtlpGrpcReceiver()
    metrics_port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SWITCHBOARD_TEST_CLOCK_OFFSET_NS", str(CLOCK_OFFSET_NS))
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
        server = start_server(
            tiny_llama_dir(),
            tmp_path_factory.mktemp("observed"),
            "--enable-admin",
            "--num-gpu-blocks-override", "10",
            "--otlp-traces-endpoint", receiver.endpoint,
            "--metrics-port", str(metrics_port),
            "--metrics-token", METRICS_TOKEN,
            "--stall-warn-s", str(STALL_WARN_S),
        )  # fmt: skip
    try:
        with server.channel() as channel:
            yield Observed(server, channel, receiver, metrics_port)
    finally:
        assert server.stop() == 0, server.log()
        receiver.stop()


# ---------------------------------------------------------------- helpers


def greedy(text: str, request_id: str, max_tokens: int = 8) -> pb.GenerateRequest:
    return greedy_request(text, max_tokens, final_only=True, request_id=request_id)


def generate(
    channel: grpc.Channel, request: pb.GenerateRequest, metadata: tuple = ()
) -> pb.GenerateResponse:
    stub = pb_grpc.GenerationServiceStub(channel)
    (final,) = list(stub.Generate(request, timeout=RPC_TIMEOUT_S, metadata=metadata))
    return final


def by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    found: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        found.setdefault(span.name.split(" ")[0], []).append(span)
    return found


def request_tree(receiver: OtlpGrpcReceiver, request_id: str, num_spans: int):
    """(server span, text_completion span, its children) of one request."""
    spans = receiver.wait_for_request(request_id, num_spans=num_spans)
    named = by_name(spans)
    (server,) = named[GENERATE]
    (completion,) = named["text_completion"]
    children = sorted(
        (s for s in spans if s.parent_span_id == completion.span_id), key=lambda s: s.start_ns
    )
    assert len(spans) == 2 + len(children), [s.name for s in spans]
    return server, completion, children


def assert_nested_and_tiled(completion: ReceivedSpan, children: list[ReceivedSpan]) -> None:
    for child in children:
        assert completion.start_ns <= child.start_ns <= child.end_ns <= completion.end_ns
    tiles = [c for c in children if c.name != "engine.preempted"]
    for before, after in zip(tiles, tiles[1:], strict=False):
        assert before.end_ns == after.start_ns, (before.name, after.name)
    assert abs(sum(c.duration_ns for c in tiles) - completion.duration_ns) <= MS


# ---------------------------------------------------------------- traces


def test_span_tree_of_a_request_on_the_engines_own_clock(observed: Observed) -> None:
    prompt = PROMPTS[1]
    before_ns = time.time_ns()
    final = generate(observed.channel, greedy(prompt, "trace-basic"))
    after_ns = time.time_ns()
    assert final.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    server, completion, children = request_tree(observed.receiver, "trace-basic", 8)

    assert server.kind == "SERVER" and server.parent_span_id == ""
    assert server.attributes["rpc.response.status_code"] == "OK" and server.status == "UNSET"
    assert completion.kind == "CLIENT" and completion.parent_span_id == server.span_id
    model = completion.attributes["gen_ai.request.model"]
    assert completion.name == f"text_completion {model}"
    attributes = completion.attributes
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.max_tokens"] == 8
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.response.id"] == "trace-basic"
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.usage.input_tokens"] == final.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == 8
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == final.usage.cached_prompt_tokens
    assert "error.type" not in attributes
    every_value = str([s.attributes for s in [server, completion, *children]])
    assert prompt[:20] not in every_value  # no content without --trace-content

    assert [c.name for c in children] == TILING
    assert all(c.kind == "INTERNAL" for c in children)
    assert_nested_and_tiled(completion, children)
    # Placed on the real clock despite the engine's 30-hour skew: inside what the client saw,
    # and engine phases as long as the engine measured them (differences of its own stamps).
    assert before_ns <= server.start_ns <= server.end_ns <= after_ns
    phases = {c.name: c for c in children}
    metrics = final.metrics
    assert phases["engine.queue"].duration_ns == metrics.queue_time.ToNanoseconds()
    assert phases["engine.prefill"].duration_ns == metrics.prefill_time.ToNanoseconds()
    assert phases["engine.decode"].duration_ns == metrics.decode_time.ToNanoseconds()
    assert phases["engine.prefill"].end_ns - server.start_ns == pytest.approx(
        metrics.time_to_first_token.ToNanoseconds(), abs=MS
    )
    assert "every timestamp of this engine is offset by" in observed.server.log()
    # Every span and attribute exported is documented.
    docs = DOCS.read_text()
    for span in [server, completion, *children]:
        assert span.name.split(" ")[0] in docs, span.name
        undocumented = [key for key in span.attributes if f"`{key}`" not in docs]
        assert not undocumented, (span.name, undocumented)


def test_a_caller_traceparent_is_continued(observed: Observed) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"), ("tracestate", "vendor=x"))
    generate(observed.channel, greedy(PROMPTS[0], "trace-parent", 2), metadata)
    server, completion, _ = request_tree(observed.receiver, "trace-parent", 8)
    assert server.trace_id == completion.trace_id == trace_id
    assert server.parent_span_id == parent_id


def test_preempted_requests_have_one_span_per_preemption(observed: Observed) -> None:
    channel = observed.channel
    ids = [f"trace-crowd-{i}" for i in range(len(PROMPTS))]
    utility(channel, "sleep", 1)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        try:
            futures = []
            for i, (request_id, prompt) in enumerate(zip(ids, PROMPTS, strict=True)):
                request = greedy(prompt, request_id, max_tokens=24)
                futures.append(pool.submit(generate, channel, request))
                wait_until(
                    lambda n=i + 1: utility(channel, "get_stats")["num_waiting"] == n,
                    f"{i + 1} requests wait",
                )
        finally:
            utility(channel, "wake_up")
        finals = [f.result(RPC_TIMEOUT_S) for f in futures]
    preempted = {
        request_id: final.metrics.num_preemptions
        for request_id, final in zip(ids, finals, strict=True)
        if final.metrics.num_preemptions
    }
    assert preempted, "no request was preempted: the test needs a smaller KV cache"
    for request_id, count in preempted.items():
        _, completion, children = request_tree(observed.receiver, request_id, 8 + count)
        spans = [c for c in children if c.name == "engine.preempted"]
        assert len(spans) == count
        assert [s.attributes["switchboard.preemption.number"] for s in spans] == list(
            range(1, count + 1)
        )
        assert completion.attributes["switchboard.request.num_preemptions"] == count
        assert_nested_and_tiled(completion, children)
        prefill = next(c for c in children if c.name == "engine.prefill")
        respond = next(c for c in children if c.name == "gateway.respond")
        assert all(prefill.start_ns <= s.start_ns and s.end_ns <= respond.start_ns for s in spans)


def test_aborted_and_cancelled_requests_have_spans_ending_where_they_ended(
    observed: Observed,
) -> None:
    # Both wait in the queue of a sleeping engine (certain, not likely): one is ended by the
    # Abort RPC, the other by its client going away.
    channel = observed.channel
    stub = pb_grpc.GenerationServiceStub(channel)
    utility(channel, "sleep", 1)
    try:
        aborted = stub.Generate(greedy(PROMPTS[0], "trace-abort"), timeout=RPC_TIMEOUT_S)
        cancelled = stub.Generate(greedy(PROMPTS[1], "trace-cancel"), timeout=RPC_TIMEOUT_S)
        wait_until(lambda: utility(channel, "get_stats")["num_waiting"] == 2, "both wait")
        stub.Abort(pb.AbortRequest(request_ids=["trace-abort"]), timeout=RPC_TIMEOUT_S)
        (final,) = list(aborted)
        cancelled.cancel()
    finally:
        utility(channel, "wake_up")
    assert final.outputs[0].finish_reason == pb.FINISH_REASON_ABORT

    server, completion, children = request_tree(observed.receiver, "trace-abort", 4)
    assert completion.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert server.status == completion.status == "UNSET"  # what its client asked for
    # The engine never reported on it: after tokenization it waited for the engine.
    assert [c.name for c in children] == ["gateway.tokenize", "engine.queue"]
    assert_nested_and_tiled(completion, children)
    assert children[-1].end_ns == completion.end_ns

    server, completion, children = request_tree(observed.receiver, "trace-cancel", 4)
    assert server.attributes["rpc.response.status_code"] == "CANCELLED"
    assert server.status == "UNSET"  # not the server's failure
    assert completion.status == "ERROR" and completion.attributes["error.type"] == "CANCELLED"
    assert completion.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert_nested_and_tiled(completion, children)


def test_an_invalid_request_is_not_a_server_error(observed: Observed) -> None:
    request = greedy(PROMPTS[0], "trace-invalid")
    request.sampling.temperature = -1.0
    with pytest.raises(grpc.RpcError) as error:
        generate(observed.channel, request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    server, completion, children = request_tree(observed.receiver, "trace-invalid", 2)
    assert server.status == "UNSET"
    assert server.attributes["rpc.response.status_code"] == "INVALID_ARGUMENT"
    assert completion.status == "ERROR"
    assert completion.attributes["error.type"] == "INVALID_ARGUMENT"
    assert children == []


# ---------------------------------------------------------------- metrics


def metrics(observed: Observed) -> dict[tuple[str, frozenset], float]:
    return scrape(observed.metrics_port, METRICS_TOKEN)


def test_metrics_need_the_metrics_token(observed: Observed) -> None:
    url = f"http://127.0.0.1:{observed.metrics_port}/metrics"
    for headers in ({}, {"Authorization": "Bearer not-it"}):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30)
        assert refused.value.code == 401
        assert refused.value.headers["WWW-Authenticate"] == "Bearer"
    assert metric_sum(metrics(observed), "process_cpu_seconds_total") > 0


def test_the_http_port_serves_the_same_metrics_under_the_same_token(observed: Observed) -> None:
    """/metrics on the HTTP API's port too, as vLLM (routers scrape the serving port): the
    same registry, behind the same metrics token."""
    url = f"{observed.server.http_url}/metrics"
    wait_until(
        lambda: any(name == "vllm:num_requests_waiting" for name, _ in metrics(observed)),
        "the engine's first stats",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=30)
    assert refused.value.code == 401
    headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as reply:
        text = reply.read().decode()
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert {"vllm:num_requests_waiting", "switchboard:num_requests_waiting"} <= names
    assert names == {name for name, _ in metrics(observed)}


def test_metrics_deltas_of_a_known_workload(observed: Observed) -> None:
    running = "switchboard:num_requests_running"
    wait_until(lambda: metric_sum(metrics(observed), running) == 0, "the engine idles")
    before = metrics(observed)
    finals = [generate(observed.channel, greedy(p, f"metrics-{i}")) for i, p in enumerate(PROMPTS)]
    prompt_tokens = sum(f.usage.prompt_tokens for f in finals)
    cached = sum(f.usage.cached_prompt_tokens for f in finals)
    n, out = len(finals), 8 * len(finals)

    def settled() -> bool:
        now = metrics(observed)
        return (
            metric_sum(now, "switchboard:num_requests_running") == 0
            and metric_sum(now, "switchboard:iteration_tokens_total_count")
            - metric_sum(before, "switchboard:iteration_tokens_total_count")
            >= out
        )

    wait_until(settled, "the engine's stats arrive")
    after = metrics(observed)

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("switchboard:request_success_total", finished_reason="length") == n
    assert delta("switchboard:request_success_total") == n
    assert delta("switchboard:prompt_tokens_total") == prompt_tokens
    assert delta("switchboard:prompt_tokens_cached_total") == cached
    assert delta("switchboard:generation_tokens_total") == out
    assert delta("switchboard:request_prompt_tokens_sum") == prompt_tokens
    assert delta("switchboard:request_generation_tokens_sum") == out
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert delta(f"switchboard:{histogram}_count") == n, histogram
    assert delta("switchboard:inter_token_latency_seconds_count") == out - n
    assert (
        0
        < delta("switchboard:time_to_first_token_seconds_sum")
        < delta("switchboard:e2e_request_latency_seconds_sum")
    )
    # Engine-side, from the engine's cumulative counters: one step per token computed.
    assert delta("switchboard:prefix_cache_queries_total") == prompt_tokens
    assert delta("switchboard:prefix_cache_hits_total") == cached
    assert delta("switchboard:num_preemptions_total") == 0
    assert delta("switchboard:iteration_tokens_total_count") == out
    assert delta("switchboard:iteration_tokens_total_sum") == prompt_tokens - cached + out - n
    assert metric_sum(after, "switchboard:num_requests_waiting") == 0
    assert 0 <= metric_sum(after, "switchboard:kv_cache_usage_perc") <= 1
    # The OpenTelemetry GenAI equivalents.
    assert delta("gen_ai_server_request_duration_seconds_count", error_type="") == n
    assert delta("gen_ai_server_time_to_first_token_seconds_count") == n
    assert delta("gen_ai_client_token_usage_sum", gen_ai_token_type="output") == out
    assert delta("gen_ai_client_token_usage_sum", gen_ai_token_type="input") == prompt_tokens


class Streamed:
    """A Generate stream on a thread: its tokens as they come, and whether it ended well."""

    def __init__(
        self,
        observed: Observed,
        request_id: str,
        at_third_token: Callable[[], None] | None = None,
    ) -> None:
        self.tokens: list[int] = []
        self.code: grpc.StatusCode | None = None
        # called by the reading thread as the third token arrives, before it reads on: a
        # poll from another thread could come after the whole stream (a fast model)
        self._at_third_token = at_third_token
        self.third_token = threading.Event()
        request = greedy_request(PROMPTS[0], 100, return_token_ids=True, request_id=request_id)
        stub = pb_grpc.GenerationServiceStub(observed.channel)
        self._call = stub.Generate(request, timeout=RPC_TIMEOUT_S)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for response in self._call:
                self.tokens += [t for o in response.outputs for t in o.token_ids]
                if len(self.tokens) >= 3 and not self.third_token.is_set():
                    if self._at_third_token is not None:
                        self._at_third_token()
                    self.third_token.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code = error.code()

    def join(self) -> None:
        self._thread.join(RPC_TIMEOUT_S)
        assert self.code == grpc.StatusCode.OK


def test_vllm_named_series_for_routers_equal_ours_in_one_scrape(observed: Observed) -> None:
    """What inference routers score pods by, under vLLM's names and labels, scraped while two
    requests wait on a sleeping engine: every gauge equal to its switchboard: twin, the KV
    cache described, no LoRA adapters."""
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    channel = observed.channel

    def two_wait_and_equal() -> bool:
        now = metrics(observed)
        for name in gauges:
            ours = {labels: v for (n, labels), v in now.items() if n == f"switchboard:{name}"}
            theirs = {labels: v for (n, labels), v in now.items() if n == f"vllm:{name}"}
            assert ours and theirs == ours, name
        return metric_sum(now, "vllm:num_requests_waiting", engine="0") == 2

    utility(channel, "sleep", 1)
    with ThreadPoolExecutor(2) as pool:
        try:
            futures = [
                pool.submit(generate, channel, greedy(PROMPTS[i], f"routers-{i}")) for i in (0, 1)
            ]
            wait_until(two_wait_and_equal, "two requests wait, as both names say")
        finally:
            utility(channel, "wake_up")
        for future in futures:
            future.result(RPC_TIMEOUT_S)
    before = time.time()
    now = metrics(observed)
    (lora,) = [(labels, v) for (n, labels), v in now.items() if n == "vllm:lora_requests_info"]
    assert dict(lora[0]) == {
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert before <= lora[1] <= time.time()  # stamped at the scrape, as vLLM's
    cache = dict(engine="0", block_size="16", num_gpu_blocks="10", enable_prefix_caching="True")
    assert metric_sum(now, "vllm:cache_config_info", **cache) == 1


def test_a_stream_held_up_by_a_frozen_engine_is_counted_and_logged_once(
    observed: Observed,
) -> None:
    """SIGSTOP the engine core mid-stream for three times --stall-warn-s (far below the
    heartbeat timeout: the engine stays alive): one pause counted, one WARNING naming the
    stream with what the gateway knows of the engine, then the stream completes."""
    stalls = "switchboard:request_stalls_total"
    before = metric_sum(metrics(observed), stalls)
    engine = observed.server.titled_processes()["switchboard::EngineCore_DP0"]
    for attempt in range(5):  # on a loaded machine the stream may end before the stop
        request_id = f"frozen-{attempt}"
        stream = Streamed(observed, request_id, lambda: os.kill(engine, signal.SIGSTOP))
        try:
            wait_until(stream.third_token.is_set, "the stream is going")
            time.sleep(STALL_WARN_S * 3)
        finally:
            os.kill(engine, signal.SIGCONT)
        stream.join()
        if len(stream.tokens) == 100 and request_id in observed.server.log():
            break
    else:
        raise AssertionError("every stream ended before the engine could be stopped")
    assert metric_sum(metrics(observed), stalls) - before == 1
    lines = [line for line in observed.server.log().splitlines() if repr(request_id) in line]
    assert len(lines) == 1, lines
    assert f"1 stream(s) got no token for more than {STALL_WARN_S:g}s" in lines[0]
    assert "while the engine is alive; last heard from" in lines[0]
    assert "its latest stats: running 1" in lines[0]


# ---------------------------------------------------------------- first contact


def test_one_ready_line_with_every_address_once_the_engine_is_ready(observed: Observed) -> None:
    def ready_lines() -> list[str]:
        return [line for line in observed.server.log().splitlines() if "ready to serve" in line]

    wait_until(lambda: ready_lines() != [], "the ready line is logged", timeout_s=10)
    (line,) = ready_lines()
    assert f"gRPC {observed.server.target}" in line
    assert f"metrics http://127.0.0.1:{observed.metrics_port}/metrics" in line
    log = observed.server.log()
    # after the gateway's "listening" (kept) and after the engine's READY
    assert log.index(" listening on ") < log.index(line)
    assert log.index(") READY: ") < log.index(line)
