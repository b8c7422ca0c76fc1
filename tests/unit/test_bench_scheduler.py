"""The scheduler micro-benchmark runs, times only full decode steps, and prints its figures."""

from __future__ import annotations

from asyncllm.bench import scheduler


def test_run_times_decode_steps_of_every_request():
    result = scheduler.run(num_requests=64, steps=10)
    assert (result["num_requests"], result["steps"], result["enable_prefix_caching"]) == (64, 10, True)
    assert 0 < result["min_ms"] <= result["median_ms"] <= result["p90_ms"] <= result["max_ms"]
    assert result["schedule_median_ms"] > 0 and result["update_median_ms"] > 0


def test_main_prints_the_summary(capsys):
    scheduler.main(["--num-requests", "32", "--steps", "5", "--no-prefix-caching"])
    out = capsys.readouterr().out
    assert "32 running requests, 5 decode steps (prefix caching off)" in out
    assert "schedule() + update_from_output(): median" in out
    assert "overlapped core step" in out


def test_overlapped_steps_are_timed():
    result = scheduler.run_overlapped(num_requests=32, steps=6)
    assert result["steps"] == 6 and 0 < result["min_ms"] <= result["median_ms"]
