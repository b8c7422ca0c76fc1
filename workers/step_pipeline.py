"""`StepPipeline`: a worker's steps, each launched before the previous one's output is sent.

The runner launches a step and hands back an `InFlightStep` while its
sampled ids are still on the device (workers/token_feedback.py). The
pipeline keeps at most one such step. When the next step arrives first, it
is launched behind it on the GPU (its inputs take the ids on the device),
and only then is the earlier step finished and its output sent; when the
GPU finishes first, the step is finished and sent at once, so a core that
waits for it (synchronous scheduling) is never kept waiting.

Runners without `launch_step` (test runners) run each step to the end, and
so does every runner where ``ASYNCLLM_WORKER_PIPELINE`` says no (by default
a CPU worker: its launch computes the whole step, so deferring the send
would only delay the output).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from asyncllm.protocol import ModelRunnerOutput, SchedulerOutput
from asyncllm.workers.token_feedback import InFlightStep

__all__ = ["StepPipeline"]


class StepPipeline:
    """At most one launched step whose output is not sent yet."""

    def __init__(self, runner: Any, send_output: Callable[[ModelRunnerOutput], None], pipelined: bool = True) -> None:
        self.runner = runner
        self.send_output = send_output
        """Called with every step's output, in step order (a no-op on ranks other than 0)."""
        self.inflight: InFlightStep | None = None
        self._launch = getattr(runner, "launch_step", None) if pipelined else None
        self.num_steps = 0
        self.num_overlapped = 0
        """Steps launched while the previous one was still in flight (the GPU had the next step queued)."""

    def step(self, sched_out: SchedulerOutput) -> None:
        """Launch this step, then finish and send the one before it."""
        self.num_steps += 1
        if self._launch is None:
            self.send_output(self.runner.execute_model(sched_out))
            return
        self.num_overlapped += self.inflight is not None
        result = self._launch(sched_out)
        self.flush()
        if isinstance(result, InFlightStep):
            self.inflight = result
        else:
            self.send_output(result)

    def flush(self) -> None:
        """Finish and send the in-flight step, if any (waits for its sampled ids)."""
        if self.inflight is not None:
            step, self.inflight = self.inflight, None
            self.send_output(self.runner.finish_step(step))

    def close(self) -> None:
        """At the worker's shutdown, after the last flush (a traced pipeline writes its trace: workers/step_trace.py)."""

    def wait(self, has_message: Callable[[], bool]) -> None:
        """Before blocking on the next command: finish the in-flight step unless a command comes first."""
        while self.inflight is not None and not has_message():
            if self.inflight.done():
                self.flush()
                return
            os.sched_yield()
