"""The host's admission estimate (asyncllm/engine/admission.py) against a simulated core, under drawn interleavings.

A host admits requests of n samples and t prompt tokens (token ids: the host's token estimate is exact), its
processor thread sends them in order (or refuses one first); a core model takes them in order and queues them or
refuses them by the documented rule (`check_queue_limits`: an empty queue accepts anything, else waiting + n may
not pass max_num_queued_requests nor waiting tokens + n x t max_num_queued_tokens), schedules (dequeues) samples,
fails or finishes requests, and takes snapshots (`SchedulerStats` with num_requests_waiting, num_waiting_tokens
and `host_samples_queued`; num_steps_total stamps when) at drawn moments, delivered later but in order. The
reference is the core's true queue at every moment, and which requests each snapshot counts.

Checked, from the module docstring:

- no under-count, whatever the timing: the estimate (samples and tokens) is never below the true queue, less
  another host's requests queued since the snapshot (seen only through snapshots);
- in the exact regime (requests reach the core in order, none aborted before a snapshot counts it, each failure
  handled before the next snapshot is seen, the host looks at a restarted core's lower count) the estimate is the
  latest snapshot plus the samples of this host's live requests it does not count: it over-counts by exactly the
  requests on their way to the core plus the samples taken off the queue since that snapshot;
- the host refuses exactly when the core's rule applied to that estimate refuses;
- a failed request (`Admitted.retract`) leaves the count unless the snapshot counts it; an ended one leaves once
  every request before it ended;
- no leak: once everything ended and a last snapshot came, the estimate is that snapshot's and nothing is kept.

The lagged regime adds what the exact one leaves out and the docstring still calls safe: requests aborted before
they were sent, and the estimate seeing a newer snapshot before the event loop handles the failures delivered
earlier. The engine no longer lets the second happen (it hands the estimate each snapshot with its delivery,
`admission.Delivered`, since 2026-12-07, when this test found it; tests/unit/test_host_admission.py checks the
engine's order), but `HostAdmission` alone must still never under-count under it. Two plain tests pin where that
regime over-counts (never under): see their docstrings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncllm.engine.admission import Admitted, HostAdmission
from asyncllm.errors import EngineOverloadedError
from asyncllm.protocol import SchedulerStats

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "250"))
NAMES = ["admit"] * 4 + ["other"] * 2 + ["send", "take", "deliver"] * 3 + ["snapshot", "loop"] * 2 + [
    "schedule", "finish", "fail_unsent", "abort_unsent", "abort_counted", "core_fail", "observe", "restart"]


def refuses(waiting: int, waiting_tokens: int, n: int, tokens: int, max_req: int | None, max_tok: int | None) -> bool:
    """The core's documented rule (`check_queue_limits`), written out."""
    if waiting == 0:
        return False
    if max_req is not None and waiting + n > max_req:
        return True
    return max_tok is not None and waiting_tokens + n * tokens > max_tok


class Collector:
    """A `RequestCollector` as `Admitted.track` sees it."""

    finished = False


class Latest:
    """A replica's `HostStats`: `scheduler` is the latest snapshot the processor thread received."""

    def __init__(self) -> None:
        self.scheduler = SchedulerStats()


@dataclass(eq=False)
class Req:
    n: int
    t: int
    admitted: Admitted
    collector: Collector = field(default_factory=Collector)
    queued_at: int | None = None
    """The core's clock when it queued the request (None: never)."""
    waiting: int = 0
    """Its samples in the core's queue."""
    retracted: bool = False
    state: str = "unsent"


class Sim:
    def __init__(self, max_req: int | None, max_tok: int | None, lagged: bool) -> None:
        self.max_req, self.max_tok, self.lagged = max_req, max_tok, lagged
        self.latest = Latest()
        self.admission = HostAdmission(max_req, max_tok, self.latest)  # type: ignore[arg-type]
        self.reqs: list[Req] = []
        self.unsent: list[Req] = []
        self.wire: list[tuple[str, Req]] = []
        self.queue: list[Req] = []
        """The core's waiting queue, one entry per sample: the truth."""
        self.clock = 0
        self.host_samples_queued = 0
        self.removed: list[int] = []
        """The clock of each sample taken off the queue."""
        self.others: list[Req] = []
        """Another host's requests the core queued: seen here only through the snapshots."""
        self.outbox: list[tuple[SchedulerStats | None, list[tuple[str, Req]]]] = []
        self.loop: list[tuple[str, Req]] = []
        self.exact = not lagged
        """The exact regime's checks; there the host looks at a dead core's last count and at a new core's count
        below that before it installs one that is not (`deliver`): else its restart goes unseen."""
        self.epoch = 0
        self.epochs = {0: 0}
        """Each snapshot's core (by its clock), counted from 0 at each restart."""
        self.looked = (0, 0)
        """The core and count of the last snapshot the host's admission looked at."""

    # ---------------------------------------------------------------- the truth
    def true_tokens(self) -> int:
        return sum(r.t for r in self.queue)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def snap(self) -> SchedulerStats:
        self.epochs[self.tick()] = self.epoch
        return SchedulerStats(num_requests_waiting=len(self.queue), num_waiting_tokens=self.true_tokens(),
                              host_samples_queued=self.host_samples_queued, num_steps_total=self.clock)

    def take_off(self, req: Req, samples: int) -> None:
        for _ in range(samples):
            self.queue.remove(req)
            self.removed.append(self.tick())
        req.waiting -= samples

    # ---------------------------------------------------------------- the reference estimate
    def counted(self, req: Req, stats: SchedulerStats) -> bool:
        return req.queued_at is not None and req.queued_at <= stats.num_steps_total

    def uncounted(self) -> list[Req]:
        stats = self.latest.scheduler
        return [r for r in self.reqs if not r.retracted and not self.counted(r, stats)]

    def reference(self) -> tuple[int, int]:
        stats, rest = self.latest.scheduler, self.uncounted()
        tokens = sum(r.n * r.t for r in rest) if self.max_tok is not None else 0
        return stats.num_requests_waiting + sum(r.n for r in rest), stats.num_waiting_tokens + tokens

    def look(self) -> None:
        stats = self.latest.scheduler
        self.looked = (self.epochs[stats.num_steps_total], stats.host_samples_queued)

    def estimate(self) -> tuple[int, int]:
        stats = self.latest.scheduler
        waiting = self.admission.num_waiting(stats)
        self.look()
        return waiting, stats.num_waiting_tokens + self.admission._num_unqueued_tokens  # what `admit` checks

    def check(self) -> tuple[int, int]:
        waiting, tokens = self.estimate()
        since = self.latest.scheduler.num_steps_total
        others = [r for r in self.others if r.queued_at > since]  # queued after the snapshot: not counted
        assert waiting >= len(self.queue) - sum(r.n for r in others), "under-count of the queue's samples"
        if self.max_tok is not None:
            assert tokens >= self.true_tokens() - sum(r.n * r.t for r in others), "under-count of the queue's tokens"
        self.check_upper(waiting, tokens)
        if self.exact:
            assert (waiting, tokens) == self.reference()
            on_the_way = sum(r.n for r in self.reqs if not r.retracted and r.queued_at is None)
            over = on_the_way + sum(1 for c in self.removed if c > since) - sum(r.n for r in others)
            assert waiting - len(self.queue) == over
        return waiting, tokens

    def check_upper(self, waiting: int, tokens: int) -> None:
        """What may count past the snapshot: this host's requests, but the failed ones and those that ended with
        every one before them."""
        stats, upper, upper_tokens, prefix = self.latest.scheduler, 0, 0, True
        for req in self.reqs:
            prefix = prefix and req.collector.finished
            if not (prefix or req.retracted):
                upper, upper_tokens = upper + req.n, upper_tokens + req.n * req.t
        assert waiting <= stats.num_requests_waiting + upper, "an ended request first in line still counts"
        if self.max_tok is not None:
            assert tokens <= stats.num_waiting_tokens + upper_tokens

    # ---------------------------------------------------------------- the host
    def admit(self, n: int, t: int) -> None:
        waiting, tokens = self.check()
        expected = refuses(waiting, tokens, n, t, self.max_req, self.max_tok)
        try:
            admitted = self.admission.admit(self.latest.scheduler, [7] * t, False, n)
        except EngineOverloadedError:
            assert expected, f"refused at {waiting} samples, {tokens} tokens"
            return
        assert not expected, f"admitted at {waiting} samples, {tokens} tokens"
        req = Req(n, t, admitted)
        admitted.track(req.collector)
        self.reqs.append(req)
        self.unsent.append(req)

    def fail(self, req: Req) -> None:
        """`RequestCollector.put_error`: retract, then finished."""
        if req.collector.finished:
            return
        req.admitted.retract()
        self.look()
        req.retracted = True
        req.collector.finished = True

    def handle(self, event: tuple[str, Req]) -> None:
        kind, req = event
        if kind == "error":
            self.fail(req)
        else:
            req.collector.finished = True

    def deliver(self) -> None:
        stats, events = self.outbox.pop(0)
        if self.exact and stats is not None:
            core, looked_core = self.epochs[stats.num_steps_total], self.looked[0]
            if core != self.epochs[self.latest.scheduler.num_steps_total]:
                self.estimate()  # the dead core's last count, looked at before the new core's first
            elif core != looked_core and stats.host_samples_queued >= self.looked[1] > 0:
                self.estimate()  # the new core's lower count, looked at before one that is not
        if stats is not None:
            self.latest.scheduler = stats  # the processor thread, before the loop sees the events
        if self.lagged:
            self.loop.extend(events)
        else:
            for event in events:
                self.handle(event)

    def fail_unsent(self, index: int) -> None:
        req = self.unsent.pop(index % len(self.unsent))
        req.state = "failed"
        if self.lagged:  # the processor thread delivers the error through the loop
            self.loop.append(("error", req))
        else:
            self.fail(req)

    def abort_unsent(self, index: int) -> None:
        req = self.unsent.pop(index % len(self.unsent))
        req.state, req.collector.finished = "aborted", True

    def abort_counted(self, index: int) -> None:
        stats = self.latest.scheduler
        live = [r for r in self.reqs if self.counted(r, stats) and not r.collector.finished]
        if live:
            req = live[index % len(live)]
            req.collector.finished = True
            self.wire.append(("abort", req))

    def send(self) -> None:
        req = self.unsent.pop(0)
        req.state = "wire"
        self.wire.append(("add", req))

    # ---------------------------------------------------------------- the core
    def restart(self) -> None:
        """The core dies: what it held and what was on its way to it fail; a new one counts from 0 (its first
        snapshot comes with the failures)."""
        failed = [r for r in self.reqs if r.state in ("wire", "queued") and not r.collector.finished]
        self.wire.clear()
        for req in self.reqs + self.others:
            req.state = "failed" if req in failed else req.state
            if req.waiting:
                self.take_off(req, req.waiting)
        self.host_samples_queued, self.epoch = 0, self.epoch + 1
        self.outbox.append((self.snap(), [("error", r) for r in failed]))

    def take(self) -> None:
        kind, req = self.wire.pop(0)
        if kind == "abort":
            self.take_off(req, req.waiting)
            req.state = "aborted"
        elif refuses(len(self.queue), self.true_tokens(), req.n, req.t, self.max_req, self.max_tok):
            req.state = "refused"
            self.outbox.append((None, [("error", req)]))  # at once, with no snapshot (`EngineCore._handle`)
        else:
            self.queue.extend([req] * req.n)
            self.host_samples_queued += req.n
            req.queued_at, req.waiting, req.state = self.tick(), req.n, "queued"

    def other(self, n: int, t: int) -> None:
        """Another host's request, queued if the core's rule lets it."""
        if not refuses(len(self.queue), self.true_tokens(), n, t, self.max_req, self.max_tok):
            req = Req(n, t, None, queued_at=self.tick(), waiting=n, state="queued")  # type: ignore[arg-type]
            self.queue.extend([req] * n)
            self.others.append(req)

    def schedule(self, samples: int) -> None:
        for _ in range(min(samples, len(self.queue))):
            self.take_off(self.queue[0], 1)

    def end_in_core(self, index: int, kind: str) -> None:
        """A queued request finishes (all its samples scheduled) or fails (its samples leave the queue): its output
        comes with a snapshot taken after."""
        ready = [r for r in self.reqs if r.state == "queued" and (kind == "error" or r.waiting == 0)]
        if ready:
            req = ready[index % len(ready)]
            self.take_off(req, req.waiting)
            req.state = "ended"
            self.outbox.append((self.snap(), [(kind, req)]))

    # ---------------------------------------------------------------- driving
    def step(self, name: str, index: int, n: int, t: int) -> None:
        if name == "admit":
            self.admit(n, t)
        elif name == "send" and self.unsent:
            self.send()
        elif name == "restart":
            self.restart()
        elif name == "take" and self.wire:
            self.take()
        elif name == "other":
            self.other(n, t)
        elif name == "schedule":
            self.schedule(n)
        elif name in ("finish", "core_fail"):
            self.end_in_core(index, "done" if name == "finish" else "error")
        elif name == "snapshot":
            self.outbox.append((self.snap(), []))
        elif name == "deliver" and self.outbox:
            self.deliver()
        elif name == "loop" and self.loop:
            self.handle(self.loop.pop(0))
        elif name == "fail_unsent" and self.unsent:
            self.fail_unsent(index)
        elif name == "abort_unsent" and self.unsent and self.lagged:
            self.abort_unsent(index)
        elif name == "abort_counted":
            self.abort_counted(index)
        elif name == "observe":
            self.check()

    def flush(self) -> None:
        while self.outbox or self.loop:
            if self.outbox:
                self.deliver()
            while self.loop:
                self.handle(self.loop.pop(0))

    def drain(self) -> None:
        """Everything is sent, queued or refused, scheduled and ended; a last snapshot comes."""
        while self.unsent:
            self.send()
        while self.wire:
            self.take()
        self.outbox.append((self.snap(), []))
        self.flush()
        self.check()
        self.schedule(len(self.queue))
        for req in self.reqs:
            if req.state == "queued":
                self.end_in_core(0, "done")
        self.outbox.append((self.snap(), []))
        self.flush()

    def check_no_leak(self) -> None:
        assert all(r.collector.finished for r in self.reqs)
        assert not self.queue and self.latest.scheduler.num_requests_waiting == 0
        assert self.admission.num_waiting(self.latest.scheduler) == 0
        assert not self.admission._unqueued, "a request counted forever"
        assert self.estimate() == (0, 0)
        self.admit(3, 1_000)  # an empty queue accepts anything


def run(max_req: int | None, max_tok: int | None, lagged: bool, program: list[tuple[str, int, int, int]]) -> None:
    sim = Sim(max_req, max_tok, lagged)
    for name, index, n, t in program:
        sim.step(name, index, n, t)
        if name != "observe":
            assert len(sim.queue) == sum(r.waiting for r in sim.reqs + sim.others)  # the model's own bookkeeping
    sim.check()
    sim.drain()
    sim.check_no_leak()


STEP = st.tuples(st.sampled_from(NAMES), st.integers(0, 7), st.integers(1, 3), st.integers(1, 6))
LIMIT_REQ = st.none() | st.integers(1, 6)
LIMIT_TOK = st.none() | st.integers(1, 24)
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random


def A(n: int = 1, t: int = 1) -> tuple[str, int, int, int]:
    return ("admit", 0, n, t)


def S(name: str, index: int = 0, n: int = 1) -> tuple[str, int, int, int]:
    return (name, index, n, 1)


@SETTINGS
@given(LIMIT_REQ, LIMIT_TOK, st.lists(STEP, min_size=20, max_size=80))
# a snapshot taken before the core got the host's requests, delivered after: they still count
@example(3, None, [A(2), S("snapshot"), S("send"), S("take"), S("deliver"), A(), A()])
# an n > 1 request's samples leave the count at once, the next request's only with its own snapshot
@example(4, None, [A(3), A(), S("send"), S("take"), S("snapshot"), S("send"), S("deliver"), A(), S("take"),
                   S("snapshot"), S("deliver"), S("observe")])
# refused by the core (never counted) between two queued ones; a processor-thread failure in the middle
@example(2, 10, [A(2, 3), A(2, 3), A(1, 2), A(1, 1), S("send"), S("send"), S("take"), S("take"), S("fail_unsent", 1),
                 S("send"), S("take"), S("snapshot"), S("deliver"), S("deliver"), S("observe")])
# queued, counted, then failed in the core: the snapshot alone counts it
@example(None, None, [A(2), S("send"), S("take"), S("core_fail"), A(), S("deliver"), S("observe"), S("schedule"),
                      S("snapshot"), S("deliver"), S("observe")])
# aborted after a snapshot counted it; scheduled samples still count until the next snapshot
@example(2, None, [A(2), S("send"), S("take"), S("snapshot"), S("deliver"), S("abort_counted"), S("schedule", n=1),
                   A(), S("take"), S("observe"), S("snapshot"), S("deliver"), A()])
# a restarted core's first count, lower than the dead one's, seen first: it counts from 0
@example(None, None, [A(3), S("send"), S("take"), S("snapshot"), S("deliver"), S("observe"), S("schedule", n=3),
                      S("finish"), S("deliver"), S("restart"), A(), S("send"), S("take"), S("snapshot"), S("deliver"),
                      S("deliver"), S("observe")])
def test_the_estimate_is_the_latest_snapshot_plus_the_requests_on_their_way(max_req, max_tok, program):
    run(max_req, max_tok, False, program)


@SETTINGS
@given(LIMIT_REQ, LIMIT_TOK, st.lists(STEP, min_size=20, max_size=80))
# aborted before it was sent, first in line: it leaves with no new snapshot
@example(None, None, [A(), S("abort_unsent"), S("observe")])
# b, aborted unsent, takes c's count: c counts until it ends; then what was left of the count goes with it
@example(None, None, [A(), A(2), S("abort_unsent"), S("send"), S("take"), S("snapshot"), S("deliver"),
                      S("observe"), S("schedule", n=2), S("finish"), S("deliver"), S("loop"), S("observe"), A(),
                      S("send"), S("snapshot"), S("deliver"), S("observe"), S("take"), S("observe")])
# refused b takes c's count (a failure seen after a later snapshot); c then fails: the rest of the count goes too
@example(4, None, [A(), A(), A(2), S("other", n=3), S("send"), S("send"), S("send"), S("take"), S("take"),
                   S("schedule", n=3), S("take"), S("snapshot"), S("deliver"), S("deliver"), S("observe"),
                   S("core_fail", 1), S("deliver"), S("loop"), S("loop"), A(), S("send"), S("snapshot"), S("deliver"),
                   S("observe"), S("take"), S("observe")])
# aborted before it was sent, behind a live request: it leaves once first in line
@example(None, None, [A(), A(2), A(), S("abort_unsent", 1), S("send"), S("send"), S("take"), S("take"),
                      S("snapshot"), S("deliver"), S("observe")])
# the core refuses b, queues c; the snapshot counting c is installed before the loop handles b's error
@example(3, None, [A(), A(), A(), S("send"), S("send"), S("send"), S("take"), S("snapshot"), S("deliver"),
                   S("schedule"), S("take"), S("take"), S("snapshot"), S("deliver"), S("deliver"), S("observe"),
                   S("loop"), S("observe")])
def test_the_estimate_never_under_counts_whatever_the_timing(max_req, max_tok, program):
    run(max_req, max_tok, True, program)


def play(sim: Sim, program: list[tuple[str, int, int, int]]) -> Sim:
    for step in program:
        sim.step(*step)
    return sim


def test_a_refusal_handled_after_a_later_snapshot_errs_high_until_the_next_request_ends():
    """The core refuses b (behind a, queued) and queues c; the estimate sees the snapshot counting a and c before the
    loop handles b's error. The snapshot's count of 2 is taken off in order, a then b, so c, queued, counts twice
    until it ends: too high, never too low, no leak. (The engine's estimate saw snapshots so until 2026-12-07: the
    processor thread installed each for the metrics at once; now it gets them with their delivery, after the errors
    delivered before them.)"""
    sim = play(Sim(3, None, lagged=True), [A(), A(), A(), S("other", n=2), S("send"), S("send"), S("send"),
                                           S("take"), S("take"), S("schedule", n=3), S("take"), S("snapshot"),
                                           S("deliver"), S("deliver"), S("loop")])
    assert [r.state for r in sim.reqs] == ["queued", "refused", "queued"] and sim.reqs[1].retracted
    assert len(sim.queue) == 1 and sim.check()[0] in (1, 2)  # exact: 1; the code says 2
    sim.drain()
    sim.check_no_leak()


def test_a_new_core_counting_past_the_old_one_before_the_host_looks():
    """A restart is told by a count lower than the last one the estimate saw; a new core that queued more of this
    host's samples than the old one before the estimate looks is read as the old one going on: the old count is not
    taken off, c counts twice until it ends. Too high, never too low, no leak. (The engine's estimate no longer
    misses a count: since 2026-12-07 it takes each snapshot as delivered, and a dead core's zeros, `HostAdmission.
    take`; tests/unit/test_host_admission.py.)"""
    sim = Sim(None, None, lagged=False)
    sim.exact = False
    play(sim, [A(), S("send"), S("take"), S("schedule"), S("finish"), S("deliver"), S("observe"), A(), A(),
               S("restart"), S("send"), S("send"), S("take"), S("take"), S("snapshot"), S("deliver"), S("deliver")])
    assert sim.latest.scheduler.host_samples_queued == 2 and len(sim.queue) == 2
    waiting, _ = sim.estimate()
    assert waiting in (2, 3)  # exact: 2; the code says 3
    sim.drain()
    sim.check_no_leak()
