"""`DeadlineHeap` (asyncllm/sched/deadlines.py) under drawn request lifetimes (hypothesis), against a dict of the
live requests and their deadlines.

Drawn: operations as the scheduler makes them (asyncllm/sched/scheduler.py `add_request`, `_finish_unscheduled`,
`finish_expired_requests`): add requests, each with a timeout of a few half-seconds (so deadlines tie), a far
future one or none, passing the scheduler's unfinished requests counted with the new one; add a new `Request`
under the id of a finished one (the scheduler refuses an id only while its request is unfinished); finish a live
request another way (stop, length, abort); a burst of requests with one long timeout that each finish right after
they arrive (the finished entries pile up until an add drops them); move the clock on (by 0, by half-seconds, or
past every deadline) and check, timing out what the check returns.

The model: the live requests by id, with their deadline (or none) and add order, and the deadlines of the finished
requests' entries the heap may still hold (lazy deletion): dropped when due, or all at once when an add leaves the
heap more than 2 * live + 64 entries (its docstring's "plus a few"). Held: a check returns exactly the live
requests whose deadline is at or before now, earliest first and ties in add order, each once, never a finished
request (nor an old one under a reused id); after every add the heap holds at most 2 * live + 64 entries; its size
and `next_deadline` are the model's after every operation.
"""

from __future__ import annotations

import itertools
import os

from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncllm.sampling import SamplingParams
from asyncllm.sched.deadlines import DeadlineHeap
from asyncllm.sched.request import Request, RequestStatus

SLACK = 64
"""Finished entries the heap may hold beyond twice the live requests (the module's `_SLACK`)."""
FAR = 1e7
"""A timeout only the clock's jump past every deadline reaches."""
PARAMS = SamplingParams(max_tokens=4)
EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "300"))


class Model:
    """The heap under test, the clock, and what the heap should hold."""

    def __init__(self) -> None:
        self.heap = DeadlineHeap()
        self.now = 1000.0
        self.live: dict[str, tuple[Request, float | None, int]] = {}
        """The scheduler's unfinished requests by id: the request, its deadline (None: no timeout), its add order."""
        self.held: list[float] = []
        """Deadlines of finished requests whose entries the heap still holds."""
        self.reusable: list[str] = []
        """Ids of finished requests, none live again."""
        self.returned: dict[int, Request] = {}
        self._ids = itertools.count()
        self._order = itertools.count()

    def add(self, timeouts: list[float | None]) -> None:
        for timeout in timeouts:
            self._add(f"r{next(self._ids)}", timeout)

    def readd(self, index: int, timeout: float | None) -> None:
        if self.reusable:
            self._add(self.reusable.pop(index % len(self.reusable)), timeout)

    def finish(self, index: int, status: RequestStatus) -> None:
        if self.live:
            self._finish(list(self.live)[index % len(self.live)], status)

    def burst(self, count: int, timeout: float) -> None:
        """Requests that finish long before their timeout, as under a generous one."""
        for _ in range(count):
            request_id = f"r{next(self._ids)}"
            self._add(request_id, timeout)
            self._finish(request_id, RequestStatus.FINISHED_STOPPED)

    def check(self, seconds: float) -> None:
        """The clock moves on, then the scheduler times out what is due."""
        self.now += seconds
        due = sorted((deadline, order, request) for request, deadline, order in self.live.values()
                     if deadline is not None and deadline <= self.now)
        expected = [request for _, _, request in due]
        expired = self.heap.pop_expired(self.now)
        assert expired == expected, ([r.request_id for r in expired], [r.request_id for r in expected])
        assert not any(id(request) in self.returned for request in expired)  # each once
        self.returned.update((id(request), request) for request in expired)  # kept alive: ids stay unique
        self.held = [deadline for deadline in self.held if deadline > self.now]
        for request in expired:
            del self.live[request.request_id]
            request.finish(RequestStatus.FINISHED_TIMEOUT)
            self.reusable.append(request.request_id)

    def _add(self, request_id: str, timeout: float | None) -> None:
        request = Request(request_id, [5, 6], PARAMS, [2], self.now, timeout=timeout)
        deadline = None if timeout is None else self.now + timeout
        self.live[request_id] = (request, deadline, next(self._order))
        if deadline is None:
            return
        self.heap.add(request, deadline, len(self.live))
        bound = 2 * len(self.live) + SLACK
        if len(self.deadlines()) > bound:
            self.held = []
        assert len(self.heap) <= bound, (len(self.heap), len(self.live))

    def _finish(self, request_id: str, status: RequestStatus) -> None:
        request, deadline, _ = self.live.pop(request_id)
        request.finish(status)
        self.reusable.append(request_id)
        if deadline is not None:
            self.held.append(deadline)

    def deadlines(self) -> list[float]:
        """The deadlines of every entry the heap should hold."""
        return [deadline for _, deadline, _ in self.live.values() if deadline is not None] + self.held


timeouts = st.integers(1, 8).map(lambda n: n / 2) | st.sampled_from([FAR, None])
operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(timeouts, min_size=1, max_size=5)),
    st.tuples(st.just("readd"), st.integers(0, 99), timeouts),
    st.tuples(st.just("finish"), st.integers(0, 99), st.sampled_from([RequestStatus.FINISHED_STOPPED,
                                                                     RequestStatus.FINISHED_LENGTH,
                                                                     RequestStatus.FINISHED_ABORTED])),
    st.tuples(st.just("burst"), st.integers(1, 90), st.sampled_from([4.0, FAR])),
    st.tuples(st.just("check"), st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0, 2 * FAR])),
), max_size=40)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@given(operations)
# Tied deadlines come out in add order
@example([("add", [1.0, 0.5, 1.0, 1.0]), ("check", 0.5), ("check", 0.5)])
# An id reused after its request was aborted: the new request times out, the old entry never comes back
@example([("add", [1.0]), ("finish", 0, RequestStatus.FINISHED_ABORTED), ("readd", 0, 1.0), ("check", 1.0)])
# Finished requests with far deadlines are dropped once they pass twice the live requests plus 64
@example([("add", [FAR, None]), ("burst", 90, FAR), ("add", [FAR]), ("check", 2 * FAR)])
def test_a_check_returns_the_due_live_requests_once_and_finished_ones_do_not_pile_up(ops) -> None:
    model = Model()
    for name, *args in ops:
        getattr(model, name)(*args)
        deadlines = model.deadlines()
        assert len(model.heap) == len(deadlines), (name, len(model.heap), len(deadlines))
        assert model.heap.next_deadline() == min(deadlines, default=None)
