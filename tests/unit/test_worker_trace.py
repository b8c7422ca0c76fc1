"""The opt-in worker step trace (ASYNCLLM_WORKER_TRACE_STEPS; workers/step_trace.py, workers/trace_summary.py):
the summary's numbers from a known timeline, a worker's command loop with the trace on (the file, its range) and off
(no profiler at all)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from asyncllm import ConfigError, envs, protocol
from asyncllm.workers.trace_summary import summarize, writing_marker
from asyncllm.protocol import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from asyncllm.workers import step_trace, worker
from asyncllm.workers.token_feedback import InFlightStep


def _span(name: str, start: float, end: float, cat: str = "user_annotation", **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start, "args": args}


# Two steps on a GPU (microseconds): step 6's window [0, 1000), step 7's [1000, 2000) (the end mark).
CUDA_TRACE = [
    _span("asyncllm::step", 0, 900), _span("asyncllm::launch", 10, 400), _span("asyncllm::forward", 100, 300),
    _span("asyncllm::finish", 500, 600), _span("asyncllm::send", 600, 650),
    _span("asyncllm::step", 1000, 1800), _span("asyncllm::launch", 1010, 1300), _span("asyncllm::forward", 1050, 1250),
    _span("asyncllm::trace_end", 2000, 2000),
    _span("cudaLaunchKernel", 120, 125, "cuda_runtime", correlation=1),
    _span("cuLaunchKernel", 200, 205, "cuda_driver", correlation=2),
    _span("cudaGraphLaunch", 1060, 1070, "cuda_runtime", correlation=3),
    _span("cudaMemcpyAsync", 1100, 1105, "cuda_runtime", correlation=4),
    _span("gemm_bf16", 150, 350, "kernel", correlation=1),
    _span("rms_norm_kernel", 360, 420, "kernel", correlation=2),  # 10 us idle after the gemm, within step 6
    _span("paged_attention", 1100, 1300, "kernel", correlation=3),  # 680 us idle before it: between steps
    _span("Memcpy DtoH", 1300, 1350, "gpu_memcpy", correlation=4),  # right after: no gap
    _span("asyncllm::forward", 1100, 1300, "gpu_user_annotation"),  # the device's copy of a span: not work
    {"ph": "f", "cat": "ac2g", "name": "ac2g", "ts": 1100, "id": 3},
]


def test_summary_of_a_known_gpu_timeline() -> None:
    summary = summarize(CUDA_TRACE, on_cuda=True, first_step=6)
    first, second = summary["steps"]
    assert summary["num_steps"] == 2 and (first["step"], second["step"]) == (6, 7)
    assert (first["wall_ms"], second["wall_ms"]) == (1.0, 1.0)
    assert first["host_ms"] == {"launch": 0.39, "forward": 0.2, "finish": 0.1, "send": 0.05, "other": 0.46}
    assert (first["device_busy_ms"], first["idle_within_ms"], first["idle_between_ms"], first["kernels"]) == (
        0.26, 0.01, None, 2)  # the gap before step 6's work is not in the trace
    assert (second["device_busy_ms"], second["idle_within_ms"], second["idle_between_ms"], second["kernels"]) == (
        0.25, 0.0, 0.68, 2)
    assert summary["mean"]["device_busy_ms"] + summary["mean"]["device_idle_ms"] == pytest.approx(0.255 + 0.68)
    assert summary["top_gaps"][0] == {"ms": pytest.approx(0.68), "step": 7, "between_steps": True,
                                      "after": "rms_norm_kernel", "next": "paged_attention",
                                      "host_at_start": "step", "next_launched_in": "forward"}
    assert second["largest_gap"]["host_at_start"] == "step" and first["largest_gap"]["after"] == "gemm_bf16"
    kinds = summary["kinds_ms_per_step"]
    assert kinds["matmul"] == {"ms": 0.1, "launches": 0.5} and kinds["attention"]["ms"] == 0.1
    assert kinds["norm"]["ms"] == pytest.approx(0.03) and kinds["copy"]["ms"] == pytest.approx(0.025)


def test_summary_of_a_cpu_timeline_counts_nested_operators_once() -> None:
    events = [_span("asyncllm::step", 0, 100), _span("asyncllm::launch", 0, 90),
              _span("aten::linear", 10, 50, "cpu_op"), _span("aten::mm", 15, 45, "cpu_op"),
              _span("aten::softmax", 60, 70, "cpu_op"), _span("asyncllm::trace_end", 100, 100)]
    (step,) = summarize(events, on_cuda=False)["steps"]
    assert (step["device_busy_ms"], step["idle_within_ms"], step["kernels"]) == (0.05, 0.01, 3)
    assert step["largest_gap"]["after"] == "aten::linear" and step["largest_gap"]["host_at_start"] == "launch"


def test_the_step_range_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert envs.WORKER_TRACE_STEPS.get() is None
    monkeypatch.setenv(envs.WORKER_TRACE_STEPS.name, " 64:32 ")
    assert envs.WORKER_TRACE_STEPS.get() == (64, 32)
    for raw in ("64", "64:0", "-1:3", "a:3", "3:"):
        monkeypatch.setenv(envs.WORKER_TRACE_STEPS.name, raw)
        with pytest.raises(ConfigError):
            envs.WORKER_TRACE_STEPS.get()


class _Runner:
    """A runner whose steps are a few CPU operators."""

    device = torch.device("cpu")

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        x = torch.ones(8, 8)
        (x @ x).softmax(-1).sum()
        return ModelRunnerOutput(sched_out.step_id, [], [])


class _PipelinedRunner(_Runner):
    """Its steps launched and finished apart (`StepPipeline` finishes each after launching the next)."""

    def launch_step(self, sched_out: SchedulerOutput) -> InFlightStep:
        self.execute_model(sched_out)
        return InFlightStep(sched_out, None, None)  # type: ignore[arg-type]

    def finish_step(self, step: InFlightStep) -> ModelRunnerOutput:
        return ModelRunnerOutput(step.sched_out.step_id, [], [])


class _Reader:
    def __init__(self, commands: list[Any]) -> None:
        encoder = msgspec.msgpack.Encoder()
        self.payloads = [encoder.encode(c) for c in commands]

    def has_message(self) -> bool:
        return bool(self.payloads)

    def dequeue(self) -> bytes:
        return self.payloads.pop(0)


def _run_worker(num_steps: int, pipelined: bool = False) -> _Runner:
    """A worker's command loop over `num_steps` empty steps and a shutdown, in this process."""
    w = worker.Worker(argparse.Namespace(rank=0, world_size=1), results=SimpleNamespace(send=lambda data: None))
    w.runner, w.pipelined = (_PipelinedRunner() if pipelined else _Runner()), pipelined
    w.config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)  # type: ignore[assignment]
    steps = [SchedulerOutput(i + 1, [], CachedRequestData(), {}, 0) for i in range(num_steps)]
    w.reader = _Reader([*steps, protocol.ShutdownWorker()])  # type: ignore[assignment]
    w.run()
    return w.runner


def _trace(folder: Path) -> dict[str, Any]:
    (path,) = folder.glob("worker-trace-rank0-*.json")
    return json.loads(path.read_text())


@pytest.mark.parametrize(("steps", "num_traced"), [("1:2", 2), ("3:5", 2), ("9:2", 0)],
                         ids=["ended-by-its-range", "ended-by-the-shutdown", "never-reached"])
def test_a_worker_writes_its_trace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, steps: str,
                                   num_traced: int) -> None:
    monkeypatch.setenv(envs.WORKER_TRACE_STEPS.name, steps)
    monkeypatch.setenv(envs.WORKER_TRACE_DIR.name, str(tmp_path))
    runner = _run_worker(5)
    trace = _trace(tmp_path)
    assert (trace["rank"], trace["device"], trace["num_steps"], trace["chrome_trace"]) == (0, "cpu", num_traced, None)
    assert "execute_model" not in vars(runner)  # the phases' wrappers are gone
    if not num_traced:
        assert trace["note"] == "the worker ran 5 steps, none of steps 9:2"
        return
    first = int(steps.split(":")[0])
    assert [s["step"] for s in trace["steps"]] == list(range(first, first + num_traced))
    for step in trace["steps"]:
        assert 0 < step["host_ms"]["launch"] < step["wall_ms"] and step["host_ms"]["send"] >= 0
        assert step["kernels"] >= 4 and 0 < step["device_busy_ms"] < step["wall_ms"]
    assert {"matmul", "sampling"} <= set(trace["kinds_ms_per_step"])


def test_the_trace_is_written_under_its_writing_marker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The marker the shutdown waits on (workers/trace_summary.py `wait_for_exit`) is there while the trace is
    written, and gone after."""
    monkeypatch.setenv(envs.WORKER_TRACE_STEPS.name, "1:2")
    monkeypatch.setenv(envs.WORKER_TRACE_DIR.name, str(tmp_path))
    marker, seen, write = Path(writing_marker(os.getpid())), [], step_trace.TracedPipeline._stop_and_write

    def watched(self: Any, folder: str) -> None:
        seen.append(marker.exists())
        write(self, folder)

    monkeypatch.setattr(step_trace.TracedPipeline, "_stop_and_write", watched)
    _run_worker(4)
    assert seen == [True] and not marker.exists() and _trace(tmp_path)["num_steps"] == 2


def test_a_pipelined_worker_s_trace_has_its_finish_phase(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(envs.WORKER_TRACE_STEPS.name, "1:2")
    monkeypatch.setenv(envs.WORKER_TRACE_DIR.name, str(tmp_path))
    runner = _run_worker(4, pipelined=True)
    trace = _trace(tmp_path)
    assert trace["pipelined"] and trace["num_steps"] == 2
    for step in trace["steps"]:  # each window launches its step and finishes the one before
        assert {"launch", "finish", "send"} <= set(step["host_ms"]) and step["host_ms"]["launch"] > 0
    assert not {"execute_model", "finish_step"} & set(vars(runner))  # the wrapped runner methods are unwrapped


def test_an_untraced_worker_makes_no_profiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("made while the trace is off")

    monkeypatch.delenv(envs.WORKER_TRACE_STEPS.name, raising=False)
    monkeypatch.setenv(envs.WORKER_TRACE_DIR.name, str(tmp_path))
    monkeypatch.setattr(torch.profiler, "profile", refused)
    monkeypatch.setattr(step_trace, "TracedPipeline", refused)
    _run_worker(3)
    assert not list(tmp_path.iterdir())
