"""`asyncllm bench`: every workload runs end to end on the CPU with the tiny model, scaled down,
and its JSON carries the metadata, the metrics with exact token counts, and the roofline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncllm.bench.cli import main
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


def test_throughput_with_transformers_peer(tmp_path: Path) -> None:
    result = _run(tmp_path, ["throughput", "--num-requests", "6", "--input-len-range", "8,24",
                             "--output-len-range", "4,12", "--compare", "hf"])
    metrics = result["metrics"]
    prompt_tokens, output_tokens = total_tokens(uniform_requests(6, (8, 24), (4, 12), TINY_VOCAB, seed=0))
    counts = (metrics["num_requests"], metrics["prompt_tokens"], metrics["output_tokens"])
    assert counts == (6, prompt_tokens, output_tokens)
    assert metrics["output_tokens_per_s"] == pytest.approx(output_tokens / metrics["elapsed_s"])
    assert set(result["peers"]) == {"hf_static", "hf_continuous"}
    for name, peer in result["peers"].items():
        assert peer["num_requests"] == 6 and peer["output_tokens_per_s"] > 0
        assert result["ratios"][name] == pytest.approx(metrics["output_tokens_per_s"] / peer["output_tokens_per_s"])
    assert result["roofline"]["decode_batch"] == 6


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


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["throughput", "--input-len-range", "9,3"])
    assert info.value.code == 2
    assert main(["throughput", "--no-progress"]) == 2  # neither --model nor --preset
    assert "exactly one of --model PATH or --preset NAME" in capsys.readouterr().err
