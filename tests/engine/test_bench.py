"""`asyncllm bench`: every workload runs end to end on the CPU with the tiny model, scaled down,
and its JSON carries the metadata, the metrics with exact token counts, and the roofline; the
transformers peer reports its phases and, cut by its time budget, what it completed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from asyncllm.bench.cli import main
from asyncllm.bench.peer_clock import PeerClock
from asyncllm.bench.requests import sharegpt_like_requests, total_tokens, uniform_requests

TINY = ["--preset", "tiny", "--max-num-seqs", "8"]
TINY_VOCAB = 512


def _run(tmp_path: Path, argv: list[str]) -> dict[str, Any]:
    out = tmp_path / "result.json"
    assert main([*argv, *TINY, "--output-json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["workload"] == argv[0]
    meta = result["meta"]
    assert meta["date"] and meta["device"].startswith("CPU") and meta["commit"]
    assert meta["command"].startswith(f"asyncllm bench {argv[0]}")
    roofline = result["roofline"]
    assert roofline["copy_bandwidth_gb_s"] > 0 and roofline["weight_bytes_per_step"] > 0
    assert roofline["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x 16 dims x fp32
    assert roofline["output_tokens_per_s"] > 0 and 0 < roofline["fraction"] < 1
    return result


def test_throughput_with_transformers_peer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _run(tmp_path, ["throughput", "--num-requests", "6", "--input-len-range", "8,24",
                             "--output-len-range", "4,12", "--compare", "hf", "--hf-batch-size", "2",
                             "--compare-num-requests", "4"])
    metrics = result["metrics"]
    requests = uniform_requests(6, (8, 24), (4, 12), TINY_VOCAB, seed=0)
    prompt_tokens, output_tokens = total_tokens(requests)
    counts = (metrics["num_requests"], metrics["prompt_tokens"], metrics["output_tokens"])
    assert counts == (6, prompt_tokens, output_tokens)
    assert metrics["output_tokens_per_s"] == pytest.approx(output_tokens / metrics["elapsed_s"])
    compared = metrics["compared"]  # asyncllm on the peers' 4 requests: what the ratios divide
    assert (compared["num_requests"], compared["output_tokens"]) == (4, total_tokens(requests[:4])[1])
    assert result["settings"]["compare_time_budget_s"] == 240
    assert set(result["peers"]) == {"hf_static", "hf_continuous"}
    for name, peer in result["peers"].items():
        assert (peer["num_requests"], peer["num_requests_completed"], peer["cut"]) == (4, 4, False)
        assert peer["output_tokens"] == compared["output_tokens"] and peer["output_tokens_per_s"] > 0
        assert result["ratios"][name] == pytest.approx(compared["output_tokens_per_s"] / peer["output_tokens_per_s"])
        assert all(p["seconds"] >= 0 for p in peer["phases"] if "seconds" in p)
    static_phases = [p["phase"] for p in result["peers"]["hf_static"]["phases"]]
    assert static_phases[-2:] == ["static batch 1/2", "static batch 2/2"] and "warm-up generate" in static_phases
    continuous_phases = [p["phase"] for p in result["peers"]["hf_continuous"]["phases"]]
    assert {"continuous batching: manager init", "continuous batching: run"} <= set(continuous_phases)
    # the fastest schedule: every request decodes from the first step, as many steps as the longest output
    longest = max(r.output_len for r in requests)
    assert result["roofline"]["decode_batch"] == pytest.approx(output_tokens / longest)
    weighted = sum(r.output_len * (len(r.prompt_token_ids) + r.output_len / 2) for r in requests) / output_tokens
    assert result["roofline"]["mean_context"] == pytest.approx(weighted)
    out, err = capsys.readouterr()
    assert "asyncllm / hf_static " in out and "asyncllm / hf_continuous " in out and "peer cut" not in out
    assert "asyncllm on the peers' 4 requests output_tokens_per_s" in out
    assert "] static batch 2/2: done in" in err  # each phase's start and end on stderr


def test_peer_cut_by_its_time_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A budget spent before the peer's first batch: both peers cut, nothing completed, no ratio, no crash."""
    result = _run(tmp_path, ["throughput", "--num-requests", "4", "--input-len-range", "8,16",
                             "--output-len-range", "4,8", "--compare", "hf", "--compare-time-budget", "0.01"])
    for name, peer in result["peers"].items():
        assert peer["cut"] and peer["num_requests_completed"] < peer["num_requests"] == 4
        assert "cut by the time budget" in peer["completed"] and result["ratios"][name] is None
    assert "static batching: its share of the budget is spent" in [
        p["phase"] for p in result["peers"]["hf_static"]["phases"]]
    out = capsys.readouterr().out
    assert "asyncllm / hf_static (peer cut by its time budget)" in out and "0/4, cut by the time budget" in out


@pytest.fixture(scope="module")
def tiny_hf() -> tuple[Any, Any]:
    """The benchmark context of the tiny preset and its transformers model, loaded once."""
    from asyncllm.bench.cli import parser
    from asyncllm.bench.common import make_context
    from asyncllm.bench.hf_peer import load_hf_model

    ctx = make_context(parser().parse_args(["latency", *TINY, "--no-progress"]), None)
    return ctx, load_hf_model(ctx, PeerClock(60))


LONG = uniform_requests(3, (8, 16), (1800, 1990), TINY_VOCAB, seed=0)
"""Too long for any peer to finish in the half second its deadline gives it (a fast CI machine decoded
all 1,907 tokens of the first at batch 1 in 1.9 s, so a 2 s budget did not cut it)."""
CUT_S = 0.5


def test_peers_cut_mid_run_count_the_tokens_they_generated(tiny_hf: tuple[Any, Any]) -> None:
    """Static batching cut inside its batch, continuous batching hard-stopped: the tokens so far, flagged."""
    from asyncllm.bench.hf_continuous import continuous_batching
    from asyncllm.bench.hf_peer import static_batching

    _, model = tiny_hf
    clock = PeerClock(60)
    requested = total_tokens(LONG)[1]
    static = static_batching(model, LONG, 4, clock, time.perf_counter() + CUT_S, show=False)
    assert static["cut"] and static["num_requests_completed"] == 0
    assert 0 < static["output_tokens"] < requested and static["output_tokens"] % len(LONG) == 0  # rows in step
    assert "total_tokens_per_s" not in static  # which prompts were prefilled is not counted for a cut run
    continuous = continuous_batching(model, LONG, clock, time.perf_counter() + CUT_S, show=False)
    assert continuous["cut"] and continuous["partial_tokens_counted"] and 0 < continuous["output_tokens"] < requested
    assert continuous["output_tokens_per_s"] == pytest.approx(continuous["output_tokens"] / continuous["elapsed_s"])
    stops = [r for r in clock.records if r["phase"] == "continuous batching: stop at the deadline"]
    assert len(stops) == 1 and stops[0]["requests_handed_back"] == len(LONG)


def test_latency_peer_cut_by_its_budget(tiny_hf: tuple[Any, Any]) -> None:
    from asyncllm.bench.hf_peer import latency_peer

    ctx, _ = tiny_hf
    peer = latency_peer(ctx, LONG[0], budget_s=CUT_S)["hf_generate"]
    assert peer["cut"] and peer["output_tokens"] < LONG[0].output_len and "cut by the time budget" in peer["completed"]
    phases = [p["phase"] for p in peer["phases"]]
    assert phases[-2:] == ["generate: TTFT", "generate: decode"] and "warm-up generate" in phases


def test_gpu_session_step_output_survives_a_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A step killed at its limit keeps the lines it printed (session.log, and the peer's on stdout)."""
    from asyncllm.bench import gpu_session

    script = "import time; print('[hf peer   1.0s] static batch 1/1: start', flush=True); time.sleep(60)"
    monkeypatch.setattr(gpu_session, "STEPS", [gpu_session.Step("slow-peer", [], 2)])
    monkeypatch.setattr(gpu_session, "_command", lambda step, json_path: [sys.executable, "-c", script])
    assert gpu_session.main(["--out", str(tmp_path), "--budget-s", "60"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["slow-peer"]["exit"] == "timeout"
    assert "static batch 1/1: start" in (tmp_path / "session.log").read_text()
    assert "[slow-peer] [hf peer   1.0s] static batch 1/1: start" in capsys.readouterr().out


def test_gpu_session_step_gets_its_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncllm.bench import gpu_session

    script = "import os; print('pipeline=' + os.environ['ASYNCLLM_WORKER_PIPELINE'])"
    step = gpu_session.Step("env-step", [], 20, env=(("ASYNCLLM_WORKER_PIPELINE", "0"),))
    monkeypatch.setattr(gpu_session, "STEPS", [step])
    monkeypatch.setattr(gpu_session, "_command", lambda step, json_path: [sys.executable, "-c", script])
    assert gpu_session.main(["--out", str(tmp_path), "--budget-s", "60"]) == 0
    assert "pipeline=0" in (tmp_path / "session.log").read_text()


def test_gpu_session_refuses_an_unknown_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncllm.bench import gpu_session

    with pytest.raises(SystemExit):
        gpu_session.main(["--out", str(tmp_path), "--only", "gpu-test"])
    assert "unknown step(s) gpu-test" in capsys.readouterr().err and not (tmp_path / "results.json").exists()


def test_gpu_session_pytest_steps_name_existing_tests() -> None:
    """A renamed test file would make a GPU session's pytest step fail at collection, a device call lost."""
    from asyncllm.bench import gpu_session

    root = Path(__file__).resolve().parents[2]
    paths = [arg for step in gpu_session.STEPS if step.pytest for arg in step.argv if arg.startswith("tests/")]
    assert len(paths) > 8 and not [p for p in paths if not (root / p).exists()]


def test_latency(tmp_path: Path) -> None:
    result = _run(tmp_path, ["latency", "--input-len", "16", "--output-len", "12", "--num-iters", "2"])
    metrics = result["metrics"]
    assert len(metrics["ttft_s_all"]) == 2 and len(metrics["decode_tokens_per_s_all"]) == 2
    assert metrics["ttft_s"] > 0 and metrics["decode_tokens_per_s"] > 0
    assert result["roofline"]["decode_batch"] == 1 and result["roofline"]["mean_context"] == 16 + 12 / 2


def test_serve(tmp_path: Path) -> None:
    result = _run(tmp_path, ["serve", "--num-requests", "6", "--request-rate", "20", "--max-input-len", "32",
                             "--max-output-len", "10"])
    metrics = result["metrics"]
    expected = total_tokens(sharegpt_like_requests(6, TINY_VOCAB, 0, 32, 10))[1]
    assert metrics["output_tokens"] == expected
    assert 0 < metrics["ttft_p50_ms"] <= metrics["ttft_p99_ms"]
    assert 0 < metrics["itl_p50_ms"] <= metrics["itl_p99_ms"]


def test_loop_lag(tmp_path: Path) -> None:
    result = _run(tmp_path, ["loop-lag", "--num-streams", "8", "--input-len", "8", "--output-len", "8"])
    metrics = result["metrics"]
    assert metrics["num_streams"] == 8 and metrics["num_lag_samples"] > 0
    assert 0 <= metrics["lag_p50_ms"] <= metrics["lag_p99_ms"] <= metrics["lag_max_ms"]


def test_kernels_without_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernels"]) == 0
    assert "need a CUDA device" in capsys.readouterr().err
    assert main(["attention-sweep", "--batch-size", "64"]) == 0
    assert "the sweep needs a CUDA device" in capsys.readouterr().err


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["throughput", "--input-len-range", "9,3"])
    assert info.value.code == 2
    assert main(["throughput", "--no-progress"]) == 2  # neither --model nor --preset
    assert "exactly one of --model PATH or --preset NAME" in capsys.readouterr().err
    assert main(["latency", *TINY, "--compare-time-budget", "30"]) == 2  # a peer's flag without the peer
    assert "--compare-time-budget=30.0 is not allowed: only with --compare hf" in capsys.readouterr().err
    assert main(["latency", "--preset", "gpt-oss-20b", "--compare", "hf"]) == 2  # bf16 peer experts against MXFP4
    assert "is MXFP4 (the peer would build bfloat16 experts)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["latency", *TINY, "--compare", "hf", "--compare-time-budget", "0"])
    for flag in ("--hf-batch-size", "--compare-num-requests"):
        with pytest.raises(SystemExit):
            main(["throughput", *TINY, "--compare", "hf", flag, "0"])
    capsys.readouterr()
    assert main(["throughput", *TINY, "--compare", "hf", "--temperature", "0.7"]) == 2  # the peers decode greedily
    assert "temperature=0.7 is not allowed: 0 with --compare hf" in capsys.readouterr().err
