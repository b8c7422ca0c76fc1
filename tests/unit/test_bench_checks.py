"""`asyncllm bench`'s checks before and after a run, and its metrics arithmetic, without starting an engine."""

from __future__ import annotations

import argparse
import contextlib
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
import torch

from asyncllm.bench import common, latency
from asyncllm.bench.cli import main, parser
from asyncllm.bench.model import BenchModel
from asyncllm.bench.requests import sharegpt_like_requests
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
