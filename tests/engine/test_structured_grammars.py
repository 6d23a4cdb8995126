"""Structured output in the engine core, without a model: the manager (compile, cache, bitmask),
the scheduler driven by a fake worker that samples only what the step's bitmask allows, and the
busy loop's handling of compiling and bad grammars (the tiny checkpoint's tokenizer)."""

from __future__ import annotations

import json
import queue
import re

import numpy as np
import pytest
from fake_worker import Driver, FakeWorker, default_token
from test_scheduler import BS, expected_tokens, make_request, make_scheduler, prompt
from tokenizers import Tokenizer

from switchboard.common.constraint_grammar import closed_objects
from switchboard.config import EngineConfig, ModelConfig
from switchboard.engine import intake
from switchboard.engine.constrained_decoding import StructuredOutputManager, attach_bitmask
from switchboard.engine.core import EngineCore
from switchboard.engine.intake import GRAMMAR_READY
from switchboard.engine.request import Request
from switchboard.engine.shutdown import ShutdownRequest
from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    RequestType,
    SamplingParams,
    StructuredOutputParams,
)
from switchboard.wire.request_rules import RequestRuleError, check_engine_request
from switchboard.wire.step_msgs import ModelRunnerOutput, SchedulerOutput
from tests.tiny_checkpoint import tiny_llama_dir

VOCAB = 1024
EOS = 1  # tiny checkpoint: <|bos|> 0, <|eos|> 1, <|pad|> 2


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def manager(checkpoint: str) -> StructuredOutputManager:
    m = StructuredOutputManager(checkpoint, VOCAB, max_workers=1)
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def tokenizer(checkpoint: str) -> Tokenizer:
    return Tokenizer.from_file(f"{checkpoint}/tokenizer.json")


def allowed_tokens(bitmask: bytes, row: int, words: int) -> np.ndarray:
    rows = np.frombuffer(bitmask, dtype="<i4").reshape(-1, words)
    return np.unpackbits(rows[row].view(np.uint8), bitorder="little").nonzero()[0]


class MaskedWorker(FakeWorker):
    """Samples like a model under the grammar: its preferred token (default_token) when the
    bitmask allows it, else the allowed token nearest to it (deterministic)."""

    def __init__(self, words: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.words = words
        self.masked_steps = 0
        self._allowed: dict[str, np.ndarray] = {}
        self.token_fn = self._token

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._allowed = {
            rid: allowed_tokens(out.grammar_bitmask, row, self.words)
            for row, rid in enumerate(out.structured_request_ids)
        }
        self.masked_steps += bool(self._allowed)
        return super().execute(out)

    def _token(self, rid: str, token_ids: list[int]) -> int:
        preferred = default_token(rid, token_ids)
        allowed = self._allowed.get(rid)
        if allowed is None:
            return preferred
        assert len(allowed), f"{rid}: the grammar allows nothing"
        return int(allowed[np.abs(allowed - preferred).argmin()])


class GrammarDriver(Driver):
    def __init__(self, scheduler, manager: StructuredOutputManager) -> None:
        self.worker_ = MaskedWorker(manager.words, BS, scheduler.kv.num_blocks)
        super().__init__(scheduler, self.worker_)
        self.manager = manager

    def step(self):
        sched_out = self.scheduler.schedule()
        attach_bitmask(self.manager, sched_out, self.scheduler.requests)
        self.sched_outputs.append(sched_out)
        runner_out = self.worker.execute(sched_out)
        for outs in self.scheduler.update_from_output(sched_out, runner_out).values():
            for o in outs:
                self.outputs.setdefault(o.request_id, []).append(o)


def constrained(manager, rid, prompt_ids, max_tokens, kind, spec, **params):
    request = make_request(
        rid,
        prompt_ids,
        max_tokens,
        eos_token_ids=[EOS],
        structured_output=StructuredOutputParams(kind, spec),
        **params,
    )
    request.grammar = manager.start(request.sampling_params.structured_output, [EOS])
    request.grammar.future.result(timeout=60)
    assert request.grammar.resolve() is None
    return request


def text(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode([t for t in token_ids if t != EOS], skip_special_tokens=True)


def test_compiles_once_per_spec_and_each_request_gets_its_own_matcher(manager) -> None:
    before = manager.compiled
    spec = StructuredOutputParams("regex", "(ab)+c")
    first, second = manager.start(spec, [EOS]), manager.start(spec, [EOS])
    assert first.future.result(60) is not second.future.result(60)
    assert first.resolve() is None and second.resolve() is None
    assert manager.compiled == before + 1
    bad = manager.start(StructuredOutputParams("regex", "a(b"), [EOS])
    assert bad.future.exception(60) is not None
    assert "unclosed group" in bad.resolve()
    unknown = manager.start(StructuredOutputParams("nope", "x"), [EOS])
    assert "unknown structured output kind" in unknown.resolve()


def test_constrained_and_free_requests_share_a_batch(manager, tokenizer) -> None:
    sched = make_scheduler()
    d = GrammarDriver(sched, manager)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    sched.add_request(constrained(manager, "phone", prompt(5), 40, "regex", phone))
    choices = ["yes", "no", "maybe later"]
    sched.add_request(
        constrained(manager, "pick", prompt(6, 300), 20, "choice", json.dumps(choices))
    )
    sched.add_request(make_request("free", prompt(7, 500), 12))
    d.run()
    assert re.fullmatch(phone, text(tokenizer, d.tokens("phone")))
    assert text(tokenizer, d.tokens("pick")) in choices
    for rid in ("phone", "pick"):
        assert d.finish(rid).finish_reason == FinishReason.STOP, rid
    assert d.tokens("free") == expected_tokens(prompt(7, 500), 12)  # unconstrained: untouched
    assert d.finish("free").finish_reason == FinishReason.LENGTH
    # masks only in steps where a constrained request sampled, rows only for those requests
    for out in d.sched_outputs:
        assert "free" not in out.structured_request_ids
        assert len(out.grammar_bitmask) == 4 * manager.words * len(out.structured_request_ids)


def test_max_tokens_first_is_length_not_stop(manager, tokenizer) -> None:
    sched = make_scheduler()
    d = GrammarDriver(sched, manager)
    sched.add_request(constrained(manager, "long", prompt(5), 3, "regex", r"x{40}"))
    d.run()
    assert d.finish("long").finish_reason == FinishReason.LENGTH
    assert set(text(tokenizer, d.tokens("long"))) <= {"x"}


def test_json_schema_output_parses_and_stops(manager, tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    sched = make_scheduler(max_model_len=128)
    d = GrammarDriver(sched, manager)
    sched.add_request(constrained(manager, "j", prompt(4), 100, "json_schema", json.dumps(schema)))
    d.run()
    assert d.finish("j").finish_reason == FinishReason.STOP
    value = json.loads(text(tokenizer, d.tokens("j")))
    assert set(value) == {"ok", "n"} and value["n"] in (1, 2, 3)


def accepts(manager, tokenizer, schema: dict, output: str) -> bool:
    grammar = manager.start(StructuredOutputParams("json_schema", json.dumps(schema)), [EOS])
    assert grammar.future.exception(60) is None and grammar.resolve() is None
    tokens = tokenizer.encode(output, add_special_tokens=False).ids + [EOS]
    return grammar.matcher.validate_tokens(tokens) == len(tokens)


def test_an_object_that_names_its_properties_allows_no_other_key(manager, tokenizer) -> None:
    # A router's tool-call schema: an array of {"name", "parameters"} objects that does not say
    # additionalProperties. Open, a model may start a key of its own and never close it.
    call = {
        "type": "object",
        "properties": {"name": {"const": "f"}, "parameters": {"properties": {"x": {}}}},
        "required": ["name", "parameters"],
    }
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [call]}}
    good = '[{"name": "f", "parameters": {"x": 1}}]'
    assert accepts(manager, tokenizer, schema, good)
    assert not accepts(manager, tokenizer, schema, '[{"name": "f", "parameters": {}, "y": 2}]')
    assert not accepts(manager, tokenizer, schema, '[{"name": "f", "parameters": {"z": 1}}]')
    # a schema that says so keeps its other keys; values and property names are not schemas
    call["additionalProperties"] = True
    assert accepts(manager, tokenizer, schema, '[{"name": "f", "parameters": {}, "y": 2}]')
    odd = {"properties": {"properties": {"enum": [{"properties": {}}]}}}
    assert accepts(manager, tokenizer, odd, '{"properties": {"properties": {}}}')
    assert not accepts(manager, tokenizer, odd, '{"properties": {"properties": {}}, "a": 1}')


def test_preempted_constrained_requests_resume_with_their_matchers(manager, tokenizer) -> None:
    # 6 blocks of 4 tokens: three prompts of 8 fill them, the first decode step preempts
    sched = make_scheduler(num_blocks=6, max_model_len=24, caching=False)
    d = GrammarDriver(sched, manager)
    pattern = r"[a-z]{14}\."
    for i, name in enumerate("abc"):
        sched.add_request(
            constrained(manager, name, prompt(8, 100 + 200 * i), 16, "regex", pattern)
        )
    d.run()
    assert sched.make_stats().num_preemptions >= 1
    for name in "abc":
        assert re.fullmatch(pattern, text(tokenizer, d.tokens(name))), name
        assert d.finish(name).finish_reason == FinishReason.STOP


def test_wire_rules_refuse_an_unknown_kind() -> None:
    request = EngineCoreRequest(
        "r",
        [5, 6],
        sampling_params=SamplingParams(structured_output=StructuredOutputParams("yaml", "x")),
    )
    with pytest.raises(RequestRuleError, match="structured_output.kind"):
        check_engine_request(request, VOCAB, 64)


# ---------------------------------------------------------------- the busy loop's side


class _Scheduler:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.requests: dict = {}

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def finish_requests(self, ids, reason) -> None:
        pass


@pytest.fixture
def core(checkpoint: str, tmp_path):
    input_queue: queue.Queue = queue.Queue()
    config = EngineConfig(model=ModelConfig(model=checkpoint), run_dir=str(tmp_path))
    engine = EngineCore(config, ShutdownRequest(input_queue), input_queue)
    engine.scheduler = _Scheduler()
    engine.structured_output = StructuredOutputManager(checkpoint, VOCAB, max_workers=1)
    engine.max_model_len = 64
    engine.embed_only = False
    engine.ready = EngineReady("e", 0, 64, 16, 16, 256, 0, 0, vocab_size=VOCAB)
    yield engine
    engine.structured_output.shutdown()
    engine.ctx.term()


def _wire(rid: str, kind: str, spec: str) -> EngineCoreRequest:
    return EngineCoreRequest(
        rid,
        [5, 6, 7],
        sampling_params=SamplingParams(
            eos_token_ids=[EOS], structured_output=StructuredOutputParams(kind, spec)
        ),
    )


def _drain(core: EngineCore) -> list:
    items = []
    while True:
        try:
            items.append(core.input_queue.get(timeout=0.2))
        except queue.Empty:
            return items


def test_busy_loop_admits_after_compile_and_fails_a_bad_spec_alone(core) -> None:
    good = intake.prepare_add(core, _wire("good", "json_schema", '{"type": "integer"}'))
    bad = intake.prepare_add(core, _wire("bad", "grammar", "start: nothing_defined"))
    core._handle_input(RequestType.ADD, good)
    core._handle_input(RequestType.ADD, bad)
    for kind, payload in _drain(core):
        assert kind == GRAMMAR_READY
        core._handle_input(kind, payload)
    assert core.scheduler.added == ["good"]
    assert not core.compiling
    client, outputs = core.output_queue.get_nowait()
    (failed,) = outputs.outputs
    assert failed.request_id == "bad" and failed.finish_reason == FinishReason.ERROR
    assert "nothing_defined" in failed.stop_reason


def test_an_aborted_compiling_request_is_never_scheduled(core) -> None:
    request = intake.prepare_add(core, _wire("gone", "regex", "[0-9]+"))
    core.compiling["gone"] = request  # as if still compiling when ADD was handled
    core._handle_input(RequestType.ABORT, ["gone"])
    for kind, payload in _drain(core):
        core._handle_input(kind, payload)
    intake.admit_compiled(core)
    assert core.scheduler.added == []


# ---------------------------------------------------------------- a resumed stream's grammar

ARRAY = json.dumps({"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 6, "maxItems": 6})


def test_a_resumed_request_replays_its_tokens_through_the_grammar(manager, tokenizer) -> None:
    """Cut off after k tokens and sent again with them as output (as the gateway resumes a
    stream): the new matcher has consumed them, and the rest is what the undisturbed run gave."""
    sched = make_scheduler(max_model_len=128)
    d = GrammarDriver(sched, manager)
    sched.add_request(constrained(manager, "j", prompt(4), 100, "json_schema", ARRAY))
    d.run()
    whole = d.tokens("j")
    assert len(whole) > 4 and d.finish("j").finish_reason == FinishReason.STOP
    for cut in (1, len(whole) // 2, len(whole) - 1):
        wire = EngineCoreRequest(
            "j",
            prompt(4),
            sampling_params=SamplingParams(
                max_tokens=100,
                eos_token_ids=[EOS],
                structured_output=StructuredOutputParams("json_schema", ARRAY),
            ),
            output_token_ids=whole[:cut],
        )
        resumed = Request.from_engine_core_request(wire, BS, 0)
        resumed.grammar = manager.start(
            wire.sampling_params.structured_output, [EOS], replay=whole[:cut]
        )
        resumed.grammar.future.result(timeout=60)
        assert resumed.grammar.resolve() is None
        sched = make_scheduler(max_model_len=128)
        d = GrammarDriver(sched, manager)
        sched.add_request(resumed)
        d.run()
        assert whole[:cut] + d.tokens("j") == whole, cut
        assert d.finish("j").finish_reason == FinishReason.STOP
        assert len(json.loads(text(tokenizer, whole))) == 6


def test_resumed_tokens_the_grammar_rejects_fail_the_request(manager, tokenizer) -> None:
    not_json = tokenizer.encode("hello", add_special_tokens=False).ids
    grammar = manager.start(StructuredOutputParams("json_schema", ARRAY), [EOS], replay=not_json)
    assert grammar.future.exception(60) is not None
    assert "does not fit" in grammar.resolve()
    whole = tokenizer.encode("[1, 2, 3, 1, 2, 3]", add_special_tokens=False).ids
    done = manager.start(
        StructuredOutputParams("json_schema", ARRAY), [EOS], replay=[*whole, whole[0]]
    )
    assert "already complete" in done.resolve()


def test_the_busy_loop_replays_a_resumed_add(core, tokenizer) -> None:
    wire = _wire("cut", "json_schema", ARRAY)
    wire.output_token_ids = tokenizer.encode("[2,", add_special_tokens=False).ids
    good = intake.prepare_add(core, wire)
    wrong = _wire("wrong", "json_schema", ARRAY)
    wrong.output_token_ids = tokenizer.encode("{", add_special_tokens=False).ids
    core._handle_input(RequestType.ADD, good)
    core._handle_input(RequestType.ADD, intake.prepare_add(core, wrong))
    for kind, payload in _drain(core):
        core._handle_input(kind, payload)
    assert core.scheduler.added == ["cut"]
    _, outputs = core.output_queue.get_nowait()
    (failed,) = outputs.outputs
    assert failed.request_id == "wrong" and failed.finish_reason == FinishReason.ERROR
    assert "does not fit" in failed.stop_reason


def test_tuple_items_are_closed_too() -> None:
    # "items" as a list (a tuple, the form before prefixItems) is walked like prefixItems
    schema = {"type": "array", "items": [{"properties": {"a": {}}}]}
    assert closed_objects(schema)["items"][0]["additionalProperties"] is False
