"""`FairJobQueue`: the compile threads' queue, fair between clients (docs/sampling.md#structured-output).

Each client (a `client_id`: one host process sharing the core) has its own
queue of compile jobs. A free compile thread takes the next job of the client
that runs the fewest compiles now, clients with as few taking turns (round
robin), so one client's many grammars wait behind each other, not in front of
another client's. A compile in xgrammar's C++ cannot be interrupted: when every
thread is busy and a client with a queued job runs none while another client
runs more than its share of the threads, the queue is `starved` and the pool
starts one more thread for it (`GrammarCompilerPool`).

A job shared by several clients' requests (the cache's one job per constraint)
waits in each of their queues and runs once, charged to the client whose turn
took it: `take` marks its future running, under the queue's lock.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future
from typing import Any

__all__ = ["CompileJob", "FairJobQueue"]


class CompileJob:
    """One constraint to compile: its future (shared by every request that waits for it), cache key and (kind, text).
    Queued again for another client, it is another `CompileJob` of the same future."""

    __slots__ = ("constraint", "future", "key")

    def __init__(self, future: Future[Any], key: bytes, constraint: tuple[str, str]) -> None:
        self.future, self.key, self.constraint = future, key, constraint


class FairJobQueue:
    """Compile jobs queued by client; `take` serves the client running the fewest, in turns. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queued: OrderedDict[bytes, deque[CompileJob]] = OrderedDict()
        """Clients with queued jobs, the next to be served first (a served client goes last)."""
        self._members: dict[bytes, set[Future[Any]]] = {}
        """The futures in each client's queue (`put` queues a future once per client)."""
        self._running: Counter[bytes] = Counter()
        """Compiles each client's turn took and that are not `done` yet."""
        self._idle = 0
        """Compile threads not compiling (waiting in `take`, or about to)."""
        self._closed = False

    def put(self, job: CompileJob, client_id: bytes) -> None:
        """Queue `job` for `client_id`, unless its future is already in that client's queue (another client's request
        waiting for a queued job: its future in this client's queue too)."""
        with self._cond:
            members = self._members.setdefault(client_id, set())
            if job.future not in members:  # a set: a client's thousands of queued grammars cost no scan
                members.add(job.future)
                self._queued.setdefault(client_id, deque()).append(job)
                self._cond.notify()

    def add_thread(self) -> None:
        """A compile thread starts: free (not compiling) until it takes a job."""
        with self._cond:
            self._idle += 1

    def take(self) -> tuple[CompileJob, bytes] | None:
        """The next job, marked running, and the client charged with it (until `done`), waiting for one; None once
        `close`d."""
        with self._cond:
            while not self._closed:
                client_id = self._next_client()
                if client_id is None:
                    self._cond.wait()
                    continue
                self._queued.move_to_end(client_id)  # its turn is over
                job = self._pop_head(client_id)
                if job.future.set_running_or_notify_cancel():  # else cancelled since `_next_client` looked
                    self._running[client_id] += 1
                    self._idle -= 1
                    return job, client_id
            return None

    def done(self, client_id: bytes, leaving: bool) -> None:
        """A job `take` charged to `client_id` finished; its thread takes the next one, or goes (`leaving`)."""
        with self._cond:
            self._running[client_id] -= 1
            if self._running[client_id] <= 0:
                del self._running[client_id]
            if not leaving:
                self._idle += 1

    def starved(self, num_threads: int) -> bool:
        """Whether a client waits with no compile running while every thread is busy and another client runs more than
        its share of the `num_threads` (a free thread would serve it next, more threads would not help)."""
        with self._cond:
            self._drop_started()
            if self._idle or not any(self._running[c] == 0 for c in self._queued):
                return False
            share = max(1, num_threads // len(self._running.keys() | self._queued.keys()))
            return any(count > share for count in self._running.values())

    def close(self) -> None:
        """`take` returns None from now on (the queued jobs stay: their futures are the pool's to cancel)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def statistics(self) -> dict[bytes, tuple[int, int]]:
        """client id -> (compiles running, jobs queued) of every client with either."""
        with self._cond:
            self._drop_started()
            clients = list(self._running) + [c for c in self._queued if c not in self._running]
            return {c: (self._running[c], len(self._queued.get(c, ()))) for c in clients}

    def _next_client(self) -> bytes | None:
        """The client with queued jobs that runs the fewest, the first in turn among them."""
        self._drop_started()
        return min(self._queued, key=lambda c: self._running[c], default=None)  # min keeps the first of equals

    def _drop_started(self) -> None:
        """Forget the jobs at the queues' heads that a thread took (from another client's queue) or that were
        cancelled while queued."""
        for client_id in list(self._queued):
            jobs = self._queued[client_id]
            while client_id in self._queued and (jobs[0].future.running() or jobs[0].future.done()):
                self._pop_head(client_id)

    def _pop_head(self, client_id: bytes) -> CompileJob:
        """The first job of `client_id`'s queue, taken out (the client out of `_queued` once it has none)."""
        jobs = self._queued[client_id]
        job = jobs.popleft()
        self._members[client_id].discard(job.future)
        if not jobs:
            del self._queued[client_id], self._members[client_id]
        return job
