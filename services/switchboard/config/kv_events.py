"""``--kv-events-config``: vLLM's ``KVEventsConfig``, the same JSON keys and defaults, so that a
deployment written for ``vllm serve`` works unchanged. Decoded (and checked) as the command
line is parsed; a key vLLM has and this server cannot honour is refused there, by name."""

from typing import Annotated, Literal

import msgspec

from switchboard.config.struct import Config

_PORT_PREFIXES = ("tcp://", "ipc://", "inproc://")


class KVEventsConfig(Config, frozen=True):
    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null" (as vLLM resolves it).
    publisher: Literal["null", "zmq"] | None = None
    # The PUB socket; DP rank r publishes on the port + r (wire/kv_events.py, offset_endpoint).
    endpoint: str = "tcp://*:5557"
    # The ROUTER answering replay requests (None: no replay); offset by the rank the same way.
    replay_endpoint: str | None = None
    buffer_steps: Annotated[int, msgspec.Meta(ge=1)] = 10_000  # batches kept for replay
    hwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000  # the PUB socket's send high-water mark
    max_queue_size: Annotated[int, msgspec.Meta(ge=1)] = 100_000  # batches waiting to be sent
    topic: str = ""

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_PORT_PREFIXES):
                raise ValueError(f"{name} {value!r} must start with tcp://, ipc:// or inproc://")
            if value is not None and value.startswith("tcp://"):
                port = value.rpartition(":")[2]
                if not port.isdigit():
                    raise ValueError(f"{name} {value!r} must end with a port")

    def port_clash(self, data_parallel_size: int) -> str | None:
        """Why the ranks' endpoints would collide (each rank adds its rank to both ports), or
        None: vLLM's layout, 5557 and 5558 for two ranks, would give rank 1's PUB port to
        rank 0's replay socket."""
        if not self.enabled or self.replay_endpoint is None:
            return None
        ends = (self.endpoint, self.replay_endpoint)
        if not all(e.startswith("tcp://") for e in ends):
            return None
        (host, _, pub), (replay_host, _, replay) = (e.rpartition(":") for e in ends)
        if host == replay_host and abs(int(pub) - int(replay)) < data_parallel_size:
            return (
                f"endpoint {self.endpoint} and replay_endpoint {self.replay_endpoint}: DP rank r "
                f"uses both ports + r, so with {data_parallel_size} ranks they must be at least "
                f"{data_parallel_size} apart"
            )
        return None

    @property
    def enabled(self) -> bool:
        """Events are published (vLLM: enabled, and a publisher other than "null")."""
        return self.enable_kv_cache_events and self.publisher != "null"
