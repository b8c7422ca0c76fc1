"""The compile threads' `FairJobQueue` under drawn traffic (hypothesis), one thread driving it as the pool's would.

Clients queue jobs (some shared: another client's request waits for the same
compile), threads take and finish them, and queued jobs are cancelled. Each take
must serve, among the clients with a job waiting, the first in turn of those that
run the fewest compiles (a served client's turn comes last; so does a client's
that had nothing waiting), with that client's oldest waiting job. A job runs at most once, a cancelled
one never. `starved` holds exactly when every thread is busy, a waiting client runs
none, and another runs more than its share. Once the drawn traffic ends, the
threads take everything left: every job that was not cancelled ran.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.structured.fair_queue import CompileJob, FairJobQueue

CLIENTS = [b"a", b"b", b"c"]


class Model:
    """What the queue must hold: each client's waiting futures in order, and the compiles each client runs."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.idle = threads
        self.waiting: dict[bytes, list[Future]] = {client: [] for client in CLIENTS}
        self.running: dict[bytes, list[Future]] = {client: [] for client in CLIENTS}
        self.jobs: list[Future] = []
        self.turns: list[bytes] = []
        """The clients with a live job waiting, next to be served first: a served client goes last, a client
        that had none waiting joins last."""

    def live(self, client: bytes) -> list[Future]:
        return [f for f in self.waiting[client] if not (f.running() or f.done())]

    def clients_waiting(self) -> list[bytes]:
        return [client for client in CLIENTS if self.live(client)]

    def next_client(self) -> bytes:
        """The first in turn among the waiting clients that run the fewest compiles."""
        fewest = min(len(self.running[client]) for client in self.turns)
        return next(client for client in self.turns if len(self.running[client]) == fewest)

    def settle(self) -> None:
        """Clients whose waiting jobs all started (another client's turn took a shared one) or were cancelled
        leave the turns."""
        self.turns = [client for client in self.turns if self.live(client)]

    def starved(self, num_threads: int) -> bool:
        waiting = self.clients_waiting()
        if self.idle or not any(not self.running[client] for client in waiting):
            return False
        clients = {client for client in CLIENTS if self.running[client]} | set(waiting)
        share = max(1, num_threads // len(clients))
        return any(len(futures) > share for futures in self.running.values())


def _take(queue: FairJobQueue) -> tuple[CompileJob, bytes]:
    """`take`, failing instead of hanging when the queue thinks it has nothing for a free thread."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(queue.take()), daemon=True)
    thread.start()
    thread.join(timeout=5)
    if thread.is_alive():
        queue.close()
        thread.join(timeout=5)
        raise AssertionError("take waited although a job was queued")
    assert result[0] is not None
    return result[0]


def take(queue: FairJobQueue, model: Model) -> None:
    """A free thread takes a job: the oldest live one of `Model.next_client`."""
    model.settle()
    expected = model.next_client()
    oldest = model.live(expected)[0]
    job, client = _take(queue)
    assert (client, job.future) == (expected, oldest) and oldest.running()
    model.turns.remove(client)
    model.turns.append(client)
    model.running[client].append(job.future)
    model.idle -= 1


def finish(queue: FairJobQueue, model: Model, client: bytes, leaving: bool) -> None:
    """The oldest compile charged to ``client`` ends; its thread is free again, or goes (``leaving``: one the pool
    started for a starved client)."""
    future = model.running[client].pop(0)
    future.set_result(None)
    queue.done(client, leaving)
    model.threads -= leaving
    model.idle += not leaving


@st.composite
def traffic(draw: st.DrawFn) -> tuple[int, list[tuple[str, int, int]]]:
    kinds = ["put"] * 4 + ["share", "take", "take", "take", "finish", "cancel", "grow"]
    clients = draw(st.lists(st.integers(0, len(CLIENTS) - 1), min_size=1, max_size=6))  # some busier than others
    op = st.tuples(st.sampled_from(kinds), st.sampled_from(clients), st.integers(0, 30))
    return draw(st.integers(1, 4)), draw(st.lists(op, min_size=1, max_size=40))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=traffic())
# starved, which drawn traffic seldom reaches: a and c run every thread, b waits; a thread leaves, b waits
@example(case=(4, [("put", 0, 0)] * 3 + [("take", 0, 0)] * 3 + [("put", 2, 0), ("take", 2, 0), ("put", 1, 0)]))
@example(case=(2, [("grow", 0, 0)] + [("put", 0, 0)] * 3 + [("take", 0, 0)] * 3 + [("finish", 0, 0), ("put", 1, 0)]))
def test_each_take_serves_the_fewest_running_client_and_every_job_runs_once(case) -> None:
    threads, ops = case
    queue, model = FairJobQueue(), Model(threads)
    for _ in range(threads):
        queue.add_thread()
    for kind, c, pick in ops:
        client = CLIENTS[c]
        if kind == "put":
            future: Future = Future()
            model.jobs.append(future)
            _put(queue, model, future, client)
        elif kind == "share" and model.jobs:  # another client's request waits for a job queued or running
            _put(queue, model, model.jobs[pick % len(model.jobs)], client)
        elif kind == "take" and model.idle and model.clients_waiting():
            take(queue, model)
        elif kind == "finish" and model.running[client]:
            finish(queue, model, client, leaving=model.threads > 1 and pick % 3 == 0)
        elif kind == "grow":  # the pool starts a thread (for a starved client)
            queue.add_thread()
            model.threads += 1
            model.idle += 1
        elif kind == "cancel" and model.jobs:
            model.jobs[pick % len(model.jobs)].cancel()  # refused unless still queued
        model.settle()
        running = {client: len(model.running[client]) for client in CLIENTS
                   if model.running[client] or model.live(client)}
        assert {client: r for client, (r, _) in queue.statistics().items()} == running
        for num_threads in (1, model.threads, model.threads + 2):
            assert queue.starved(num_threads) == model.starved(num_threads), num_threads
    _drain(queue, model)


def _put(queue: FairJobQueue, model: Model, future: Future, client: bytes) -> None:
    queue.put(CompileJob(future, b"key", ("regex", "x")), client)
    if not (future.running() or future.done()) and future not in model.waiting[client]:
        model.waiting[client].append(future)
        if client not in model.turns:
            model.turns.append(client)


def _drain(queue: FairJobQueue, model: Model) -> None:
    """The threads take and finish everything left: each job not cancelled ran once, in one client's turn."""
    while model.clients_waiting():
        if not model.idle:
            finish(queue, model, next(c for c in CLIENTS if model.running[c]), leaving=False)
        take(queue, model)
    for client in CLIENTS:
        while model.running[client]:
            finish(queue, model, client, leaving=False)
    assert all(future.done() for future in model.jobs)
    assert all(future.cancelled() or future.result() is None for future in model.jobs)
    assert queue.statistics() == {}
