"""The host's early admission check: refuse before tokenizing when the core's queue is full.

The engine core is authoritative (`asyncllm.sched.admission`): it refuses an
`AddRequest` past `max_num_queued_requests` / `max_num_queued_tokens` with
`EngineOverloadedError`. Checking on the host too means that under overload
most refused requests cost no tokenization, no chat template and no socket
round trip: `AsyncEngine._submit` raises at once, on the event loop.

The host estimates the queue from the latest `SchedulerStats` it received
(the core sends one every step) plus what this host submitted since that
snapshot arrived, and applies the core's rule to that estimate
(`check_queue_limits`: an empty queue accepts any request; an n > 1 request
counts its n samples). Approximations, all on the side of letting a request
through (the core then refuses it after tokenization):

- a submission is counted until the next snapshot arrives (even if that
  snapshot was taken before the core received it) or until it fails,
  whichever comes first: one failing before a new snapshot arrived was
  refused (by this host's processor thread, or by the core, which sends a
  snapshot after every request it queues), so it never entered the queue and
  is un-counted at once (`Admitted.retract`);
- the same count (`num_waiting`) is the data-parallel balancer's waiting count
  (`data_parallel.load_score`), so it is kept with or without a limit: one
  rule for both, a burst of refused requests steers neither;
- other hosts sharing the core are seen only through the snapshots;
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
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from asyncllm.protocol import SchedulerStats
from asyncllm.sched.admission import AdmissionGroups

__all__ = ["Admitted", "HostAdmission", "admission_group", "current_admission_group", "estimate_prompt_tokens"]

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


class HostAdmission:
    """Estimates the core's waiting queue (for admission and for the data-parallel balancer); runs on the event loop
    only."""

    def __init__(self, max_num_queued_requests: int | None, max_num_queued_tokens: int | None) -> None:
        self.max_num_queued_requests = max_num_queued_requests
        self.max_num_queued_tokens = max_num_queued_tokens
        self._snapshot: SchedulerStats | None = None
        self._num_submitted = 0
        """Requests submitted since `_snapshot` arrived."""
        self._num_submitted_tokens = 0
        self._groups = AdmissionGroups()

    def follow(self, max_num_queued_requests: int | None, max_num_queued_tokens: int | None) -> None:
        """Take these limits: an attached host's are its core's, known once it started (a placeholder's before)."""
        self.max_num_queued_requests, self.max_num_queued_tokens = max_num_queued_requests, max_num_queued_tokens

    @property
    def enabled(self) -> bool:
        return self.max_num_queued_requests is not None or self.max_num_queued_tokens is not None

    def _since(self, stats: SchedulerStats) -> None:
        """`stats` is the latest snapshot from the core; a new object means a new snapshot, which already counts
        what was submitted before it: the count restarts."""
        if stats is not self._snapshot:
            self._snapshot, self._num_submitted, self._num_submitted_tokens = stats, 0, 0

    def num_waiting(self, stats: SchedulerStats) -> int:
        """The core's waiting requests as estimated here: `stats`' plus those submitted since it arrived and not
        failed (the data-parallel balancer's count)."""
        self._since(stats)
        return stats.num_requests_waiting + self._num_submitted

    def admit(self, stats: SchedulerStats, prompt: Any, chat: bool, num_samples: int = 1, group: str = "") -> Admitted:
        """Count the request as submitted, or raise `EngineOverloadedError` if a limit is set and the queue looks
        full. A request of `num_samples` (SamplingParams.n) samples is that many core requests; one of admission
        group `group` ("": none) is admitted with the group (`AdmissionGroups`). Returns what was counted
        (`Admitted.retract` un-counts it)."""
        self._since(stats)
        num_tokens = estimate_prompt_tokens(prompt, chat) if self.max_num_queued_tokens is not None else 0
        if self.enabled:
            self._groups.check(group, stats.num_requests_waiting + self._num_submitted,
                               stats.num_waiting_tokens + self._num_submitted_tokens, num_samples, num_tokens,
                               self.max_num_queued_requests, self.max_num_queued_tokens, about="about ")
        self._num_submitted += num_samples
        self._num_submitted_tokens += num_tokens * num_samples
        return Admitted(self, stats, num_samples, num_tokens * num_samples)


class Admitted:
    """A request counted by `HostAdmission.admit`: its samples and tokens, and the snapshot they count on."""

    __slots__ = ("admission", "snapshot", "num_requests", "num_tokens")

    def __init__(self, admission: HostAdmission, snapshot: SchedulerStats, num_requests: int, num_tokens: int) -> None:
        self.admission = admission
        self.snapshot: SchedulerStats | None = snapshot
        self.num_requests, self.num_tokens = num_requests, num_tokens

    def retract(self) -> None:
        """The request failed (`RequestCollector.put_error`): un-count it, at most once, unless the count restarted
        since (a new snapshot arrived: it counts the request if the core queued it)."""
        admission = self.admission
        if admission._snapshot is self.snapshot:
            admission._num_submitted -= self.num_requests
            admission._num_submitted_tokens -= self.num_tokens
            self.snapshot = None
