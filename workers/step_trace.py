"""`TracedPipeline`: a worker's `StepPipeline` under torch.profiler over a range of its steps.

Made instead of the plain pipeline only when ``ASYNCLLM_WORKER_TRACE_STEPS``
is set (``START:COUNT``): without it the worker runs `StepPipeline` itself
and nothing of this module costs a step anything. At the start of executed
step START (0-based, every `SchedulerOutput` the worker ran counts) the
profiler starts (CPU activity, and CUDA's on a GPU) and the phases of a
step are wrapped in ``asyncllm::`` spans (``launch``, ``update``,
``prepare``, ``forward``, ``logits``, ``sample``, ``finish``, ``send``:
workers/trace_summary.py); at the start of step START + COUNT (or at
the worker's shutdown, if that comes first) the device is synchronized, the
profiler stops, the wrappers are removed and the rank's summary is written
to ``ASYNCLLM_WORKER_TRACE_DIR`` as ``worker-trace-rank{R}-{pid}.json``,
with ``ASYNCLLM_WORKER_TRACE_CHROME=1`` the whole trace beside it
(``.chrome.json.gz``); a shutdown meanwhile waits until it is written
(``wait_for_exit``, workers/trace_summary.py). Writing it pauses that step (the export and the
summary), and on a GPU the first traced step may carry the profiler's
start (CUPTI's); the traced steps run slower than untraced ones, by the
profiler's own cost per operator and launch.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from asyncllm import envs
from asyncllm.protocol import ModelRunnerOutput, SchedulerOutput
from asyncllm.workers.step_pipeline import StepPipeline
from asyncllm.workers.trace_summary import END_MARK, summarize, trace_dir, writing_marker

__all__ = ["TracedPipeline", "runner_phases"]

logger = logging.getLogger(__name__)


class TracedPipeline(StepPipeline):
    """The pipeline whose steps START to START + COUNT - 1 run under torch.profiler."""

    def __init__(self, runner: Any, send_output: Callable[[ModelRunnerOutput], None], pipelined: bool,
                 rank: int, steps: tuple[int, int]) -> None:
        super().__init__(runner, send_output, pipelined)
        self.rank = rank
        self.first, self.count = steps
        self.profiler: Any = None
        self._undo: list[tuple[Any, str, Any]] = []
        self._done = False

    def step(self, sched_out: SchedulerOutput) -> None:
        index = self.num_steps  # this step's, counted from 0
        if index == self.first:
            self._start()
        elif index == self.first + self.count and self.profiler is not None:
            self._stop()
        if self.profiler is None:
            super().step(sched_out)
            return
        with torch.profiler.record_function("asyncllm::step"):
            super().step(sched_out)

    def close(self) -> None:
        """At the worker's shutdown: a trace still running stops and is written; a range never reached says so."""
        if self.profiler is not None:
            self._stop()
        elif not self._done:
            self._write({"num_steps": 0, "note": f"the worker ran {self.num_steps} steps, none of steps "
                                                 f"{self.first}:{self.count}"}, None)

    # ------------------------------------------------------------ the profiler's range
    def _start(self) -> None:
        # autograd's profiler, not torch.profiler.profile: that one's start imports torch._inductor (seconds)
        self.profiler = torch.autograd.profiler.profile(use_cpu=True, use_kineto=True,
                                                        use_device="cuda" if self._on_cuda() else None)
        self._wrap_phases()
        self.profiler.__enter__()

    def _stop(self) -> None:
        """Stop the profiler and write the trace, its `writing_marker` there meanwhile: the executor's shutdown (and
        the host's wait for the core) waits on past its grace for it (`wait_for_exit`)."""
        folder = trace_dir()
        os.makedirs(folder, exist_ok=True)
        marker = writing_marker(os.getpid())
        open(marker, "w").close()
        try:
            self._stop_and_write(folder)
        finally:
            os.remove(marker)

    def _stop_and_write(self, folder: str) -> None:
        with torch.profiler.record_function(END_MARK):
            pass
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)  # on CUDA it synchronizes first: the last kernels end inside the trace
        self._unwrap_phases()
        self._done = True
        raw = os.path.join(folder, f"{self._name()}.chrome.json")
        profiler.export_chrome_trace(raw)
        with open(raw) as f:
            events = json.load(f)["traceEvents"]
        chrome = None
        if envs.WORKER_TRACE_CHROME.get():
            chrome = raw + ".gz"
            with open(raw, "rb") as src, gzip.open(chrome, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.remove(raw)
        self._write(summarize(events, self._on_cuda(), self.first), chrome)

    def _write(self, summary: dict[str, Any], chrome: str | None) -> None:
        folder = trace_dir()
        os.makedirs(folder, exist_ok=True)
        device = getattr(self.runner, "device", None)
        head = {"rank": self.rank, "pid": os.getpid(), "device": str(device), "first_step": self.first,
                "requested_steps": self.count, "pipelined": self._launch is not None, "chrome_trace": chrome}
        path = os.path.join(folder, f"{self._name()}.json")
        with open(path, "w") as f:
            json.dump({**head, **summary}, f, indent=1)
        logger.info("worker trace of steps %d:%d written to %s", self.first, self.count, path)

    def _name(self) -> str:
        return f"worker-trace-rank{self.rank}-{os.getpid()}"

    def _on_cuda(self) -> bool:
        device = getattr(self.runner, "device", None)
        return device is not None and device.type == "cuda"

    # ------------------------------------------------------------ the phases' spans
    def _wrap_phases(self) -> None:
        """``asyncllm::<phase>`` spans around the pipeline's and the runner's step phases (those it has)."""
        pipeline = [(self, "_launch", "launch"), (self, "send_output", "send")]
        for owner, attr, phase in pipeline + runner_phases(self.runner):
            original = getattr(owner, attr, None)
            if original is None:
                continue
            own = attr in getattr(owner, "__dict__", {})  # an instance attribute: put back, else deleted
            self._undo.append((owner, attr, original if own else None))
            setattr(owner, attr, _spanned(original, "asyncllm::" + phase))

    def _unwrap_phases(self) -> None:
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._undo.clear()


def runner_phases(runner: Any) -> list[tuple[Any, str, str]]:
    """(owner, method name, phase) of a model runner's step phases that it has: ``launch`` (`execute_model`),
    ``finish``, and within a launch ``update``, ``prepare``, ``forward`` (the model's, or the replayed graph's),
    ``logits`` and ``sample``."""
    batch = getattr(runner, "input_batch", None)
    model = getattr(runner, "model", None)
    phases = [
        (runner, "execute_model", "launch"), (runner, "finish_step", "finish"), (batch, "update_states", "update"),
        (batch, "prepare_inputs", "prepare"), (model, "forward", "forward"),
        (getattr(runner, "cuda_graphs", None), "forward", "forward"), (model, "compute_logits", "logits"),
        (getattr(runner, "sampler", None), "_sample", "sample"),
    ]
    return [(owner, attr, phase) for owner, attr, phase in phases if owner is not None]


def _spanned(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def spanned(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return spanned
