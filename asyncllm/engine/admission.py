"""The host's early admission check: refuse before tokenizing when the core's queue is full.

The engine core is authoritative (`asyncllm.sched.admission`): it refuses an
`AddRequest` past `max_num_queued_requests` / `max_num_queued_tokens` with
`EngineOverloadedError`. Checking on the host too means that under overload
most refused requests cost no tokenization, no chat template and no socket
round trip: `AsyncEngine._submit` raises at once, on the event loop.

The host estimates the queue from the latest `SchedulerStats` it received
(the core sends one every step) plus its own requests that snapshot does not
count yet, and applies the core's rule to that estimate
(`check_queue_limits`: an empty queue accepts any request; an n > 1 request
counts its n samples). Which requests a snapshot counts is exact: each
snapshot carries, for the host it goes to, how many samples of its requests
the core had queued (or parked for a grammar) when it took it
(`SchedulerStats.host_samples_queued`, counted from 0 by each core process).
The host keeps its admitted requests that no snapshot counted yet, oldest
first; a new snapshot's increase of that count takes them off in order (an
n > 1 request's n samples at once, as the core counts its sample 0), so a
snapshot taken before the core received the latest requests leaves them
counted: no under-count, whatever the timing. A request leaves the count
when a snapshot counts it, or when it fails or ends before one does
(`Admitted.retract`, and an ended one found first in line): refused (by this
host's processor thread, or by the core, which does not count a refused
one), it never entered the queue; failed or ended after the core queued it,
the latest snapshot, taken after, counts it already. A count lower than the
last one is a new core's (a restart: its count starts again), or the zeros
of a dead core's view: the host takes it as counting from 0, so it never goes
negative nor counts a request forever.

What remains approximate, mostly on the side of letting a request through
(the core then refuses it, after tokenization):

- the snapshot itself is one step old: requests the core scheduled since
  still count as waiting (this errs the other way: a request refused here the
  core might have taken);
- the core queues a host's requests in the order they were sent, which is the
  order they were admitted but for a request whose new LoRA adapter is checked
  first and a sample 0 resent after a processor-cache miss: while one is out
  of order the count may be too high (a later, smaller request queued first
  does not free it); one of them then failing, or any request aborted while on
  its way to the core, may leave it a request off: too low until this host's
  requests in flight are all queued (one's count taken twice), or too high
  until the request taken for queued in its place ends;
- the same count (`num_waiting`) is the data-parallel balancer's waiting count
  (`data_parallel.load_score`), so it is kept with or without a limit: one
  rule for both, a burst of refused requests steers neither (each replica's
  core counts its own);
- other hosts sharing the core are seen only through the snapshots: their
  requests in flight are not counted;
- a text prompt's tokens are estimated as ``len(text) // 4`` (about four
  characters per token of English text; code and most other scripts have
  fewer characters per token, so this rather underestimates); token ids count
  exactly; chat messages count their text contents the same way.

The requests made in an `admission_group` (an OpenAI server request's, a
beam-search step's, a `generate_many` batch's) are admitted together, here and
in the core (`asyncllm.sched.admission.AdmissionGroups`): a group that found
the queue empty may pass the limits by its size.
"""

from __future__ import annotations

import contextlib
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from asyncllm.protocol import SchedulerStats
from asyncllm.sched.admission import AdmissionGroups

__all__ = ["Admitted", "Delivered", "HostAdmission", "admission_group", "current_admission_group",
           "estimate_prompt_tokens"]

class _Group:
    __slots__ = ("name", "size")

    def __init__(self, size: int) -> None:
        self.name, self.size = uuid.uuid4().hex, max(1, size)


_GROUP: ContextVar[_Group | None] = ContextVar("asyncllm_admission_group", default=None)
"""The admission group of the requests made here (None: none; set by `admission_group`, inherited by tasks begun in
it)."""


@contextlib.contextmanager
def admission_group(size: int = 1, own: bool = False) -> Iterator[str]:
    """The requests made in here (their `RequestStream`s, here or in tasks begun here) are one admission group, its
    id yielded: on an empty queue it may pass the queue's limits by `size` requests (`AdmissionGroups`), so `size`
    is how many it makes at once (its prompts × n, its beams, its batch's concurrency). Inside another group: that
    group, its size raised to `size` (for the requests made after), unless `own` (a group of its own: a beam-search
    step's beams)."""
    group = _GROUP.get()
    if group is not None and not own:
        group.size = max(group.size, size)
        yield current_admission_group()
        return
    token = _GROUP.set(_Group(size))
    try:
        yield current_admission_group()
    finally:
        _GROUP.reset(token)


def current_admission_group() -> str:
    """The admission group of a request made now, "NAME/SIZE" (`asyncllm.sched.admission.group_size`; "": none)."""
    group = _GROUP.get()
    return "" if group is None else f"{group.name}/{group.size}"


CHARS_PER_TOKEN = 4


def estimate_prompt_tokens(prompt: Any, chat: bool) -> int:
    """A cheap, rather low estimate of the prompt's tokens (no tokenizer)."""
    if chat:
        return sum(len(str(m.get("content", ""))) for m in prompt if isinstance(m, dict)) // CHARS_PER_TOKEN
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN
    return len(prompt)


class Delivered:
    """A replica's latest core snapshot as the event loop was given it: with the outputs of the same core message and
    before them, after those of earlier messages (`AsyncEngine._on_delivery`), where the metrics take each at once
    on the processor thread (`HostStats.take_snapshot`). The estimate reads this one, so it never sees a snapshot
    before a failure delivered ahead of it: a request the core refused (or the processor thread failed) before the
    core queued a later one would otherwise take that one's place in the count, and the count would stay a request
    too high, passing from request to request as long as traffic goes on (found by
    tests/unit/test_host_admission_property.py, 2026-12-07)."""

    __slots__ = ("scheduler",)

    def __init__(self, scheduler: SchedulerStats) -> None:
        self.scheduler = scheduler


class HostAdmission:
    """Estimates the core's waiting queue (for admission and for the data-parallel balancer); runs on the event loop
    only."""

    def __init__(self, max_num_queued_requests: int | None, max_num_queued_tokens: int | None,
                 latest: Delivered | None = None) -> None:
        self.max_num_queued_requests = max_num_queued_requests
        self.max_num_queued_tokens = max_num_queued_tokens
        self.latest = latest
        """Its replica's snapshots as delivered (`Delivered`): what a request failing between two admissions is
        checked against (None: the last snapshot given)."""
        self._snapshot: SchedulerStats | None = None
        self._queued = 0
        """`_snapshot`'s `host_samples_queued`."""
        self._credit = 0
        """Samples the core queued that no request of `_unqueued` took yet (one sent out of order: its elders wait)."""
        self._unqueued: OrderedDict[Admitted, None] = OrderedDict()
        """Admitted requests, not failed, that `_snapshot` does not count yet, oldest first."""
        self._num_unqueued = 0
        """Their samples."""
        self._num_unqueued_tokens = 0
        self._groups = AdmissionGroups()

    def follow(self, max_num_queued_requests: int | None, max_num_queued_tokens: int | None) -> None:
        """Take these limits: an attached host's are its core's, known once it started (a placeholder's before)."""
        self.max_num_queued_requests, self.max_num_queued_tokens = max_num_queued_requests, max_num_queued_tokens

    @property
    def enabled(self) -> bool:
        return self.max_num_queued_requests is not None or self.max_num_queued_tokens is not None

    def _since(self, stats: SchedulerStats) -> None:
        """`stats` is the latest snapshot from the core; a new object means a new snapshot: the requests its count of
        this host's queued samples passed since the last one leave `_unqueued`, oldest first (and those that ended
        before any counted them). A lower count is a new core's, counting from 0."""
        credit, unqueued = self._credit, self._unqueued
        if stats is not self._snapshot:
            queued, last = stats.host_samples_queued, self._queued
            self._snapshot, self._queued = stats, queued
            credit += queued - last if queued >= last else queued
        elif not unqueued:
            return
        # the same snapshot too: one that ended unsent (aborted while parked for its LoRA check) brings no new one
        while unqueued:
            first = next(iter(unqueued))
            if first.num_requests <= credit:
                credit -= first.num_requests
            elif not first.ended:
                break
            self._drop(first)
        self._credit = credit if unqueued else 0  # nothing left to count: what it had was miscounted (out of order)

    def take(self, stats: SchedulerStats) -> None:
        """A snapshot as the loop is delivered it (`Delivered`; a dead core's zeros, `Replica.check_dead`): the
        estimate's latest, seen at once, so that a new core's count is never read as the old one's going on."""
        if self.latest is not None:
            self.latest.scheduler = stats
        self._since(stats)

    def _drop(self, admitted: Admitted) -> None:
        if self._unqueued.pop(admitted, False) is None:
            self._num_unqueued -= admitted.num_requests
            self._num_unqueued_tokens -= admitted.num_tokens
            if not self._unqueued:
                self._credit = 0

    def num_waiting(self, stats: SchedulerStats) -> int:
        """The core's waiting requests as estimated here: `stats`' plus this host's admitted requests it does not
        count yet, failed ones aside (the data-parallel balancer's count)."""
        self._since(stats)
        return stats.num_requests_waiting + self._num_unqueued

    def admit(self, stats: SchedulerStats, prompt: Any, chat: bool, num_samples: int = 1, group: str = "") -> Admitted:
        """Count the request as submitted, or raise `EngineOverloadedError` if a limit is set and the queue looks
        full. A request of `num_samples` (SamplingParams.n) samples is that many core requests; one of admission
        group `group` ("": none) is admitted with the group (`AdmissionGroups`). Returns what was counted
        (`Admitted.retract` un-counts it; `Admitted.track` names its request)."""
        self._since(stats)
        num_tokens = estimate_prompt_tokens(prompt, chat) if self.max_num_queued_tokens is not None else 0
        if self.enabled:
            self._groups.check(group, stats.num_requests_waiting + self._num_unqueued,
                               stats.num_waiting_tokens + self._num_unqueued_tokens, num_samples, num_tokens,
                               self.max_num_queued_requests, self.max_num_queued_tokens, about="about ")
        admitted = Admitted(self, num_samples, num_tokens * num_samples)
        self._unqueued[admitted] = None
        self._num_unqueued += num_samples
        self._num_unqueued_tokens += num_tokens * num_samples
        return admitted


class Admitted:
    """A request counted by `HostAdmission.admit`: its samples and tokens, counted until a snapshot counts them."""

    __slots__ = ("admission", "num_requests", "num_tokens", "request")

    def __init__(self, admission: HostAdmission, num_requests: int, num_tokens: int) -> None:
        self.admission = admission
        self.num_requests, self.num_tokens = num_requests, num_tokens
        self.request: weakref.ref[Any] | None = None
        """Its request (`track`): one that ended (its ``finished`` set, or gone) before a snapshot counted it leaves
        the count when it comes first in line."""

    def track(self, request: Any) -> None:
        """`request` (its `RequestCollector`, with ``finished``) is the one counted."""
        self.request = weakref.ref(request)

    @property
    def ended(self) -> bool:
        request = None if self.request is None else self.request()
        return self.request is not None and (request is None or request.finished)

    def retract(self) -> None:
        """The request failed (`RequestCollector.put_error`): un-count it, at most once, unless the latest snapshot
        counts it (the core queued it, then it failed)."""
        admission = self.admission
        if admission.latest is not None:
            admission._since(admission.latest.scheduler)
        admission._drop(self)
