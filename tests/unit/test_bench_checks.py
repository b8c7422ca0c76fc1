"""`asyncllm bench`'s checks before and after a run, and its metrics arithmetic, without starting an engine."""

from __future__ import annotations

import argparse
import contextlib
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
import torch

from asyncllm.bench import common, latency, serve
from asyncllm.bench.cli import main, parser
from asyncllm.bench.model import BenchModel
from asyncllm.bench.requests import BenchRequest, sharegpt_like_requests
from asyncllm.bench.roofline import Roofline
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError

TINY = ["--preset", "tiny", "--no-progress"]


@pytest.fixture
def no_engine(monkeypatch) -> None:
    @contextlib.asynccontextmanager
    async def refuse(ctx: Any, longest: int) -> AsyncIterator[Any]:
        raise AssertionError("the engine started")
        yield

    monkeypatch.setattr(common, "open_engine", refuse)


def _ctx(max_model_len: int | None, max_position: int, **args: Any) -> Any:
    model = BenchModel("m", "/m", "dummy", 100, max_position)
    return SimpleNamespace(args=argparse.Namespace(max_model_len=max_model_len, **args), model=model,
                           dtype=torch.float32, argv=["latency"])


def test_check_fits_measures_the_longest_request_against_the_engines_max_model_len() -> None:
    common.check_fits(_ctx(None, 64), 64, "x")
    common.check_fits(_ctx(100, 64), 100, "x")  # --max-model-len wins over the model's limit
    with pytest.raises(ConfigError, match=r"max_model_len=64 .* 65 tokens \(x\); it is the model's"):
        common.check_fits(_ctx(None, 64), 65, "x")
    with pytest.raises(ConfigError, match="max_model_len=40 .* 41 tokens .* from --max-model-len: raise it"):
        common.check_fits(_ctx(40, 64), 41, "x")


@pytest.mark.parametrize("argv, flags", [
    (["latency", "--input-len", "2040", "--output-len", "16"], "2056 tokens (--input-len 2040 + --output-len 16)"),
    (["loop-lag", "--input-len", "2040", "--output-len", "16"], "(--input-len 2040 + --output-len 16)"),
    (["throughput", "--num-requests", "2", "--input-len-range", "30,30", "--output-len-range", "20,20",
      "--max-model-len", "40"], "50 tokens (--input-len-range 30,30 + --output-len-range 20,20)"),
    (["serve"], "--max-input-len 2048 + an output of at most --max-output-len 1024"),  # its defaults: over tiny's 2048
])
def test_a_workload_longer_than_max_model_len_is_refused_before_the_engine_starts(argv, flags, capsys,
                                                                                   no_engine) -> None:
    assert main([*argv, *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncllm bench: max_model_len=") and flags in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, flags", [
    (["soak", "--input-len", "4,2040", "--output-len", "4,16"], "2056 tokens (--input-len 4,2040 + --output-len 4,16)"),
    (["profile", "--input-len", "2000", "--num-steps", "40"],
     "2057 tokens (--input-len 2000 + --warmup-steps 5 + --num-steps 40 + --profile-steps 10 + 2)"),
])
def test_soak_and_profile_refuse_a_workload_longer_than_max_model_len_before_loading(argv, flags, capsys,
                                                                                      monkeypatch) -> None:
    from asyncllm.bench import profile, soak

    def refuse(*args: Any) -> None:
        raise AssertionError("the engine started")

    monkeypatch.setattr(soak, "run_engine", refuse)
    monkeypatch.setattr(profile, "_StepLoop", refuse)
    assert main([*argv, *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncllm bench: max_model_len=2048") and flags in err and err.count("\n") == 1


@pytest.mark.parametrize("flags", [["--quantization", "fp8"], ["--kv-cache-dtype", "fp8"]])
def test_compare_hf_refuses_fp8_the_peer_would_not_run(flags, capsys, no_engine) -> None:
    assert main(["latency", *TINY, "--compare", "hf", *flags]) == 2
    assert capsys.readouterr().err == (f"asyncllm bench: compare='hf' is not allowed: no {' '.join(flags)}: "
                                       "transformers' peer would run unquantized, in the model dtype\n")


@pytest.mark.parametrize("flags, max_num_seqs", [(["--max-num-batched-tokens", "64"], 64), ([], 256),
                                                  (["--max-num-seqs", "8", "--max-num-batched-tokens", "64"], 8)])
def test_max_num_seqs_unset_is_the_engines_default(flags: list[str], max_num_seqs: int) -> None:
    args = parser().parse_args(["latency", *TINY, *flags])
    ctx = SimpleNamespace(args=args, model=BenchModel("m", "/m", "dummy", 100, 64), dtype=torch.float32,
                          device=torch.device("cpu"))
    config = EngineConfig.create("m", **common.engine_kwargs(ctx, 64))  # 64 tokens with 256 seqs: a ConfigError
    assert config.max_num_seqs == common.max_num_seqs(args) == max_num_seqs


def test_vllm_spellings_of_the_engine_flags() -> None:
    """bench takes vLLM's half / float dtypes, human-readable sizes (4k, 2K) and -tp, as serve does."""
    args = parser().parse_args(["latency", *TINY, "--dtype", "half", "--max-model-len", "4k",
                                "--max-num-batched-tokens", "2K", "-tp", "2"])
    assert (args.dtype, args.max_model_len, args.max_num_batched_tokens, args.tensor_parallel_size) == (
        "float16", 4000, 2048, 2)
    assert parser().parse_args(["latency", *TINY, "--dtype", "float"]).dtype == "float32"


def test_serve_lengths_honour_caps_below_four() -> None:
    requests = sharegpt_like_requests(50, vocab_size=500, seed=0, max_input_len=2, max_output_len=1)
    assert {len(r.prompt_token_ids) for r in requests} == {2} and {r.output_len for r in requests} == {1}


def test_loop_lag_checks_the_token_counts(monkeypatch) -> None:
    class OneShort:
        async def stream(self, prompt: list[int], params: Any) -> AsyncIterator[Any]:
            yield SimpleNamespace(token_ids=[7] * (params.max_tokens - 1))

    @contextlib.asynccontextmanager
    async def short_engine(ctx: Any, longest: int) -> AsyncIterator[Any]:
        yield OneShort()

    monkeypatch.setattr(common, "open_engine", short_engine)
    with pytest.raises(RuntimeError, match="the engine generated 4 tokens, 6 were requested"):
        main(["loop-lag", *TINY, "--num-streams", "2", "--input-len", "4", "--output-len", "3"])


def test_latency_reports_the_median_of_each_iterations_ms_per_token() -> None:
    metrics = latency._metrics([(0.1, 1.0, 11), (0.3, 3.0, 11)], 11)  # 10 and 3.33 tokens/s: 100 and 300 ms
    assert metrics["decode_tokens_per_s"] == pytest.approx((10 + 10 / 3) / 2)
    assert metrics["ms_per_output_token"] == pytest.approx(200.0)  # not 1000 / the median rate (150)
    assert metrics["ttft_s"] == pytest.approx(0.2)
    with pytest.raises(RuntimeError, match=r"generated \[11, 10\] tokens, not 11"):
        latency._metrics([(0.1, 1.0, 11), (0.3, 3.0, 10)], 11)


def test_latency_of_one_output_token_has_no_decode_metrics(capsys) -> None:
    metrics = latency._metrics([(0.1, 0.0, 1), (0.2, 0.0, 1), (0.3, 0.0, 1)], 1)
    assert metrics == {"ttft_s": 0.2, "decode_tokens_per_s": None, "ms_per_output_token": None,
                       "ttft_s_all": [0.1, 0.2, 0.3], "decode_tokens_per_s_all": [None, None, None]}
    ctx = _ctx(None, 64, quantization="fp8", kv_cache_dtype="fp8", output_json=None)  # profile: no async flag
    line = Roofline(10.0, 100, 8.0, 1, 16.0, 1000.0)
    result = common.finish(ctx, "latency", {"output_len": 1}, metrics, line, metrics["decode_tokens_per_s"])
    assert result["settings"] == {"output_len": 1, "quantization": "fp8", "kv_cache_dtype": "fp8",
                                  "async_scheduling": False}
    assert result["roofline"]["fraction"] is None and result["roofline"]["measured_tokens_per_s"] is None
    out = capsys.readouterr().out
    assert "tokens/s; measured n/a\n" in out and "ms_per_output_token" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith(("decode_", "fraction"))] == ["n/a"] * 2


@pytest.mark.parametrize("config_json", [None, "{", '{"hidden_size": 8}'], ids=["none", "not-json", "no-vocab-size"])
def test_a_model_folder_without_a_usable_config_json_is_one_error_line(tmp_path, capsys, no_engine,
                                                                      config_json: str | None) -> None:
    """A folder that exists but has no config.json (a parent folder given by mistake), or an unreadable one, was a
    FileNotFoundError / KeyError traceback until 2026-12-07; now the bench's one line and exit 2."""
    if config_json is not None:
        (tmp_path / "config.json").write_text(config_json)
    assert main(["latency", "--model", str(tmp_path), "--no-progress"]) == 2
    assert f"model={str(tmp_path)!r} is not allowed" in capsys.readouterr().err


def test_serve_of_one_output_token_each_has_no_inter_token_latency() -> None:
    """No request has a second token: the ITL percentiles are n/a (null), not 0 ms; TTFT, tokens/s as measured."""
    requests = [BenchRequest([11, 12], 1), BenchRequest([13], 1)]
    results = [{"ttft": 0.01, "itls": [], "tokens": 1, "e2e": 0.01}, {"ttft": 0.03, "itls": [], "tokens": 1, "e2e": 0.03}]
    metrics = serve._metrics(requests, results, 0.5)
    assert metrics["itl_p50_ms"] is None and metrics["itl_p99_ms"] is None
    assert metrics["ttft_p50_ms"] == pytest.approx(20.0) and metrics["output_tokens_per_s"] == pytest.approx(4.0)
    results[1]["itls"], requests[1] = [0.002, 0.004], BenchRequest([13], 3)
    results[1]["tokens"] = 3
    metrics = serve._metrics(requests, results, 0.5)
    assert (metrics["itl_p50_ms"], metrics["itl_p99_ms"]) == pytest.approx((3.0, 3.98))


def test_serve_counts_the_requests_the_engine_failed(monkeypatch, tmp_path, capsys) -> None:
    """A request the engine fails (here the second of four) is counted and left out of the latencies and tokens, as
    vLLM's bench serve does, instead of ending the run with one error line and no numbers."""
    import json

    from asyncllm.errors import EngineOverloadedError

    class FailsOne:
        calls, fail_all = 0, False

        async def stream(self, prompt: list[int], params: Any) -> AsyncIterator[Any]:
            FailsOne.calls += 1
            if FailsOne.calls == 2 or FailsOne.fail_all:
                raise EngineOverloadedError("max_num_queued_requests=1: retry later")
            for _ in range(params.max_tokens):
                yield SimpleNamespace(token_ids=[7])

    @contextlib.asynccontextmanager
    async def failing_engine(ctx: Any, longest: int) -> AsyncIterator[Any]:
        yield FailsOne()

    monkeypatch.setattr(common, "open_engine", failing_engine)
    out = tmp_path / "serve.json"
    assert main(["serve", *TINY, "--num-requests", "4", "--request-rate", "inf", "--max-input-len", "8",
                 "--max-output-len", "5", "--output-json", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    requests = sharegpt_like_requests(4, 512, 0, 8, 5)
    assert (metrics["num_requests"], metrics["num_failed_requests"]) == (4, 1)
    assert metrics["failed_errors"] == ["EngineOverloadedError: max_num_queued_requests=1: retry later"]
    assert metrics["output_tokens"] == sum(r.output_len for i, r in enumerate(requests) if i != 1)
    assert "num_failed_requests" in capsys.readouterr().out
    FailsOne.fail_all = True  # every request fails: the first error, one line, as before
    assert main(["serve", *TINY, "--num-requests", "2", "--max-input-len", "8", "--max-output-len", "5"]) == 2
    assert capsys.readouterr().err == "asyncllm bench: max_num_queued_requests=1: retry later\n"


def test_latency_shows_a_progress_bar_over_its_iterations(monkeypatch, capsys) -> None:
    """Every workload shows a progress bar (docs/benchmarks.md); latency's counts its iterations."""

    class Streams:
        async def stream(self, prompt: list[int], params: Any) -> AsyncIterator[Any]:
            for _ in range(params.max_tokens):
                yield SimpleNamespace(token_ids=[7])

    @contextlib.asynccontextmanager
    async def engine(ctx: Any, longest: int) -> AsyncIterator[Any]:
        yield Streams()

    monkeypatch.setattr(common, "open_engine", engine)
    assert main(["latency", "--preset", "tiny", "--input-len", "4", "--output-len", "3", "--num-iters", "2"]) == 0
    err = capsys.readouterr().err
    assert "asyncllm latency" in err and "2/2" in err
