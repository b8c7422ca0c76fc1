"""The n samples of one prompt share its KV blocks when admitted in the same step (docs/scheduling.md).

A block is registered in the prefix cache when the step that fills it is
scheduled, so a request admitted later in that step hits it; a request freed
before its scheduled tokens were applied takes its registrations back.
Exact block ids and reference counts, no model.
"""

from __future__ import annotations

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler

PROMPT = list(range(1000, 1600))  # 600 tokens: 37 full blocks of 16, then 8 tokens
NUM_FULL = 37


def _scheduler(enable_prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig.create("dummy-model", block_size=16, max_num_batched_tokens=4096,
                                 enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, num_gpu_blocks=200, max_model_len=1024)


def _add_samples(sched: Scheduler, n: int, prompt: list[int] = PROMPT, prefix: str = "p") -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(n)]
    for req_id in ids:
        sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=4), [2], 0.0))
    return ids


def _ref_cnts(sched: Scheduler, block_ids: list[int]) -> list[int]:
    return [sched.kv_cache_manager.pool.blocks[b].ref_cnt for b in block_ids]


def _apply(sched: Scheduler, out: protocol.SchedulerOutput) -> list[protocol.RequestOutputDelta]:
    """A fake model run: token 7 for every request whose scheduled tokens reach its end (aborted ones too)."""
    def samples(req_id: str, num: int) -> bool:
        req = sched.requests.get(req_id)
        return req is None or req.num_computed_tokens + num == req.num_tokens

    sampled = [[7] if samples(r, n) else [] for r, n in out.num_scheduled_tokens.items()]
    runner_out = protocol.ModelRunnerOutput(out.step_id, list(out.num_scheduled_tokens), sampled)
    return [delta for _, delta in sched.update_from_output(out, runner_out)]


def test_four_samples_admitted_together_allocate_the_prompt_blocks_once():
    sched = _scheduler()
    ids = _add_samples(sched, 4)
    out = sched.schedule()
    first, *others = out.new_reqs
    assert (first.req_id, first.num_computed_tokens, first.block_ids) == ("p-0", 0, list(range(38)))
    for i, new in enumerate(others, start=1):  # the 37 full blocks shared, the partial last one each its own
        assert (new.req_id, new.num_computed_tokens, new.block_ids) == (f"p-{i}", 592, list(range(37)) + [37 + i])
    assert out.num_scheduled_tokens == {"p-0": 600, "p-1": 8, "p-2": 8, "p-3": 8}
    assert out.total_num_scheduled_tokens == 624
    assert _ref_cnts(sched, list(range(41))) == [4] * NUM_FULL + [1, 1, 1, 1]
    kv = sched.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (4 * 600, 3 * 592)
    assert kv.num_used_blocks == 41

    deltas = _apply(sched, out)
    assert [(d.request_id, d.new_token_ids, d.num_cached_tokens) for d in deltas] == [
        ("p-0", [7], 0), ("p-1", [7], 592), ("p-2", [7], 592), ("p-3", [7], 592)]
    stats = sched.get_stats()
    assert stats.prompt_tokens_total == 624  # the prompt was computed once, plus 3 x 8 tokens
    assert stats.generation_tokens_total == 4
    assert [sched.requests[r].num_computed_tokens for r in ids] == [600] * 4


def test_without_prefix_caching_every_sample_computes_the_prompt():
    sched = _scheduler(enable_prefix_caching=False)
    _add_samples(sched, 4)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {f"p-{i}": 600 for i in range(4)}
    assert sched.kv_cache_manager.num_used_blocks == 4 * 38


def test_a_later_request_hits_blocks_registered_by_the_step_before():
    sched = _scheduler()
    _add_samples(sched, 1)
    _apply(sched, sched.schedule())
    _add_samples(sched, 1, prefix="q")
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"p-0": 1, "q-0": 8}
    assert out.new_reqs[0].block_ids[:NUM_FULL] == list(range(NUM_FULL))


def test_a_request_aborted_before_its_step_ran_takes_its_registrations_back():
    sched = _scheduler()
    _add_samples(sched, 2)
    out = sched.schedule()  # p-0 computes the prompt, p-1 hits its 37 blocks in the same step
    sched.abort_requests(["p-0"])  # before update_from_output: the core never learns that the step ran
    pool = sched.kv_cache_manager.pool
    assert _ref_cnts(sched, list(range(NUM_FULL))) == [1] * NUM_FULL  # p-1 still holds them
    assert pool.num_cached_blocks == 0  # but nothing may hit them any more
    deltas = _apply(sched, out)
    assert [d.request_id for d in deltas] == ["p-1"]
    _add_samples(sched, 1, prefix="q")
    assert sched.schedule().num_scheduled_tokens == {"p-1": 1, "q-0": 600}  # no hit: the prompt is computed again


def test_blocks_of_requests_aborted_before_their_step_are_never_handed_out_as_hits():
    sched = _scheduler()
    _add_samples(sched, 4)
    sched.schedule()
    sched.abort_requests([f"p-{i}" for i in range(4)])
    kv = sched.kv_cache_manager
    assert (kv.num_used_blocks, kv.pool.num_cached_blocks) == (0, 0)
    _add_samples(sched, 1, prefix="q")
    hits_before = kv.prefix_cache_hits
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"q-0": 600} and kv.prefix_cache_hits == hits_before


def test_a_decode_registers_the_block_it_fills_when_scheduled():
    sched = _scheduler()
    prompt = list(range(2000, 2015))  # 15 tokens: the first decode step fills block 0
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=4), [2], 0.0))
    _apply(sched, sched.schedule())
    pool = sched.kv_cache_manager.pool
    assert pool.num_cached_blocks == 0
    out = sched.schedule()  # computes token 15 (the sampled 7): block 0 is full once this step runs
    assert out.num_scheduled_tokens == {"a": 1}
    assert pool.num_cached_blocks == 1 and pool.blocks[0].token_ids == (*prompt, 7)
    sched.add_request(Request("b", [*prompt, 7, 9], SamplingParams(max_tokens=4), [2], 0.0))
    out_b = sched.schedule()
    assert out_b.new_reqs[0].num_computed_tokens == 16  # hit before "a"'s step was even applied
