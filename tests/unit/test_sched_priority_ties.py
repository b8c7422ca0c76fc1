"""Priority preemption among equals: the samples of an ``n > 1`` request share their priority and arrival time.

The victim among equal `priority_key`s is the latest admitted (as under fcfs). Taking the first admitted (vLLM's
``max``) preempts the sample furthest along, which comes back last and is preempted again when its turn comes:
samples that cannot all fit the KV cache then take each other's blocks forever and none finishes.
"""

from __future__ import annotations

from asyncllm.config import EngineConfig
from asyncllm.sampling import SamplingParams
from asyncllm.sched.preemption import victim_index, victim_order
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler
from test_scheduler import run_step


def _samples(num: int, prompt: list[int], priority: int = 0) -> list[Request]:
    """One request's `num` samples as the host sends them: the same prompt, priority and arrival time."""
    return [Request(f"s-{k}", prompt, SamplingParams(max_tokens=None, ignore_eos=True, seed=k), [1], 5.0,
                    priority=priority) for k in range(num)]


def _own_token(req: Request) -> int:
    """Each sample writes its own tokens (as seeded samples do), so that no output block is shared."""
    return 100 * (int(req.request_id[-1]) + 1) + req.num_output_tokens % 50


def test_equal_keys_take_the_latest_admitted_first() -> None:
    a, b, c = _samples(3, [7, 8, 9])
    low = Request("low", [7], SamplingParams(), [1], 1.0, priority=3)
    assert victim_index([a, b, c], 0, "priority") == 2
    assert victim_index([a, low, b, c], 0, "priority") == 1
    assert victim_order([a, low, b, c]) == [low, c, b, a]


def test_samples_that_cannot_all_fit_finish_under_priority() -> None:
    """3 samples of a 31-token prompt growing to 64 tokens (16 blocks of 4 each, 8 of them shared) in 17 blocks:
    one at a time runs to the end, the others wait; with the first admitted as victim none ever finished."""
    config = EngineConfig.create("dummy-model", block_size=4, scheduling_policy="priority", max_num_batched_tokens=6,
                                 long_prefill_token_threshold=2)
    sched = Scheduler(config, 17, 64)
    samples = _samples(3, list(range(10, 41)))
    for sample in samples:
        sched.add_request(sample)
    finished = []
    for _ in range(600):
        if not sched.has_unfinished_requests():
            break
        _, deltas = run_step(sched, _own_token)
        finished += [d.request_id for d in deltas if d.finish_reason is not None]
    assert sorted(finished) == ["s-0", "s-1", "s-2"]
    assert all(len(s.output_token_ids) == 64 - 31 for s in samples)
    assert sched.kv_cache_manager.num_used_blocks == 0
