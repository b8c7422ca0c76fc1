"""`asyncllm bench attention-sweep`'s rows, on the CPU under Triton's interpreter at small shapes (its timings are the
GPU's: here a fake clock), and the launch overrides it times."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_testing import DEVICE

from asyncllm.bench import attention_sweep
from asyncllm.bench.kernel_steps import attention_step
from asyncllm.kernels.paged_attention import paged_attention

CFG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "head_dim": 16}


def _step():
    requests = [(random.Random(i).randint(3, 40), 1) for i in range(3)]
    return attention_step(CFG, requests, torch.float32, random.Random(0), device=DEVICE)


def test_sweep_ranks_the_configurations_that_compute_the_same_values() -> None:
    step = _step()
    clock = iter([3.0, 1.0, 2.0, 5.0]).__next__  # ms per call, in the order the candidates are timed
    configs = [(8, 2, 64), (4, 1, 16), (2, 3, 32)]
    rows = attention_sweep.sweep(step, lambda fn: (fn(), clock())[1], bandwidth=1e12, configs=configs, segments=(2,))
    names = [r["config"] for r in rows]
    assert names == ["unified warps=4 stages=1 tile_n=16", "unified warps=2 stages=3 tile_n=32",
                     "unified warps=8 stages=2 tile_n=64", "split-KV segments=2"]
    assert [r["current"] for r in rows] == [False, False, True, False]
    assert rows[0]["us"] == 1000.0 and rows[0]["gb_s"] == pytest.approx(step.bytes_read / 1e-3 / 1e9)
    assert rows[0]["fraction_of_copy_bw"] == pytest.approx(step.bytes_read / 1e-3 / 1e12)


def test_a_configuration_that_computes_other_values_is_not_ranked(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncllm.kernels.paged_decode as paged_decode

    monkeypatch.setattr(paged_decode, "paged_decode", lambda *args: torch.zeros_like(args[0]))
    rows = attention_sweep.sweep(_step(), lambda fn: 1.0, bandwidth=1e12, configs=[(4, 2, 16)], segments=(2,))
    assert rows[0]["config"].startswith("unified") and rows[0]["us"] == 1000.0
    assert rows[1]["us"] is None and rows[1]["error"].startswith("AssertionError")


@pytest.mark.parametrize("warps, stages, tile_n", [(2, 1, 16), (4, 3, 32)])
def test_launch_overrides_give_the_same_attention(warps: int, stages: int, tile_n: int) -> None:
    step = _step()
    md, q, cache = step.metadata, step.query, step.kv_cache
    args = (q, cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, step.head_dim**-0.5)
    out = paged_attention(*args, tile_n=tile_n, num_warps=warps, num_stages=stages)
    torch.testing.assert_close(out, paged_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [dict(num_warps=3), dict(num_warps=0), dict(num_stages=0), dict(num_stages=9)])
def test_launch_overrides_are_checked(bad: dict) -> None:
    step = _step()
    md, q, cache = step.metadata, step.query, step.kv_cache
    with pytest.raises(ValueError, match="num_warps|num_stages"):
        paged_attention(q, cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.25, **bad)
