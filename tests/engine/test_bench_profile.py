"""`asyncllm bench profile`: phase times and kernels by kind, on the tiny model on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bench import TINY, _run

from asyncllm.bench.cli import main
from asyncllm.workers.trace_summary import kernel_kind


def test_profile_reports_phases_and_kernels_by_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _run(tmp_path, ["profile", "--batch-size", "3", "--input-len", "20", "--num-steps", "6",
                             "--profile-steps", "2", "--warmup-steps", "1"])
    metrics, settings = result["metrics"], result["settings"]
    assert settings["batch_size"] == 3 and settings["graphs"] is False  # CPU: eager
    assert settings["greedy_graph_replays"] == 0
    phases = [metrics[k] for k in ("schedule_ms", "model_ms", "update_ms")]
    assert all(ms > 0 for ms in phases) and metrics["model_ms"] > metrics["schedule_ms"]
    assert metrics["decode_tokens_per_s"] == pytest.approx(3 / (metrics["step_ms"] / 1e3))
    kinds = metrics["kinds"]
    assert kinds["matmul"]["ms_per_step"] > 0 and kinds["matmul"]["launches_per_step"] >= 1
    assert "attention" in kinds and "sampling" in kinds  # torch_sdpa's attention, the greedy argmax
    assert sum(k["ms_per_step"] for k in kinds.values()) == pytest.approx(metrics["device_ms"])
    top = [k["ms_per_step"] for k in metrics["top_kernels"]]
    assert top and top == sorted(top, reverse=True)
    assert result["roofline"]["decode_batch"] == 3
    host = metrics["host_ms"]  # the runner's phases by the clock: on the CPU the forward computes the model
    assert set(host) == {"update", "prepare", "forward", "logits", "sample", "wait"}
    assert all(host[k] > 0 for k in ("update", "prepare", "forward", "logits", "sample")) and host["wait"] >= 0
    assert host["forward"] > host["prepare"] and sum(host.values()) == pytest.approx(metrics["model_ms"], rel=0.2)
    out = capsys.readouterr().out
    assert "device time per decode step, by kind" in out and "asyncllm bench profile" in out
    assert "host ms per decode step, by phase" in out


@pytest.mark.parametrize("name, kind", [
    ("_paged_attention_kernel", "attention"),
    ("_decode_segment_kernel", "attention"),
    ("_rotary_kv_kernel", "rotary"),
    ("_rms_norm_kernel", "norm"),
    ("_silu_and_mul_kernel", "activation"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "matmul"),
    ("nvjet_hsh_64x8_64x16_2x1_v_bz_TNT", "matmul"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "sampling"),
    ("Memcpy DtoH (Device -> Pinned)", "copy"),
    ("aten::index_select", "copy"),
    ("void at::native::elementwise_kernel<128, 2, add>", "other"),
])
def test_kernel_kinds(name: str, kind: str) -> None:
    assert kernel_kind(name) == kind


def test_profile_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", *TINY, "--tensor-parallel-size", "2"]) == 2
    assert "tensor_parallel_size=2 is not allowed: 1: the profile runs one rank" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # argparse's (common.positive_int)
        main(["profile", *TINY, "--batch-size", "0"])
    assert info.value.code == 2
    assert main(["profile", *TINY, "--batch-size", "9"]) == 2  # TINY has --max-num-seqs 8
    assert "batch_size=9 is not allowed: at most --max-num-seqs (8)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # the in-process loop is synchronous: no such flag
        main(["profile", *TINY, "--async-scheduling"])
    assert info.value.code == 2


def test_profile_prefills_every_prompt_before_the_first_decode(tmp_path: Path) -> None:
    """A step budget of a few prompts: the prompts are prefilled in equal chunks, so that none ends early and decodes
    ahead of the others to its max_tokens during the timed or profiled steps (at batch 256, 128-token prompts and
    8192 tokens a step, the first 64 requests stopped in the profiled steps: "a decode step ran 192 tokens")."""
    result = _run(tmp_path, ["profile", "--batch-size", "4", "--input-len", "16", "--max-num-batched-tokens", "16",
                             "--num-steps", "2", "--profile-steps", "1", "--warmup-steps", "1"])
    # the loop's own guards are what this tests: a request that ran ahead fails the run (prefill(), step())
    assert result["metrics"]["step_ms"] > 0 and result["metrics"]["launches_per_step"] > 0
