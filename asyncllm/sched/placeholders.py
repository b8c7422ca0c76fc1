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

Pipeline micro-batches (`Scheduler.concurrent_batches` > 1) take no
placeholders: a sampling request is left with nothing to compute, so the
next `schedule()` skips it and the steps in flight hold disjoint requests
(the first stage could not start a step that needs a token the last stage
has not sampled yet).

Each step's counts are advanced and taken back with array operations over
its record (`Scheduler.step_records`: its requests' rows, asyncllm/sched/rows.py).
The scheduler knows of placeholders only that a step's record was advanced
(`update_from_output` then looks for blocks a placeholder held back). Preemption must not
happen while one is in flight (the victim's in-flight token would be lost and
its counts corrupted): `may_preempt` tells the core when the next
`schedule()` could preempt, and the core then collects the in-flight step
first, so every preemption happens in a synchronous step.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from asyncllm import protocol
from asyncllm.sched.decode_step import may_run_short, step_record
from asyncllm.sched.rows import RequestRows, StepRows
from asyncllm.sched.step_outputs import StepOutputs

if TYPE_CHECKING:
    from asyncllm.sched.scheduler import Scheduler

__all__ = ["OutputPlaceholders"]


class _InFlightStep:
    __slots__ = ("sched_out", "record")

    def __init__(self, sched_out: protocol.SchedulerOutput, record: StepRows) -> None:
        self.sched_out = sched_out
        self.record = record
        """The step's requests, rows and token counts (`Scheduler.step_records`), and its placeholders."""


class OutputPlaceholders:
    """The steps scheduled ahead of their outputs (oldest first) and what they advanced."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self.scheduler = scheduler
        self._in_flight: deque[_InFlightStep] = deque()
        self._placeholders = scheduler.concurrent_batches == 1
        """Whether a sampling request gets a placeholder; pipeline micro-batches get none, so that `schedule()`
        skips the request (nothing left to compute) until its token is committed."""

    def __len__(self) -> int:
        return len(self._in_flight)

    def advance(self, sched_out: protocol.SchedulerOutput) -> None:
        """Right after `schedule()`: count the step's tokens as computed and its samples as placeholders."""
        assert not (sched_out.preempted_req_ids and self._in_flight), "preempted with a step in flight (may_preempt)"
        record = self.scheduler.step_records.get(sched_out.step_id)
        if record is None:  # nothing scheduled: the step carries finished or preempted ids only
            record = step_record(self.scheduler, sched_out, None, 0)
        _advance(record, self.scheduler.rows, self._placeholders, self.scheduler.max_seq_len)
        self._in_flight.append(_InFlightStep(sched_out, record))

    def commit(self, runner_out: protocol.ModelRunnerOutput) -> StepOutputs:
        """Apply the oldest in-flight step's output; the deltas for the hosts (as `update_from_output`)."""
        step = self._in_flight.popleft()
        assert runner_out.step_id == step.sched_out.step_id, (runner_out.step_id, step.sched_out.step_id)
        rows = self.scheduler.rows
        live = _rewind(step.record, rows)
        for later in self._in_flight:
            _rewind(later.record, rows)
        if not live.all():  # some left while in flight
            _drop_reused_ids(step, live, runner_out, self.scheduler.requests)
        outputs = self.scheduler.update_from_output(step.sched_out, runner_out)
        for later in self._in_flight:
            _advance(later.record, rows, self._placeholders, self.scheduler.max_seq_len)
            self._register_filled_blocks(later.record)
        return outputs

    def own(self, failed: dict[str, str]) -> dict[str, str]:
        """Of the requests the oldest in-flight step's output failed, those still running that step (an id ended
        since, failed again by a later step, may already name a new request)."""
        if not (failed and self._in_flight):
            return failed
        oldest = self._in_flight[0].record
        live = [oldest.req_ids[i] for i in oldest.live(self.scheduler.rows).nonzero()[0].tolist()]
        return {req_id: failed[req_id] for req_id in live if req_id in failed}

    def fail(self, failed: dict[str, str]) -> list[tuple[bytes, protocol.RequestOutputDelta]]:
        """End the requests the workers could not run in the oldest in-flight step (`Scheduler.fail_requests`; its
        `own` ones), as of before that step: every in-flight step's advance is taken back first, so the blocks that
        step and later ones fill leave the prefix cache with the request (their KV is not the request's). Call
        before `commit`."""
        if not failed:
            return []
        rows = self.scheduler.rows
        for step in self._in_flight:
            _rewind(step.record, rows)
        deltas = self.scheduler.fail_requests(failed)
        for step in self._in_flight:
            _advance(step.record, rows, self._placeholders, self.scheduler.max_seq_len)
        return deltas

    def _register_filled_blocks(self, record: StepRows) -> None:
        """Prefix-cache the blocks a step in flight fills that ended in a placeholder when it was scheduled.

        `schedule()` registers the blocks a step fills, but only as far as the
        tokens are known: a block whose last token was step N's placeholder
        waits until step N's token is committed, which is now.
        """
        kv = self.scheduler.kv_cache_manager
        if not kv.enable_prefix_caching:
            return
        rows = self.scheduler.rows
        computed = rows.computed[record.rows]
        filled = (record.live(rows) & (computed % kv.block_size < record.num_scheduled)).nonzero()[0]
        if len(filled):  # about one request in block_size
            kv.cache_decode_blocks([record.requests[i] for i in filled.tolist()], computed[filled].tolist())

    def discard_all(self) -> None:
        """Forget every in-flight step (the workers lost it): the requests' counts are real again."""
        rows = self.scheduler.rows
        while self._in_flight:
            _rewind(self._in_flight.pop().record, rows)

    def may_preempt(self) -> bool:
        """Whether the next `schedule()` could preempt a running request (then it must not run ahead).

        Conservative: a priority preemption is possible whenever the first
        waiting request outranks a running one; a preemption for blocks,
        whenever the running requests' largest possible chunks need more
        blocks than are free.
        """
        sched = self.scheduler
        running = sched.running
        if not running:
            return False
        if sched.policy == "priority" and sched.waiting:
            priority = sched.waiting.peek().priority
            if any(r.priority > priority for r in running):  # running is in admission order: any may be a victim
                return True
        return may_run_short(sched)


def _advance(record: StepRows, rows: RequestRows, placeholders: bool, max_seq_len: int) -> None:
    """Count the step's tokens as computed and a placeholder where it samples (unless ``placeholders`` is
    False), for its requests still running. No placeholder where the known tokens fill `max_seq_len` (a pooling
    prompt that long): that sampled token ends the request, and a decode after it would have no KV position.

    A request that left since (finished, aborted or timed out; its id maybe
    taken by a new request) holds no row of that serial and is skipped.
    Preemption never happens with a step in flight (`may_preempt`).
    """
    live = record.live(rows)
    row_ids = record.rows[live]
    computed = rows.computed[row_ids] + record.num_scheduled[live]
    rows.computed[row_ids] = computed
    held = np.zeros(len(record), dtype=np.bool_)
    if placeholders:
        known = rows.tokens[row_ids]
        samples = (computed == known) & (known < max_seq_len)  # the step reaches the end of the known tokens
        rows.tokens[row_ids[samples]] += 1
        held[live.nonzero()[0][samples]] = True
    record.placeholders = held


def _rewind(record: StepRows, rows: RequestRows) -> np.ndarray:
    """Take the advance back for the requests still running; which of the step's requests those are."""
    live = record.live(rows)
    assert record.placeholders is not None, "rewinding a step that was not advanced"
    rows.tokens[record.rows[record.placeholders & live]] -= 1
    rows.computed[record.rows[live]] -= record.num_scheduled[live]
    return live


def _drop_reused_ids(step: _InFlightStep, live: np.ndarray, runner_out: protocol.ModelRunnerOutput,
                     requests: dict) -> None:
    """A request that left while its step was in flight may have its id taken by a new one: skip that id."""
    req_ids = step.record.req_ids
    for req_id in [req_ids[i] for i in (~live).nonzero()[0].tolist() if req_ids[i] in requests]:
        del step.sched_out.num_scheduled_tokens[req_id]
        runner_out.logprobs.pop(req_id, None)
        runner_out.prompt_logprobs.pop(req_id, None)
