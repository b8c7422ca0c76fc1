"""Preemption by swap: the CPU block pool, the scheduler's swap-out / swap-in decisions, the worker's copies."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncllm.config import EngineConfig
from asyncllm.kv.swap import SwappedRequest, SwapSpace
from asyncllm.sched.request import RequestStatus
from asyncllm.sched.scheduler import Scheduler
from asyncllm.workers.swap import CPUSwapSpace, num_swap_blocks
from test_scheduler import make_request, run_step


def swap_scheduler(num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int = 16, **fields) -> Scheduler:
    config = EngineConfig.create("dummy-model", block_size=4, preemption_mode="swap", **fields)
    return Scheduler(config, num_gpu_blocks, max_model_len, num_cpu_blocks=num_cpu_blocks)


# ------------------------------------------------------------------ SwapSpace
def test_swap_space_hands_out_the_lowest_free_ids_and_takes_them_back():
    swap = SwapSpace(num_cpu_blocks=4, block_size=4)
    assert swap.can_swap_out(16) and not swap.can_swap_out(17)
    assert swap.swap_out("a", [7, 3, 9], num_computed_tokens=9) == [[7, 0], [3, 1], [9, 2]]
    assert swap.swapped == {"a": SwappedRequest([0, 1, 2], 9)}
    assert (swap.num_used_blocks, swap.num_free_blocks, swap.is_swapped("a")) == (3, 1, True)
    assert not swap.can_swap_out(5)
    # two leading blocks came back from the prefix cache: only block 2 is copied in
    assert swap.resume("a", num_hit_blocks=2, gpu_block_ids=[5, 6]) == [[5, 2]]
    assert swap.num_used_blocks == 0 and not swap.is_swapped("a")
    assert swap.swap_out("b", [1, 2], num_computed_tokens=4) == [[1, 0]]  # only computed blocks move
    swap.free("b")
    swap.free("unknown")
    assert sorted(swap.free_block_ids()) == [0, 1, 2, 3]


# ------------------------------------------------------------------ scheduler
def test_a_swapped_request_resumes_with_its_computed_tokens(caplog):
    """4 blocks of 4 tokens; a and b (6-token prompts) fill them; a's 9th token needs b's blocks."""
    sched = swap_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, enable_prefix_caching=False)
    sched.add_request(make_request("a", 6, max_tokens=10))
    sched.add_request(make_request("b", 6, max_tokens=4))
    with caplog.at_level(logging.WARNING, logger="asyncllm.sched"):
        steps = [run_step(sched)[0] for _ in range(4)]
    out = steps[3]
    assert (out.preempted_req_ids, out.blocks_to_swap_out, out.blocks_to_swap_in) == (["b"], [[2, 0], [3, 1]], [])
    assert out.num_scheduled_tokens == {"a": 1} and out.cached_reqs.new_block_ids == {"a": [2]}
    b = sched.requests["b"]
    assert (b.status, b.num_computed_tokens, b.output_token_ids) == (RequestStatus.PREEMPTED, 0, [7, 7, 7])
    assert sched.swap_space.swapped == {"b": SwappedRequest([0, 1], 8)}
    assert "Request b was preempted (mode=swap)" in caplog.records[0].getMessage()
    steps = [run_step(sched)[0] for _ in range(7)]  # a runs alone to its 10th token; then b comes back
    out = steps[-1]
    assert out.blocks_to_swap_in == [[0, 0], [1, 1]] and out.blocks_to_swap_out == []
    assert [(n.req_id, n.block_ids, n.num_computed_tokens, len(n.token_ids)) for n in out.new_reqs] == [
        ("b", [0, 1, 2], 8, 9)
    ]
    assert out.num_scheduled_tokens == {"b": 1}  # only its last sampled token: nothing recomputed
    assert not sched.has_unfinished_requests() and sched.swap_space.num_used_blocks == 0
    stats = sched.get_stats()
    assert (stats.num_preemptions_total, stats.num_swapped_total, stats.prompt_tokens_total) == (1, 1, 12)


def test_swap_in_takes_blocks_still_in_the_prefix_cache_and_copies_the_rest():
    sched = swap_scheduler(num_gpu_blocks=6, num_cpu_blocks=8, max_model_len=32)
    sched.add_request(make_request("a", 8, max_tokens=6))
    sched.add_request(make_request("b", 8, max_tokens=8))
    steps = [run_step(sched)[0] for _ in range(7)]
    out = steps[5]  # a needs a 4th block: b (12 tokens computed, 3 full blocks) is swapped out
    assert (out.preempted_req_ids, out.blocks_to_swap_out) == (["b"], [[2, 0], [3, 1], [5, 2]])
    assert out.cached_reqs.new_block_ids == {"a": [5]}  # b's third block, evicted from the cache
    out = steps[6]  # b's two prompt blocks are still cached: hits; only its third block is copied in
    assert out.blocks_to_swap_in == [[5, 2]]
    assert [(n.block_ids, n.num_computed_tokens) for n in out.new_reqs] == [([2, 3, 5, 4], 12)]
    assert out.num_scheduled_tokens == {"b": 1}
    assert sched.get_stats().preempted_prefix_cache_hits == 8  # a swapped-out request finds its blocks again


def test_a_full_swap_space_falls_back_to_recompute(caplog):
    sched = swap_scheduler(num_gpu_blocks=4, num_cpu_blocks=1, enable_prefix_caching=False)
    sched.add_request(make_request("a", 6, max_tokens=10))
    sched.add_request(make_request("b", 6, max_tokens=4))
    with caplog.at_level(logging.WARNING, logger="asyncllm.sched"):
        out = [run_step(sched)[0] for _ in range(4)][3]
    assert (out.preempted_req_ids, out.blocks_to_swap_out) == (["b"], [])
    assert not sched.swap_space.swapped
    assert "mode=recompute: the swap space is full" in caplog.records[0].getMessage()
    steps = [run_step(sched)[0] for _ in range(7)]
    assert [(n.req_id, n.num_computed_tokens) for n in steps[-1].new_reqs] == [("b", 0)]
    assert steps[-1].num_scheduled_tokens == {"b": 9} and steps[-1].blocks_to_swap_in == []
    assert sched.get_stats().num_swapped_total == 0


def test_aborting_a_swapped_request_frees_its_cpu_blocks():
    sched = swap_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, enable_prefix_caching=False)
    sched.add_request(make_request("a", 6, max_tokens=10))
    sched.add_request(make_request("b", 6, max_tokens=4))
    for _ in range(4):
        run_step(sched)
    assert sched.swap_space.num_used_blocks == 2
    assert [r.request_id for r in sched.abort_requests(["b"])] == ["b"]
    assert sched.swap_space.num_used_blocks == 0 and not sched.waiting
    assert run_step(sched)[0].finished_req_ids == ["b"]


def test_recompute_mode_has_no_swap_space():
    sched = Scheduler(EngineConfig.create("dummy-model", block_size=4), 4, 16, num_cpu_blocks=8)
    assert sched.swap_space is None


# ------------------------------------------------------------------ the worker's copies
def test_cpu_swap_space_copies_out_then_in():
    torch.manual_seed(0)
    gpu = [torch.randn(2, 6, 4, 2, 3) for _ in range(2)]
    before = [layer.clone() for layer in gpu]
    swap = CPUSwapSpace(3, gpu)
    assert [tuple(c.shape) for c in swap.caches] == [(2, 3, 4, 2, 3)] * 2
    swap.swap(gpu, blocks_to_swap_out=[[1, 0], [4, 2]], blocks_to_swap_in=[])
    for layer, cpu in zip(before, swap.caches):
        assert torch.equal(cpu[:, 0], layer[:, 1]) and torch.equal(cpu[:, 2], layer[:, 4])
    # one step that swaps block 1 out to CPU block 1 and CPU block 0 (old block 1) into block 1
    swap.swap(gpu, blocks_to_swap_out=[[5, 1]], blocks_to_swap_in=[[1, 0], [3, 2]])
    for layer, old, cpu in zip(gpu, before, swap.caches):
        assert torch.equal(cpu[:, 1], old[:, 5])
        assert torch.equal(layer[:, 1], old[:, 1]) and torch.equal(layer[:, 3], old[:, 4])
        assert torch.equal(layer[:, 0], old[:, 0]) and torch.equal(layer[:, 5], old[:, 5])


@pytest.mark.parametrize(("gib", "bytes_per_block", "expected"), [(1.0, 2**20, 1024), (0.001, 2**20, 1), (0.0, 512, 0)])
def test_num_swap_blocks(gib, bytes_per_block, expected):
    assert num_swap_blocks(gib, bytes_per_block) == expected
