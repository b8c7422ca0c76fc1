"""`DeadlineHeap`: per-request timeouts, checked in O(1) when none is due.

The core checks deadlines every loop iteration (each step, and every idle
poll), so the check must cost nothing when no deadline passed: a heap keyed
by deadline answers with one comparison. Entries of requests that finished
another way stay in the heap (lazy deletion: finishing a request never walks
the heap) until their deadline, or until the heap holds more than twice the
requests the scheduler still has (plus a few): then the finished ones are
dropped at once, so a long timeout on every request keeps no finished
request alive past that (amortized O(1) per add).
"""

from __future__ import annotations

import heapq
import itertools

from asyncllm.sched.request import Request

__all__ = ["DeadlineHeap"]

_SLACK = 64
"""Finished entries the heap may hold beyond twice the live requests before it drops them."""


class DeadlineHeap:
    """Requests by deadline (``time.monotonic()`` seconds)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request, deadline: float, num_live: int) -> None:
        """`num_live`: the requests the scheduler holds (an upper bound of the unfinished ones here)."""
        heapq.heappush(self._heap, (deadline, next(self._counter), request))
        if len(self._heap) > 2 * num_live + _SLACK:
            self._heap = [entry for entry in self._heap if not entry[2].is_finished]
            heapq.heapify(self._heap)

    def next_deadline(self) -> float | None:
        """The earliest deadline still in the heap (maybe of a finished request)."""
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, now: float) -> list[Request]:
        """Unfinished requests whose deadline is at or before `now`, earliest first."""
        heap = self._heap
        if not heap or heap[0][0] > now:
            return []
        expired = []
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if not request.is_finished:
                expired.append(request)
        return expired

    def __len__(self) -> int:
        return len(self._heap)
