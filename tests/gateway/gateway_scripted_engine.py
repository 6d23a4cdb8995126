"""A scripted engine-core peer for gateway tests: the real wire 1 (zmq), no scheduler, no model.

It connects a DEALER and a PUSH like an engine core, sends READY, and answers each ADD by pushing
one token per step from a fixed script until max_tokens (finish LENGTH), sending heartbeats in
between. As an engine core does, it checks each ADD against the wire's request rules first and
fails one that breaks a rule with ERROR, naming the rule. When a request asks for logprobs it
makes some up (``fake_logprobs``). Tests steer it with ``mode`` and inspect what it received
(adds, aborts, utility calls).
"""

from __future__ import annotations

import asyncio
import itertools
import time

import zmq
import zmq.asyncio

from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import (
    ENGINE_CORE_DEAD,
    EngineCoreEvent,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EventType,
    FinishReason,
    RequestType,
    SchedulerStats,
    TokenLogprobs,
    UtilityOutput,
)
from switchboard.wire.lora import lora_name_of
from switchboard.wire.request_rules import RequestRuleError, check_engine_request


def fake_logprobs(token_id: int, num_top: int) -> TokenLogprobs:
    """The chosen token at rank 2 behind ``token_id + 1``, then ``num_top`` alternatives."""
    top = [token_id + 1, token_id, token_id + 2][:num_top]
    return TokenLogprobs(
        [token_id, *top], [-1.0, *[-0.5 - i for i in range(len(top))]], [2, *range(1, len(top) + 1)]
    )


class ScriptedEngine:
    def __init__(
        self,
        input_address: str,
        output_address: str,
        script_token_ids: list[int],
        *,
        max_model_len: int = 64,
        vocab_size: int = 300,
        step_s: float = 0.005,
        heartbeat_s: float = 0.1,
        rank: int = 0,
    ) -> None:
        self.input_address = input_address
        self.output_address = output_address
        self.script = script_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.heartbeat_s = heartbeat_s
        self.rank = rank
        self.engine_id = f"scripted-{rank}"
        self.mode = "normal"  # normal | hang (accept, never answer) | error (finish ERROR)
        self.stop_at_script_end = False  # finish STOP after the script's last token (no cycle)
        self.silent = False  # stop all outputs and heartbeats (a silent death)
        # Per engine request id: seconds between QUEUED and SCHEDULED, and the step at which
        # it is preempted (PREEMPTED, one step away, SCHEDULED again with the next token).
        self.schedule_delay_s: dict[str, float] = {}
        self.preempt_at_step: dict[str, int] = {}
        # Every request waits before its step ``k`` until ``holds[k]`` is set; heartbeats go on
        # meanwhile (an engine alive whose streams pause).
        self.holds: dict[int, asyncio.Event] = {}
        self.added: dict[str, EngineCoreRequest] = {}
        self.aborted: list[str] = []
        self.rejected: dict[str, str] = {}  # request id -> the wire rule it broke
        self.utility_calls: list[tuple[str, list]] = []
        # The LoRA adapters it holds (``list_loras``); a request for another is refused as the
        # engine core refuses it.
        self.lora_adapters: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []
        self._ctx = zmq.asyncio.Context()
        self._dealer: zmq.asyncio.Socket | None = None
        self._push: zmq.asyncio.Socket | None = None

    async def start(self) -> None:
        identity = zmq_channel.engine_identity(self.rank)
        self._dealer = zmq_channel.make_socket(
            self._ctx, zmq.DEALER, self.input_address, bind=False, identity=identity
        )
        self._push = zmq_channel.make_socket(self._ctx, zmq.PUSH, self.output_address, bind=False)
        ready = EngineReady(
            engine_id=self.engine_id,
            data_parallel_rank=self.rank,
            max_model_len=self.max_model_len,
            num_gpu_blocks=32,
            block_size=16,
            kv_capacity_tokens=512,
            wall_clock_ns=time.time_ns(),
            monotonic_ns=time.monotonic_ns(),
            vocab_size=self.vocab_size,
            dtype="float32",
        )
        await self._dealer.send(zmq_channel.encode(ready))
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._beat())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in (self._dealer, self._push):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    async def send_raw(self, frames: list[bytes]) -> None:
        assert self._push is not None
        await self._push.send_multipart(frames)

    async def die(self) -> None:
        self.silent = True
        await self.send_raw([ENGINE_CORE_DEAD])

    async def _push_outputs(self, outputs: EngineCoreOutputs) -> None:
        if not self.silent:
            await self.send_raw([zmq_channel.encode(outputs)])

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            stats = SchedulerStats(num_running_reqs=len(self.added) - len(self.aborted))
            await self._push_outputs(
                EngineCoreOutputs(
                    engine_index=self.rank,
                    timestamp_ns=time.monotonic_ns(),
                    scheduler_stats=stats,
                    heartbeat=True,
                    exports_engine_stats=True,  # the only engine of its only gateway
                )
            )

    async def _recv_loop(self) -> None:
        assert self._dealer is not None
        while True:
            frames = await self._dealer.recv_multipart()
            request_type, body, _ = zmq_channel.parse_request_frames(frames)
            if request_type is RequestType.ADD:
                self.added[body.request_id] = body
                try:
                    check_engine_request(body, self.vocab_size, self.max_model_len)
                except RequestRuleError as error:  # as the engine core's _reject
                    self.rejected[body.request_id] = str(error)
                    failed = EngineCoreOutput(body.request_id, [], finish_reason=FinishReason.ERROR)
                    failed.stop_reason = str(error)
                    await self._push_outputs(EngineCoreOutputs(self.rank, outputs=[failed]))
                    continue
                adapter = lora_name_of(body.lora_request)
                if adapter and adapter not in self.lora_adapters:
                    refused = EngineCoreOutput(
                        body.request_id,
                        finish_reason=FinishReason.ERROR,
                        stop_reason=f"LoRA adapter {adapter!r} is not loaded",
                        lora_not_loaded=adapter,
                    )
                    await self._push_outputs(EngineCoreOutputs(self.rank, outputs=[refused]))
                    continue
                self._tasks.append(asyncio.create_task(self._generate(body)))
            elif request_type is RequestType.ABORT:
                self.aborted.extend(body)
            elif request_type is RequestType.UTILITY:
                self.utility_calls.append((body.method_name, body.args))
                reply = UtilityOutput(body.call_id, result={"method": body.method_name})
                if body.method_name == "list_loras":
                    reply = UtilityOutput(body.call_id, result=dict(self.lora_adapters))
                if body.method_name == "is_sleeping":
                    reply = UtilityOutput(body.call_id, failure_message="not today")
                await self._push_outputs(EngineCoreOutputs(self.rank, utility_output=reply))

    async def _generate(self, request: EngineCoreRequest) -> None:
        queued = EngineCoreEvent(EventType.QUEUED, time.monotonic_ns())
        if self.mode == "hang":
            return
        if request.pooling_params is not None:  # Embed: a made-up vector, at once
            await asyncio.sleep(self.step_s)
            pooled = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.STOP)
            pooled.pooled_output = [0.6, 0.8, 0.0, 0.0]
            await self._push_outputs(
                EngineCoreOutputs(self.rank, time.monotonic_ns(), outputs=[pooled])
            )
            return
        assert request.sampling_params is not None
        max_tokens = request.sampling_params.max_tokens
        tokens = itertools.cycle(self.script)
        await asyncio.sleep(self.schedule_delay_s.get(request.request_id, 0.0))
        num_preemptions = 0
        for step in range(max_tokens):
            await asyncio.sleep(self.step_s)
            if request.request_id in self.aborted:
                return
            if step in self.holds:
                await self.holds[step].wait()
            resumed = None
            if step == self.preempt_at_step.get(request.request_id):
                preempted = EngineCoreEvent(EventType.PREEMPTED, time.monotonic_ns())
                await asyncio.sleep(self.step_s)
                resumed = [preempted, EngineCoreEvent(EventType.SCHEDULED, time.monotonic_ns())]
                num_preemptions += 1
            output = EngineCoreOutput(request.request_id, [next(tokens)])
            output.num_preemptions = num_preemptions
            if resumed is not None:
                output.events = resumed
            params = request.sampling_params
            if params.logprobs is not None:
                output.new_logprobs = [fake_logprobs(output.new_token_ids[0], params.logprobs)]
            if step == 0:
                scheduled = EngineCoreEvent(EventType.SCHEDULED, time.monotonic_ns())
                output.events = [queued, scheduled]
                output.num_cached_tokens = 2
                if params.prompt_logprobs is not None:
                    output.prompt_logprobs = [
                        fake_logprobs(t, params.prompt_logprobs)
                        for t in request.prompt_token_ids[1:]
                    ]
            if self.mode == "error":
                output.finish_reason = FinishReason.ERROR
            elif self.stop_at_script_end and step == len(self.script) - 1:
                output.finish_reason = FinishReason.STOP
            elif step == max_tokens - 1:
                output.finish_reason = FinishReason.LENGTH
            await self._push_outputs(
                EngineCoreOutputs(self.rank, time.monotonic_ns(), outputs=[output])
            )
            if output.finish_reason is not None:
                return
