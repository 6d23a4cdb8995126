"""LoRA in the engine without a model: prefix-cache hashes keyed by adapter, at most
``max_loras`` adapters running at once, the adapter sent to the workers, the registry's
refusals (unknown adapter, unloading one in use)."""

from __future__ import annotations

import itertools

import pytest
from fake_worker import Driver, FakeWorker

from switchboard.config import CacheConfig, SchedulerConfig
from switchboard.config.lora import LoraConfig, parse_lora_modules
from switchboard.engine.lora_registry import EngineLoras, LoraError, adapters_file
from switchboard.engine.request import Request
from switchboard.engine.scheduler import Scheduler
from switchboard.wire.block_hash import extend_block_hashes
from switchboard.wire.engine_msgs import EngineCoreRequest, SamplingParams
from switchboard.wire.lora import lora_name_of, lora_request

BS = 4
_arrival = itertools.count(1)


def make_request(rid: str, prompt: list[int], adapter: str = "", max_tokens: int = 4) -> Request:
    engine_request = EngineCoreRequest(
        rid,
        prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        lora_request=lora_request(adapter),
    )
    return Request.from_engine_core_request(engine_request, BS, next(_arrival))


def test_block_hashes_are_keyed_by_adapter():
    tokens = list(range(100, 112))
    hashes = {}
    for adapter in ["", "a", "b"]:
        hashes[adapter] = []
        extend_block_hashes(hashes[adapter], tokens, BS, None, adapter)
    assert len({h for chain in hashes.values() for h in chain}) == 9  # no block shared
    again: list[bytes] = []
    extend_block_hashes(again, tokens, BS, None, "a")
    assert again == hashes["a"]
    assert make_request("r", tokens, "a").block_hashes == hashes["a"]
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, BS, "a", "")  # a salt "a" is not the adapter "a"
    assert salted[0] != hashes["a"][0]


def test_no_prefix_cache_hit_across_adapters():
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=BS), 64, 128, max_loras=2
    )
    driver = Driver(sched, FakeWorker(BS, 64))
    prompt = list(range(100, 117))
    sched.add_request(make_request("base", prompt))
    driver.run()
    for rid, adapter in [("a", "a"), ("a-again", "a"), ("b", "b")]:
        sched.add_request(make_request(rid, prompt, adapter))
        driver.run()
    assert [sched.requests.get(r) for r in ("a", "a-again", "b")] == [None] * 3
    cached = {
        out.request_id: out.num_cached_tokens
        for outs in driver.outputs.values()
        for out in outs
        if out.num_cached_tokens
    }
    assert cached == {"a-again": 16}  # only the same adapter's blocks are hits


def test_at_most_max_loras_adapters_run_at_once_and_workers_hear_the_adapter():
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=BS), 64, 128, max_loras=2
    )
    driver = Driver(sched, FakeWorker(BS, 64))
    adapters = ["a", "b", "c", "", "a", "c"]
    for i, adapter in enumerate(adapters):
        sched.add_request(make_request(f"r{i}-{adapter}", list(range(10 * i, 10 * i + 5)), adapter))
    first, first_result = driver.submit()
    # a and b take the two slots; c waits in its place while base and a's second request run
    assert list(first.num_scheduled_tokens) == ["r0-a", "r1-b", "r3-", "r4-a"]
    assert {n.request_id: n.lora_name for n in first.new_requests} == {
        "r0-a": "a",
        "r1-b": "b",
        "r3-": "",
        "r4-a": "a",
    }
    assert [r.request_id for r in sched.waiting] == ["r2-c", "r5-c"]
    driver.apply(first, first_result)
    driver.run()
    for step in driver.sched_outputs:
        running = {request_id.split("-")[1] for request_id in step.num_scheduled_tokens}
        assert len(running - {""}) <= 2, step.num_scheduled_tokens
    assert set(driver.outputs) == {f"r{i}-{a}" for i, a in enumerate(adapters)}
    assert any("r2-c" in step.num_scheduled_tokens for step in driver.sched_outputs)


class _Workers:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def collective_rpc(self, method: str, args=()):
        self.calls.append((method, tuple(args)))
        if method == "add_lora" and args[1] == "/bad":
            return {"error": f"LoRA adapter {args[0]!r} (/bad): no adapter_config.json"}
        return {"adapter": {"name": args[0]}} if method == "add_lora" else None


def test_the_registry_refuses_unknown_names_and_unloading_an_adapter_in_use():
    loras = EngineLoras(LoraConfig(enable_lora=True, lora_modules=["a=/a"]))
    workers = _Workers()
    loras.start(workers)
    assert loras.names() == {"a": "/a"} and workers.calls == [("add_lora", ("a", "/a"))]
    with pytest.raises(LoraError, match=r"'x' \(/bad\): no adapter_config.json"):
        loras.add("x", "/bad")
    assert loras.refusal(make_request("r", [1, 2], "x")) == "LoRA adapter 'x' is not loaded"
    assert loras.refusal(make_request("r", [1, 2], "a")) is None
    in_use = [make_request("r1", [1], "a"), make_request("r2", [1], "")]
    with pytest.raises(LoraError, match=r"'a' is in use by 1 request\(s\): 'r1'"):
        loras.remove("a", in_use)
    loras.remove("a", in_use[1:])
    assert loras.names() == {} and workers.calls[-1] == ("remove_lora", ("a",))
    with pytest.raises(LoraError, match="--enable-lora"):
        EngineLoras(LoraConfig()).add("a", "/a")


def test_lora_modules_and_lora_requests_are_checked():
    assert parse_lora_modules(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    for bad in (["a"], ["=/x"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
    assert lora_name_of(None) == "" and lora_name_of({"lora_name": "a", "lora_int_id": 3}) == "a"
    with pytest.raises(ValueError, match="lora_name"):
        lora_name_of({"lora_path": "/x"})


def test_a_restarted_engine_serves_the_adapters_it_served_before(tmp_path):
    """Every change is written to the run directory's file; an engine started again there loads
    that list instead of --lora-modules, and drops (logs) one that no longer loads."""
    config = LoraConfig(enable_lora=True, lora_modules=["a=/a"])
    saved = adapters_file(str(tmp_path), data_parallel_rank=1)
    assert saved is not None and adapters_file("", 1) is None  # no run directory: no file
    first = EngineLoras(config, saved)
    first.start(_Workers())
    first.add("b", "/b")
    first.add("c", "/c")
    first.remove("a", [])
    restarted, workers = EngineLoras(config, saved), _Workers()
    restarted.start(workers)
    assert restarted.names() == {"b": "/b", "c": "/c"}
    assert workers.calls == [("add_lora", ("b", "/b")), ("add_lora", ("c", "/c"))]
    (tmp_path / "lora-adapters-dp1.json").write_text('{"b": "/b", "x": "/bad"}')
    again = EngineLoras(config, saved)
    again.start(_Workers())
    assert again.names() == {"b": "/b"}
    other_rank = EngineLoras(config, adapters_file(str(tmp_path), data_parallel_rank=0))
    other_rank.start(_Workers())
    assert other_rank.names() == {"a": "/a"}  # its own first start: --lora-modules
