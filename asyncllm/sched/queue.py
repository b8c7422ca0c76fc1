"""The waiting queue, one class per `scheduling_policy`.

`peek`/`pop` give the next request to admit; `add` queues a new request and
`add_preempted` puts a preempted one back so that it is admitted before the
requests that arrived after it. Each queue keeps `num_tokens`, the known
tokens of its requests, in O(1) per change (admission control reads it).
"""

from __future__ import annotations

import abc
import heapq
import itertools
from collections import deque
from collections.abc import Collection, Iterator

from asyncllm.sched.request import Request

__all__ = ["RequestQueue", "FCFSRequestQueue", "PriorityRequestQueue", "create_request_queue"]


class RequestQueue(abc.ABC):
    """Waiting requests in admission order."""

    num_tokens: int = 0
    """Sum of `Request.num_tokens` over the queued requests (a waiting request does not grow)."""

    @abc.abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abc.abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Queue a preempted request so that it goes before later arrivals."""

    @abc.abstractmethod
    def peek(self) -> Request:
        """The next request to admit (IndexError when empty)."""

    @abc.abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request to admit (IndexError when empty)."""

    @abc.abstractmethod
    def remove_requests(self, req_ids: Collection[str]) -> None:
        """Drop the given requests (aborted); O(queue length)."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self.num_tokens = 0

    def add(self, request: Request) -> None:
        self._queue.append(request)
        self.num_tokens += request.num_tokens

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)
        self.num_tokens += request.num_tokens

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        request = self._queue.popleft()
        self.num_tokens -= request.num_tokens
        return request

    def remove_requests(self, req_ids: Collection[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in req_ids)
        self.num_tokens = sum(r.num_tokens for r in self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lower `priority` first, then earlier `arrival_time`, then insertion order.

    A preempted request keeps its key, so it goes back ahead of every request
    of the same priority that arrived after it.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self.num_tokens = 0

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))
        self.num_tokens += request.num_tokens

    def add_preempted(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        request = heapq.heappop(self._heap)[3]
        self.num_tokens -= request.num_tokens
        return request

    def remove_requests(self, req_ids: Collection[str]) -> None:
        self._heap = [entry for entry in self._heap if entry[3].request_id not in req_ids]
        heapq.heapify(self._heap)
        self.num_tokens = sum(entry[3].num_tokens for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    """The queue for `scheduling_policy` ('fcfs' or 'priority')."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise AssertionError(f"unknown scheduling policy {policy!r} (EngineConfig validates it)")
