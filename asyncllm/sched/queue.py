"""The waiting queue, one class per `scheduling_policy`.

`peek`/`pop` give the next request to admit; `add` queues a new request and
`add_preempted` puts a preempted one back so that it is admitted before the
requests that arrived after it. Each queue keeps `num_tokens`, the known
tokens of its requests, and the adapters of its requests (`lora_names`) in
O(1) per change (admission control and the per-step stats read them), and
drops aborted requests in O(1) each: FCFS keeps an insertion-ordered dict, the
priority heap marks removed entries dead and skips them (lazy deletion).
"""

from __future__ import annotations

import abc
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterator

from asyncllm.sched.request import Request

__all__ = ["RequestQueue", "FCFSRequestQueue", "PriorityRequestQueue", "create_request_queue"]

_DEAD_SLACK = 64
"""Dead heap entries tolerated beyond the live ones before the heap is rebuilt without them."""


class RequestQueue(abc.ABC):
    """Waiting requests in admission order (one entry per request_id)."""

    num_tokens: int = 0
    """Sum of `Request.num_tokens` over the queued requests (a waiting request does not grow)."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self._lora_counts: dict[str, int] = {}

    @property
    def lora_names(self) -> list[str]:
        """The names of the adapters of the queued requests, sorted."""
        return sorted(self._lora_counts)

    def _account(self, request: Request, sign: int) -> None:
        """Count `request` in (+1) or out (-1) of `num_tokens` and the adapter counts."""
        self.num_tokens += sign * request.num_tokens
        if request.lora is not None:
            name = request.lora.lora_name
            count = self._lora_counts.get(name, 0) + sign
            if count:
                self._lora_counts[name] = count
            else:
                del self._lora_counts[name]

    @abc.abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request (not queued already: an AssertionError)."""

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
        """Drop the given requests (aborted) in O(1) amortized each; ids not queued are ignored."""

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
        super().__init__()
        self._queue: OrderedDict[str, Request] = OrderedDict()

    def add(self, request: Request) -> None:
        assert request.request_id not in self._queue, "queued twice: num_tokens and the adapters would count it twice"
        self._queue[request.request_id] = request
        self._account(request, 1)

    def add_preempted(self, request: Request) -> None:
        self.add(request)
        self._queue.move_to_end(request.request_id, last=False)

    def peek(self) -> Request:
        for request in self._queue.values():
            return request
        raise IndexError("peek from an empty queue")

    def pop(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty queue")
        request = self._queue.popitem(last=False)[1]
        self._account(request, -1)
        return request

    def remove_requests(self, req_ids: Collection[str]) -> None:
        for req_id in req_ids:
            request = self._queue.pop(req_id, None)
            if request is not None:
                self._account(request, -1)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue.values())


_Entry = tuple[int, float, int, Request]


class PriorityRequestQueue(RequestQueue):
    """Lower `priority` first, then earlier `arrival_time`, then insertion order.

    A preempted request keeps its key, so it goes back ahead of every request
    of the same priority that arrived after it. A removed request's heap entry
    stays, dead (no longer its request_id's entry in `_live`), until it reaches
    the top or dead entries outnumber the live ones by more than `_DEAD_SLACK`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[_Entry] = []
        self._live: dict[str, _Entry] = {}
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        assert request.request_id not in self._live, "queued twice: num_tokens and the adapters would count it twice"
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)
        self._live[request.request_id] = entry
        self._account(request, 1)

    def add_preempted(self, request: Request) -> None:
        self.add(request)

    def _top(self) -> _Entry:
        """The first live entry, dead ones above it popped (IndexError when empty)."""
        heap, live = self._heap, self._live
        while live.get(heap[0][3].request_id) is not heap[0]:
            heapq.heappop(heap)
        return heap[0]

    def peek(self) -> Request:
        return self._top()[3]

    def pop(self) -> Request:
        self._top()
        request = heapq.heappop(self._heap)[3]
        del self._live[request.request_id]
        self._account(request, -1)
        return request

    def remove_requests(self, req_ids: Collection[str]) -> None:
        for req_id in req_ids:
            entry = self._live.pop(req_id, None)
            if entry is not None:
                self._account(entry[3], -1)
        if len(self._heap) > 2 * len(self._live) + _DEAD_SLACK:
            live = self._live
            self._heap = [entry for entry in self._heap if live.get(entry[3].request_id) is entry]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._live.values(), key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    """The queue for `scheduling_policy` ('fcfs' or 'priority')."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise AssertionError(f"unknown scheduling policy {policy!r} (EngineConfig validates it)")
