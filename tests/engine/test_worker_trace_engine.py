"""`asyncllm bench latency --worker-trace`: the real engine's worker traces its steps on the CPU (the tiny model), and
the bench embeds the rank's summary; the trace's variables are gone from the bench's environment afterwards."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from asyncllm import envs
from asyncllm.bench.cli import main


def test_latency_with_a_worker_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, folder = tmp_path / "result.json", tmp_path / "trace"
    # warm-up: one 5-token prompt, 4 tokens (steps 0-3); the request: its prefill (4) and 7 decodes (5-11)
    assert main(["latency", "--preset", "tiny", "--max-num-seqs", "8", "--input-len", "8", "--output-len", "8",
                 "--num-iters", "1", "--worker-trace", "6:3", "--worker-trace-dir", str(folder),
                 "--worker-trace-chrome", "--output-json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["worker_trace"] == [6, 3]
    (trace,) = result["metrics"]["worker_trace"]
    assert (trace["rank"], trace["device"], trace["first_step"], trace["num_steps"]) == (0, "cpu", 6, 3)
    assert [step["step"] for step in trace["steps"]] == [6, 7, 8]
    for step in trace["steps"]:
        host = step["host_ms"]
        assert 0 < host["prepare"] < host["launch"] and 0 < host["forward"] < host["launch"] <= step["wall_ms"]
        assert step["kernels"] > 10 and 0 < step["device_busy_ms"] < step["wall_ms"]
    mean = trace["mean"]
    assert 0 <= mean["device_idle_ms"] and mean["device_busy_ms"] + mean["device_idle_ms"] < 1.5 * mean["wall_ms"]
    assert {"matmul", "attention", "sampling"} <= set(trace["kinds_ms_per_step"])
    assert trace["top_gaps"] and all(gap["ms"] > 0 and gap["after"].startswith("aten::") for gap in trace["top_gaps"])
    assert json.loads((folder / Path(trace["chrome_trace"]).name.replace(".chrome.json.gz", ".json")).read_text()) == trace
    with gzip.open(trace["chrome_trace"]) as f:
        names = {e["name"] for e in json.load(f)["traceEvents"]}
    assert {"asyncllm::step", "asyncllm::forward", "asyncllm::trace_end"} <= names
    assert "[worker trace] rank 0: 3 steps from 6, per step (mean)" in capsys.readouterr().out
    assert envs.WORKER_TRACE_STEPS.name not in os.environ and envs.WORKER_TRACE_DIR.name not in os.environ
