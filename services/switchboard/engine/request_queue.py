"""Waiting queues: first come first served, or by (priority, arrival).

Both put a preempted request ahead of the requests that arrived after it: FCFS at the very
front (it was running, so it came before everything still waiting), priority by its original
key (so it goes ahead of later arrivals of its own priority but not of more urgent ones).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from switchboard.engine.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def add_preempted(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove_requests(self, requests: set[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: set[Request]) -> None:
        """Drop these requests (aborts): one O(n) pass for any number of them."""
        self._queue = deque(r for r in self._queue if r not in requests)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """A heap of (priority, arrival_ns, sequence, request): lower priority value first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Request]] = []
        self._seq = 0  # unique tie-break, so Request objects are never compared

    def add(self, request: Request) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_ns, self._seq, request))

    add_preempted = add  # the original (priority, arrival) key already places it right

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: set[Request]) -> None:
        """Drop these requests (aborts): one O(n) pass for any number of them."""
        self._heap = [entry for entry in self._heap if entry[3] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r} (fcfs | priority)")
