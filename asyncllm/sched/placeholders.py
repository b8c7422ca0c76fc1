"""Output placeholders: scheduling step N+1 before step N's tokens are known (``async_scheduling``).

With `async_scheduling` the engine core schedules step N+1 while the workers
still run step N. Every request that samples in step N is assumed to get
exactly one token there: `advance` counts the step's tokens as computed and
adds one *placeholder* to the request's `num_tokens` (not to its token ids),
so the next `schedule()` gives it a one-token decode at that position. The
workers need nothing more from the core: they run steps in order, and the
token a worker sampled in step N becomes that row's next input id (on the
host, or on the device when the worker pipelines: workers/token_feedback.py).

When step N's output arrives, `commit` takes back every in-flight step's
advance (each request is then exactly as the synchronous scheduler would see
it after step N-1), lets `Scheduler.update_from_output` apply step N as in a
synchronous engine (tokens, stop checks, prefix-cache registration, frees),
and advances the steps still in flight again for the requests still running.
A request that finished in step N but was already scheduled in step N+1 is
gone from the scheduler by then: its N+1 token is dropped when that output
arrives and never reaches a host. Its blocks are freed at once; that is safe
because the workers run step N+1 before any later step can reuse them, and
the block its extra token is written to was never full, so never cached.

The scheduler itself does not know about placeholders. Preemption must not
happen while one is in flight (the victim's in-flight token would be lost and
its counts corrupted): `may_preempt` tells the core when the next
`schedule()` could preempt, and the core then collects the in-flight step
first, so every preemption happens in a synchronous step.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from asyncllm import protocol
from asyncllm.sched.request import Request
from asyncllm.sched.step_outputs import StepOutputs

if TYPE_CHECKING:
    from asyncllm.sched.scheduler import Scheduler

__all__ = ["OutputPlaceholders"]

_Entry = tuple[Request, int, int]
"""(request, tokens scheduled in the step, 1 if the step samples it: a placeholder, else 0)."""


class _InFlightStep:
    __slots__ = ("sched_out", "entries")

    def __init__(self, sched_out: protocol.SchedulerOutput, entries: list[_Entry]) -> None:
        self.sched_out = sched_out
        self.entries = entries


class OutputPlaceholders:
    """The steps scheduled ahead of their outputs (oldest first) and what they advanced."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self.scheduler = scheduler
        self._in_flight: deque[_InFlightStep] = deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    def advance(self, sched_out: protocol.SchedulerOutput) -> None:
        """Right after `schedule()`: count the step's tokens as computed and its samples as placeholders."""
        assert not (sched_out.preempted_req_ids and self._in_flight), "preempted with a step in flight (may_preempt)"
        requests = self.scheduler.requests
        entries = [(requests[req_id], num, 0) for req_id, num in sched_out.num_scheduled_tokens.items()]
        self._in_flight.append(_InFlightStep(sched_out, _advance(entries, requests)))

    def commit(self, runner_out: protocol.ModelRunnerOutput) -> StepOutputs:
        """Apply the oldest in-flight step's output; the deltas for the hosts (as `update_from_output`)."""
        step = self._in_flight.popleft()
        assert runner_out.step_id == step.sched_out.step_id, (runner_out.step_id, step.sched_out.step_id)
        requests = self.scheduler.requests
        num_live = _rewind(step.entries, requests)
        for later in self._in_flight:
            _rewind(later.entries, requests)
        if num_live < len(step.sched_out.num_scheduled_tokens):  # some left while in flight
            _drop_reused_ids(step, runner_out, requests)
        outputs = self.scheduler.update_from_output(step.sched_out, runner_out)
        for later in self._in_flight:
            later.entries = _advance(later.entries, requests)
            self._register_filled_blocks(later.entries)
        return outputs

    def _register_filled_blocks(self, entries: list[_Entry]) -> None:
        """Prefix-cache the blocks a step in flight fills that ended in a placeholder when it was scheduled.

        `schedule()` registers the blocks a step fills, but only as far as the
        tokens are known: a block whose last token was step N's placeholder
        waits until step N's token is committed, which is now.
        """
        kv = self.scheduler.kv_cache_manager
        if not kv.enable_prefix_caching:
            return
        block_size, cache_full_blocks = kv.block_size, kv.cache_full_blocks
        for request, num, _ in entries:
            if request.num_computed_tokens % block_size < num:  # this step fills a block
                cache_full_blocks(request, request.num_computed_tokens)

    def discard_all(self) -> None:
        """Forget every in-flight step (the workers lost it): the requests' counts are real again."""
        requests = self.scheduler.requests
        while self._in_flight:
            _rewind(self._in_flight.pop().entries, requests)

    def may_preempt(self) -> bool:
        """Whether the next `schedule()` could preempt a running request (then it must not run ahead).

        Conservative: a priority preemption is possible whenever the first
        waiting request outranks the last running one; a preemption for
        blocks, whenever the running requests' largest possible chunks need
        more blocks than are free.
        """
        sched = self.scheduler
        running = sched.running
        if not running:
            return False
        if sched.policy == "priority" and sched.waiting and running[-1].priority > sched.waiting.peek().priority:
            return True
        kv = sched.kv_cache_manager
        free, block_size, budget, tables = kv.num_free_blocks, sched.block_size, sched.max_num_batched_tokens, kv.req_to_blocks
        for request in running:  # O(running requests), no call per request: the core runs this every step
            num_needed = request.num_computed_tokens + budget
            if num_needed > request.num_tokens:
                num_needed = request.num_tokens
            missing = -(-num_needed // block_size) - len(tables[request.request_id])
            if missing > 0:
                free -= missing
                if free < 0:
                    return True
        return False


def _advance(entries: list[_Entry], requests: dict[str, Request]) -> list[_Entry]:
    """Count the entries' tokens as computed and a placeholder where the step samples; the live entries.

    Live: still the scheduler's request of that id (not finished, aborted or
    timed out since, its id maybe taken by a new request). A live request is
    running: preemption never happens with a step in flight (`may_preempt`).
    """
    advanced: list[_Entry] = []
    append, get = advanced.append, requests.get
    for request, num, _ in entries:
        if get(request.request_id) is not request:
            continue
        computed = request.num_computed_tokens = request.num_computed_tokens + num
        if computed == request.num_tokens:  # the step reaches the end of the known tokens: it samples
            request.num_tokens = computed + 1
            append((request, num, 1))
        else:
            append((request, num, 0))
    return advanced


def _rewind(entries: list[_Entry], requests: dict[str, Request]) -> int:
    """Take the live entries' advance back; how many are live."""
    num_live = 0
    get = requests.get
    for request, num, placeholder in entries:
        if get(request.request_id) is request:
            request.num_tokens -= placeholder
            request.num_computed_tokens -= num
            num_live += 1
    return num_live


def _drop_reused_ids(step: _InFlightStep, runner_out: protocol.ModelRunnerOutput, requests: dict[str, Request]) -> None:
    """A request that left while its step was in flight may have its id taken by a new one: skip that id."""
    live = {request.request_id for request, _, _ in step.entries if requests.get(request.request_id) is request}
    for req_id in [r for r in step.sched_out.num_scheduled_tokens if r not in live and r in requests]:
        del step.sched_out.num_scheduled_tokens[req_id]
        runner_out.logprobs.pop(req_id, None)
        runner_out.prompt_logprobs.pop(req_id, None)
