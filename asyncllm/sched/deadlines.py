"""`DeadlineHeap`: per-request timeouts, checked in O(1) when none is due.

The core checks deadlines every loop iteration (each step, and every idle
poll), so the check must cost nothing when no deadline passed: a heap keyed
by deadline answers with one comparison. Entries of requests that finished
another way stay in the heap until their deadline and are then dropped
(lazy deletion), so finishing a request never walks the heap.
"""

from __future__ import annotations

import heapq
import itertools

from asyncllm.sched.request import Request

__all__ = ["DeadlineHeap"]


class DeadlineHeap:
    """Requests by deadline (``time.monotonic()`` seconds)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._counter), request))

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
