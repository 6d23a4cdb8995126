"""The traffic of bench/soak.py: mixed requests on both fronts, each checked against what an
undisturbed run gave, and the rule for what counts as lost.

Kinds (one client thread sends one request at a time, kinds drawn with ``WEIGHTS``):

    stream      gRPC Generate, greedy, 24-200 tokens: the token ids an undisturbed run gave
    completion  HTTP /v1/completions, greedy, 96 tokens, streamed (SSE) or not: the same text
    chat        HTTP /v1/chat/completions, SSE, greedy, 96 tokens: the same text
    structured  gRPC Generate with a JSON schema or a regex: the same tokens, and valid
    cancel      a gRPC or SSE stream the client drops after a few tokens
    bad         a request the gateway must refuse: its status (INVALID_ARGUMENT / 400 / 404)

Outcomes. ``ok``: it ended as it should. ``reported``: it ended UNAVAILABLE saying how many tokens
it had delivered (the server's own account of a stream it could not finish: allowed). Anything
else is ``lost`` — unless a gateway was down at some moment of the attempt (killed, or back
less than a grace period ago): a killed gateway cannot say anything to its clients, whose
connections just break, so such an attempt is retried on a fresh connection (the gRPC port is
shared by every gateway; HTTP goes to the other gateway's port), up to ``ATTEMPTS`` times, and
the request's outcome is the retry's. A wrong answer that ended OK is never retried: lost.

Not run by itself.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import jsonschema

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc

WEIGHTS = {"stream": 30, "completion": 15, "chat": 15, "structured": 15, "cancel": 12, "bad": 13}
ATTEMPTS = 5  # backing off 0.5, 1, 2, 4 s: a gateway restarts within a few seconds
TIMEOUT_S = 240.0  # a stream may wait for an engine's restart (--resume-timeout-s 60) and more
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
CHATS = ["Tell me a story.", "What is a list?", "Count to ten."]
STREAM_TOKENS = 200  # the reference's; a stream asks for a prefix of 24..200 of them
HTTP_TOKENS = 96
DIGITS = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 60, "maxItems": 60}
CONSTRAINTS = [("json_schema", json.dumps(DIGITS)), ("regex", r"(ab|cd|ef){80}")]
DELIVERED = "tokens were delivered"


@dataclasses.dataclass
class Outcome:
    kind: str
    result: str  # ok | reported | lost
    detail: str
    attempts: int


class Failed(Exception):
    """An attempt that did not end as it should: ``reported`` (UNAVAILABLE saying what it
    delivered) or not."""

    def __init__(self, detail: str, wrong_answer: bool = False, reported: bool = False) -> None:
        super().__init__(detail)
        self.reported = reported
        self.wrong_answer = wrong_answer


class Fronts:
    """Where requests go: the shared gRPC port, and each gateway's HTTP port."""

    def __init__(self, grpc_target: str, http_ports: list[int], host: str = "127.0.0.1") -> None:
        self.grpc_target = grpc_target
        self.http_ports = http_ports
        self.host = host
        self.model = ""

    def channel(self) -> grpc.Channel:
        # a connection of its own: a broken one is never reused, and new ones spread over the
        # gateways that share the port
        return grpc.insecure_channel(
            self.grpc_target, options=[("grpc.use_local_subchannel_pool", 1)]
        )

    def http(self, slot: int) -> http.client.HTTPConnection:
        """A connection to gateway ``slot`` (mod their number): a retry takes the next one."""
        port = self.http_ports[slot % len(self.http_ports)]
        return http.client.HTTPConnection(self.host, port, timeout=TIMEOUT_S)


# ---------------------------------------------------------------- one attempt of each kind


def _grpc_tokens(
    fronts: Fronts, request: pb.GenerateRequest, cancel_after: int = 0
) -> tuple[list[int], str]:
    tokens: list[int] = []
    text = ""
    with fronts.channel() as channel:
        call = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=TIMEOUT_S)
        try:
            for response in call:
                for output in response.outputs:
                    tokens += output.token_ids
                    text += output.text
                if cancel_after and len(tokens) >= cancel_after:
                    call.cancel()
        except grpc.RpcError as error:
            if cancel_after and error.code() == grpc.StatusCode.CANCELLED:
                return tokens, text
            details = error.details() or ""
            reported = error.code() == grpc.StatusCode.UNAVAILABLE and DELIVERED in details
            raise Failed(f"{error.code().name}: {details[:200]}", reported=reported) from None
    return tokens, text


def greedy(prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> pb.GenerateRequest:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = ignore_eos
    request.output.return_token_ids = True
    return request


def structured(index: int) -> pb.GenerateRequest:
    request = greedy(PROMPTS[index % len(PROMPTS)], 400, ignore_eos=False)
    kind, spec = CONSTRAINTS[index % len(CONSTRAINTS)]
    setattr(request.structured_output, kind, spec)
    return request


def _sse(
    conn: http.client.HTTPConnection, path: str, body: dict[str, Any], stop_after: int = 0
) -> str:
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise Failed(f"HTTP {reply.status}: {reply.read()[:200]!r}")
    text, events = "", 0
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return text
        event = json.loads(data)
        if "error" in event:
            message = str(event["error"].get("message", event["error"]))
            raise Failed(f"SSE error: {message[:200]}", reported=DELIVERED in message)
        for choice in event.get("choices", []):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        events += 1
        if stop_after and events >= stop_after:
            conn.close()  # the client goes away mid-stream
            return text
    raise Failed("the SSE stream ended without [DONE]")


def _completion_body(fronts: Fronts, index: int, stream: bool) -> dict[str, Any]:
    body = {"model": fronts.model, "prompt": PROMPTS[index], "max_tokens": HTTP_TOKENS}
    return {**body, "temperature": 0, "ignore_eos": True, "stream": stream}


def _chat_body(fronts: Fronts, index: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": CHATS[index]}]
    body = {"model": fronts.model, "messages": messages, "max_tokens": HTTP_TOKENS}
    return {**body, "temperature": 0, "ignore_eos": True, "stream": True}


def completion_text(
    fronts: Fronts, conn: http.client.HTTPConnection, index: int, stream: bool
) -> str:
    body = _completion_body(fronts, index, stream)
    if stream:
        return _sse(conn, "/v1/completions", body)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    payload = reply.read()
    if reply.status != 200:
        raise Failed(
            f"HTTP {reply.status}: {payload[:200]!r}", reported=DELIVERED.encode() in payload
        )
    return str(json.loads(payload)["choices"][0]["text"])


class References:
    """What an undisturbed run gives, made before any kill."""

    def __init__(self) -> None:
        self.stream: dict[int, list[int]] = {}
        self.completion: dict[int, str] = {}
        self.chat: dict[int, str] = {}
        self.structured: dict[int, list[int]] = {}

    def make(self, fronts: Fronts) -> None:
        for i, prompt in enumerate(PROMPTS):
            self.stream[i] = _grpc_tokens(fronts, greedy(prompt, STREAM_TOKENS))[0]
            self.completion[i] = completion_text(fronts, fronts.http(0), i, stream=True)
            self.chat[i] = _sse(fronts.http(0), "/v1/chat/completions", _chat_body(fronts, i))
        for i in range(len(PROMPTS) * len(CONSTRAINTS)):
            tokens, text = _grpc_tokens(fronts, structured(i))
            check_constraint(i, text)
            self.structured[i] = tokens


def check_constraint(index: int, text: str) -> None:
    kind, spec = CONSTRAINTS[index % len(CONSTRAINTS)]
    try:
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), json.loads(spec))
        elif re.fullmatch(spec, text) is None:
            raise ValueError("no match")
    except (ValueError, jsonschema.ValidationError) as error:
        why = str(error)[:200]
        raise Failed(f"not valid against its {kind}: {why}", wrong_answer=True) from None


def _same(kind: str, got: object, expected: object) -> None:
    if got != expected:
        raise Failed(f"{kind}: differs from the undisturbed run", wrong_answer=True)


def attempt(kind: str, fronts: Fronts, refs: References, rng: random.Random, slot: int) -> str:
    """One try of a request of ``kind`` (HTTP to gateway ``slot``); returns a short
    description, raises Failed."""
    i = rng.randrange(len(PROMPTS))
    if kind == "stream":
        n = rng.randrange(24, STREAM_TOKENS + 1)
        tokens, _ = _grpc_tokens(fronts, greedy(PROMPTS[i], n))
        _same(kind, tokens, refs.stream[i][:n])
        return f"{n} tokens"
    if kind == "completion":
        stream = rng.random() < 0.5
        _same(kind, completion_text(fronts, fronts.http(slot), i, stream), refs.completion[i])
        return "sse" if stream else "json"
    if kind == "chat":
        text = _sse(fronts.http(slot), "/v1/chat/completions", _chat_body(fronts, i))
        _same(kind, text, refs.chat[i])
        return "sse"
    if kind == "structured":
        j = rng.randrange(len(refs.structured))
        tokens, text = _grpc_tokens(fronts, structured(j))
        check_constraint(j, text)
        _same(kind, tokens, refs.structured[j])
        return CONSTRAINTS[j % len(CONSTRAINTS)][0]
    if kind == "cancel":
        if rng.random() < 0.5:
            _grpc_tokens(fronts, greedy(PROMPTS[i], 400), cancel_after=rng.randrange(1, 6))
            return "grpc"
        body = _completion_body(fronts, i, stream=True) | {"max_tokens": 400}
        _sse(fronts.http(slot), "/v1/completions", body, stop_after=rng.randrange(1, 6))
        return "sse"
    return _bad(fronts, rng, slot)


def _bad(fronts: Fronts, rng: random.Random, slot: int) -> str:
    which = rng.randrange(3)
    if which == 0:  # a negative temperature over gRPC
        request = greedy(PROMPTS[0], 8)
        request.sampling.temperature = -1.0
        try:
            _grpc_tokens(fronts, request)
        except Failed as failed:
            if str(failed).startswith("INVALID_ARGUMENT"):
                return "grpc INVALID_ARGUMENT"
            raise
        raise Failed("a negative temperature was accepted", wrong_answer=True)
    conn = fronts.http(slot)
    body: dict[str, Any] = {"model": fronts.model, "prompt": "hi", "max_tokens": -3}
    expected = 400
    if which == 2:
        body, expected = {"model": "no-such-model", "prompt": "hi"}, 404
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    reply.read()
    if reply.status != expected:
        raise Failed(f"a bad request got HTTP {reply.status}, not {expected}")
    return f"http {expected}"


# ---------------------------------------------------------------- the clients


class Traffic:
    """``clients`` threads sending requests until ``stop``; outcomes counted by kind."""

    def __init__(
        self,
        fronts: Fronts,
        refs: References,
        clients: int,
        seed: int,
        gateway_outage_during: Callable[[float, float], bool],
    ) -> None:
        self.fronts, self.refs = fronts, refs
        self.outage = gateway_outage_during
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(random.Random(seed + i),), daemon=True)
            for i in range(clients)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(TIMEOUT_S * ATTEMPTS)

    def _client(self, rng: random.Random) -> None:
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        while not self._stop.is_set():
            outcome = self.request(rng.choices(kinds, weights)[0], rng)
            with self._lock:
                self.outcomes.append(outcome)

    def request(self, kind: str, rng: random.Random) -> Outcome:
        gateway = rng.randrange(len(self.fronts.http_ports))  # HTTP: a retry takes the next
        for tries in range(1, ATTEMPTS + 1):
            started = time.monotonic()
            try:
                described = attempt(kind, self.fronts, self.refs, rng, gateway + tries)
                return Outcome(kind, "ok", described, tries)
            except Failed as failed:
                if failed.reported:
                    return Outcome(kind, "reported", str(failed), tries)
                interrupted = not failed.wrong_answer and self.outage(started, time.monotonic())
                if not interrupted or tries == ATTEMPTS:
                    return Outcome(kind, "lost", str(failed), tries)
            except (OSError, http.client.HTTPException, ValueError) as error:
                if not self.outage(started, time.monotonic()) or tries == ATTEMPTS:
                    return Outcome(kind, "lost", f"{type(error).__name__}: {error}", tries)
            time.sleep(0.25 * 2**tries)  # then a fresh connection
        raise AssertionError("unreachable")

    def summary(self) -> dict[str, Any]:
        with self._lock:
            outcomes = list(self.outcomes)
        by_kind: dict[str, collections.Counter[str]] = {}
        for outcome in outcomes:
            by_kind.setdefault(outcome.kind, collections.Counter())[outcome.result] += 1
        return {
            "requests": len(outcomes),
            "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
            "ok": sum(o.result == "ok" for o in outcomes),
            "reported_unavailable": [o.detail for o in outcomes if o.result == "reported"],
            "retried_after_a_gateway_kill": sum(o.attempts > 1 for o in outcomes),
            "lost": [f"{o.kind}: {o.detail}" for o in outcomes if o.result == "lost"],
        }
