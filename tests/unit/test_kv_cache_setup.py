"""The model runner's KV cache sizing (workers/kv_cache_setup.py): blocks per byte budget, the profile step
(the largest step the scheduler can send) and what it leaves behind, with the fake model of test_model_runner.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm import envs
from asyncllm.errors import ConfigError
from asyncllm.workers.kv_cache_setup import profile_step
from asyncllm.workers.model_runner import ModelRunner
import test_model_runner
from test_model_runner import CPU, FAKE_SPEC, FakeModel, make_config

fake_runner = test_model_runner.fake_runner  # the fixture, shared


def test_cpu_blocks_follow_the_kvcache_space(fake_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fake_runner.bytes_per_block == 2 * 1 * 4 * 1 * 16 * 4
    monkeypatch.setenv(envs.CPU_KVCACHE_SPACE_GB.name, "0.001")
    assert fake_runner.determine_num_available_blocks() == int(0.001 * 2**30) // 512
    assert fake_runner.kv_budget_field == "ASYNCLLM_CPU_KVCACHE_SPACE_GB"  # what the core's advice names
    monkeypatch.setenv(envs.CPU_KVCACHE_SPACE_GB.name, "1e-7")  # 107 bytes: the variable's, not what weights left
    with pytest.raises(ConfigError, match=r"ASYNCLLM_CPU_KVCACHE_SPACE_GB=1e-07 .*block \(512 bytes\); it gives 107 "
                                          r"bytes: raise it$"):
        fake_runner.determine_num_available_blocks()


def test_kv_cache_memory_bytes_sizes_the_cache(tmp_path: Path) -> None:
    """vLLM's kv_cache_memory_bytes: that many bytes of blocks per rank, whatever the CPU space or memory."""
    for size, blocks in ((512 * 77 + 100, 77), (100, None)):
        runner = ModelRunner(make_config(tmp_path, kv_cache_memory_bytes=size), rank=0, tp_size=1, device=CPU)
        runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
        if blocks is None:
            with pytest.raises(ConfigError, match="kv_cache_memory_bytes=100 .*at least one KV block"):
                runner.determine_num_available_blocks()
        else:
            assert runner.determine_num_available_blocks() == blocks


def test_the_profiled_budget_keeps_room_for_each_seats_image_states(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose requests' states are allocated as they start (Mllama's cross-attention states: an image's
    ``image_state_bytes``, one image a seat unless limit_mm_per_prompt says more): the profiled budget loses
    max_num_seqs seats of them before it is cut into blocks (docs/multimodal.md#llama-32-vision)."""
    class ImageStatesModel(FakeModel):
        mm_default_image_limit = 1
        image_state_bytes = 3 * 512  # three blocks' bytes

    for limits, blocks in ((None, 100 - 8 * 3), ({"image": 2}, 100 - 8 * 6)):
        runner = ModelRunner(make_config(tmp_path, limit_mm_per_prompt=limits), rank=0, tp_size=1, device=CPU)
        runner.attach_model(ImageStatesModel(), FAKE_SPEC, torch.float32)
        runner.device = torch.device("cuda")  # the profiled path; its profile step stubbed
        monkeypatch.setattr(runner, "_profile_cuda_kv_budget", lambda: 100 * 512)
        assert runner.determine_num_available_blocks() == blocks


def test_profile_step_is_the_largest_step() -> None:
    sched_out, num_blocks = profile_step(max_num_batched_tokens=50, max_num_seqs=8, max_model_len=32, block_size=4)
    lengths = [len(r.token_ids) for r in sched_out.new_reqs]
    assert lengths == [7, 7, 6, 6, 6, 6, 6, 6] and sched_out.total_num_scheduled_tokens == 50
    assert num_blocks == 2 * 2 + 6 * 2
    assert sorted(b for r in sched_out.new_reqs for b in r.block_ids) == list(range(num_blocks))
    capped, _ = profile_step(max_num_batched_tokens=100, max_num_seqs=2, max_model_len=10, block_size=4)
    assert [len(r.token_ids) for r in capped.new_reqs] == [10, 10]


def test_profile_step_runs_through_the_runner_and_leaves_nothing(fake_runner: ModelRunner) -> None:
    before = fake_runner.sampler.generator.get_state()
    fake_runner.sampler.generator.manual_seed(12345)
    assert fake_runner.run_profile_step() == 16 * fake_runner.bytes_per_block  # 8 requests x 8 tokens / 4
    assert fake_runner.input_batch.requests == {} and fake_runner.kv_caches == []
    assert not fake_runner.input_batch.block_table.num_blocks.any()
    assert torch.equal(fake_runner.sampler.generator.get_state(), before)


def test_the_profile_step_gives_drafts_to_requests_long_enough(fake_runner: ModelRunner) -> None:
    sched_out, _ = profile_step(max_num_batched_tokens=50, max_num_seqs=8, max_model_len=32, block_size=4, num_drafts=6)
    assert sched_out.spec_token_ids == {"profile-0": [0] * 6, "profile-1": [0] * 6}  # 7 tokens; the others have 6
    assert sched_out.total_num_scheduled_tokens == sum(sched_out.num_scheduled_tokens.values()) == 50
    assert [len(r.token_ids) for r in sched_out.new_reqs] == [1, 1, 6, 6, 6, 6, 6, 6]
    runner = ModelRunner(make_config("m", speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
                         rank=0, tp_size=1, device=CPU)
    runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
    assert runner.run_profile_step() == 16 * runner.bytes_per_block
    assert runner.input_batch.requests == {} and runner.kv_caches == []
