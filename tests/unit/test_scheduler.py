"""Scheduler: budgets, chunking, stop conditions, aborts, admission, queues (exact values; preemption:
test_scheduler_preemption.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import _encoder_config
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.sampling import SamplingParams
from asyncllm.sched.queue import FCFSRequestQueue, PriorityRequestQueue
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.scheduler import Scheduler

EOS = 2


def make_scheduler(num_gpu_blocks: int = 64, max_model_len: int = 256, **fields) -> Scheduler:
    fields.setdefault("block_size", 4)
    return Scheduler(EngineConfig.create("dummy-model", **fields), num_gpu_blocks, max_model_len)


def make_request(req_id: str, prompt: list[int] | int, client_id: bytes = b"host", eos: tuple[int, ...] = (EOS,),
                 **params) -> Request:
    start = 1000 * (ord(req_id[0]) - ord("a") + 1)  # distinct prompts per first letter: no accidental prefix hits
    tokens = list(range(start, start + prompt)) if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 16)
    return Request(req_id, tokens, SamplingParams(**params), list(eos), 0.0, client_id=client_id)


def make_pooling_request(req_id: str, prompt_len: int) -> Request:
    """An embedding request as `AsyncEngine.embed` sends it: one sampled token, dropped."""
    from asyncllm.pooling import PoolingParams

    return Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=1), [EOS], 0.0,
                   pooling=PoolingParams())


def run_step(
    sched: Scheduler, next_token: Callable[[Request], int] = lambda req: 7
) -> tuple[protocol.SchedulerOutput, list[protocol.RequestOutputDelta]]:
    """One schedule + fake model run + update: a token for each request whose tokens reach the end."""
    out = sched.schedule()
    req_ids, sampled = [], []
    for req_id, num in out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        req_ids.append(req_id)
        sampled.append([next_token(req)] if req.num_computed_tokens + num == req.num_tokens else [])
    deltas = sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, req_ids, sampled))
    return out, [delta for _, delta in deltas]


def scripted(tokens: list[int]) -> Callable[[Request], int]:
    """Sample `tokens` in order (by output position)."""
    return lambda req: tokens[req.num_output_tokens]


# ------------------------------------------------------------------ budgets and chunking
def test_a_long_prompt_is_chunked_under_a_small_budget():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", 70))
    steps = [run_step(sched) for _ in range(4)]
    assert [out.num_scheduled_tokens for out, _ in steps] == [{"a": 32}, {"a": 32}, {"a": 6}, {"a": 1}]
    assert [out.step_id for out, _ in steps] == [0, 1, 2, 3]
    first = steps[0][0]
    assert [(n.req_id, n.num_computed_tokens, n.block_ids) for n in first.new_reqs] == [("a", 0, list(range(8)))]
    assert steps[1][0].cached_reqs == protocol.CachedRequestData(["a"], [32], {"a": list(range(8, 16))})
    assert steps[2][0].cached_reqs == protocol.CachedRequestData(["a"], [64], {"a": [16, 17]})
    assert [d for _, d in steps[:2]] == [[], []]  # a prefill chunk samples nothing
    assert [d.new_token_ids for d in steps[2][1]] == [[7]]
    assert [d.new_token_ids for d in steps[3][1]] == [[7]]


def test_running_requests_go_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 10))
    run_step(sched)
    sched.add_request(make_request("b", 40))
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    assert out.total_num_scheduled_tokens == 16
    assert out.cached_reqs.req_ids == ["a"] and [n.req_id for n in out.new_reqs] == ["b"]
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]


def test_long_prefill_token_threshold_caps_each_chunk():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 3))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 8, "b": 3}
    assert [run_step(sched)[0].num_scheduled_tokens for _ in range(2)] == [{"a": 8, "b": 1}, {"a": 4, "b": 1}]


def test_long_prefill_token_threshold_caps_chunks_without_chunked_prefill():
    """As vLLM's V1 scheduler: the threshold applies whatever enable_chunked_prefill says."""
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 20))
    assert [run_step(sched)[0].num_scheduled_tokens for _ in range(4)] == [{"a": 8}, {"a": 8}, {"a": 4}, {"a": 1}]
    with pytest.raises(ConfigError, match="long_prefill_token_threshold=8 .*encoder model"):  # its prompts run whole
        _encoder_config(EngineConfig.create("m", long_prefill_token_threshold=8, max_model_len=64))


def test_a_prompt_longer_than_a_step_runs_in_threshold_chunks_without_chunked_prefill():
    """Admitted, not refused: the threshold's chunks fit a step (a threshold above the step refuses it still)."""
    sched = make_scheduler(max_num_batched_tokens=12, long_prefill_token_threshold=4, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 13))
    assert [run_step(sched)[0].num_scheduled_tokens for _ in range(4)] == [{"a": 4}, {"a": 4}, {"a": 4}, {"a": 1}]
    sched = make_scheduler(max_num_batched_tokens=12, long_prefill_token_threshold=13, enable_chunked_prefill=False)
    with pytest.raises(InvalidRequestError, match="exceed max_num_batched_tokens=12"):
        sched.add_request(make_request("a", 13))


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for req_id in "abc":
        sched.add_request(make_request(req_id, 5, max_tokens=2))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 5, "b": 5}
    assert [r.request_id for r in sched.waiting] == ["c"]
    out, deltas = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [d.finish_reason for d in deltas] == ["length", "length"]
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"c": 5}
    assert out.finished_req_ids == ["a", "b"]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 10}
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}


def test_prefix_hits_are_reported_on_the_first_delta_and_in_stats():
    sched = make_scheduler()
    prompt = list(range(50, 60))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("b", prompt, max_tokens=2))
    out, deltas = run_step(sched)
    assert [(n.req_id, n.num_computed_tokens) for n in out.new_reqs] == [("b", 8)]
    assert out.num_scheduled_tokens == {"b": 2}
    assert [(d.request_id, d.num_cached_tokens) for d in deltas] == [("b", 8)]
    _, deltas = run_step(sched)
    assert [(d.num_cached_tokens, d.finish_reason) for d in deltas] == [(0, "length")]
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert (stats.prompt_tokens_total, stats.generation_tokens_total, stats.num_steps_total) == (12, 3, 3)
    assert (stats.num_requests_running, stats.num_requests_waiting, stats.num_used_blocks) == (0, 0, 0)


# ------------------------------------------------------------------ stop conditions
def _generate(sched: Scheduler, req: Request, tokens: list[int]) -> protocol.RequestOutputDelta:
    sched.add_request(req)
    deltas = []
    while sched.has_unfinished_requests():
        deltas += run_step(sched, scripted(tokens))[1]
    return deltas[-1]


@pytest.mark.parametrize(
    ("params", "tokens", "outputs", "finish", "stop_reason"),
    [
        ({}, [5, EOS, 5], [5, EOS], "stop", None),
        ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 5, 5], [5, EOS, 5], "length", None),
        ({"stop_token_ids": [9]}, [5, 9, 5], [5, 9], "stop", 9),
        ({"stop_token_ids": [EOS]}, [5, EOS, 5], [5, EOS], "stop", None),  # EOS is checked first, as vLLM
        # generation_config.json's EOS ids past the tokenizer's are stop_token_ids unless ignore_eos (vLLM's)
        ({"eos": (EOS, 7)}, [5, 7, 5], [5, 7], "stop", 7),
        ({"eos": (EOS, 7), "ignore_eos": True, "max_tokens": 3}, [7, EOS, 7, 5], [7, EOS, 7], "length", None),
        ({"eos": (EOS, 7), "ignore_eos": True, "stop_token_ids": [EOS]}, [7, EOS, 5], [7, EOS], "stop", EOS),
        ({"min_tokens": 3}, [EOS, 9, EOS, 5], [EOS, 9, EOS], "stop", None),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9, 5], [9, 9], "stop", 9),
        ({"max_tokens": 2}, [5, 5, 5], [5, 5], "length", None),
        ({"max_tokens": 2}, [5, EOS], [5, EOS], "stop", None),
        ({"max_tokens": None}, [5] * 20, [5] * 6, "length", None),
    ],
)
def test_stop_conditions(params, tokens, outputs, finish, stop_reason):
    sched = make_scheduler(max_model_len=10)
    req = make_request("a", 4, **params)
    last = _generate(sched, req, tokens)
    assert req.output_token_ids == outputs
    assert (last.finish_reason, last.stop_reason, req.finish_reason, req.stop_reason) == (
        finish, stop_reason, finish, stop_reason
    )
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_max_model_len_ends_a_request_with_length():
    sched = make_scheduler(max_model_len=8)
    req = make_request("a", 5, max_tokens=100)
    assert _generate(sched, req, [5] * 10).finish_reason == "length"
    assert req.num_tokens == 8 and req.status is RequestStatus.FINISHED_LENGTH


def test_a_kv_cache_smaller_than_max_model_len_caps_the_sequence():
    sched = make_scheduler(num_gpu_blocks=2, max_model_len=100)
    req = make_request("a", 5, max_tokens=100)
    assert _generate(sched, req, [5] * 10).finish_reason == "length"
    assert req.num_tokens == 8


# ------------------------------------------------------------------ aborts
def test_abort_frees_blocks_and_reports_finished_ids_once():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 12))
    sched.add_request(make_request("c", 4))
    run_step(sched)  # a runs, b prefills 2 of 12, c waits
    assert sched.kv_cache_manager.num_used_blocks == 3
    aborted = sched.abort_requests(["b", "c", "unknown"])
    assert [(r.request_id, r.status, r.finish_reason) for r in aborted] == [
        ("b", RequestStatus.FINISHED_ABORTED, "abort"), ("c", RequestStatus.FINISHED_ABORTED, "abort")
    ]
    assert sched.kv_cache_manager.num_used_blocks == 2
    out, _ = run_step(sched)
    assert out.finished_req_ids == ["b", "c"] and out.num_scheduled_tokens == {"a": 1}
    assert sched.abort_requests(["a"])[0].request_id == "a"
    assert sched.kv_cache_manager.num_used_blocks == 0
    out = sched.schedule()
    assert out.finished_req_ids == ["a"] and out.total_num_scheduled_tokens == 0
    assert sched.schedule().finished_req_ids == []
    assert not sched.has_unfinished_requests()


def test_a_request_aborted_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4))
    out = sched.schedule()
    sched.abort_requests(["a"])
    runner = protocol.ModelRunnerOutput(out.step_id, ["a", "b"], [[7], [8]])
    deltas = sched.update_from_output(out, runner)
    assert [(c, d.request_id, d.new_token_ids) for c, d in deltas] == [(b"host", "b", [8])]
    assert sched.kv_cache_manager.num_used_blocks == 1


def test_abort_client_aborts_only_that_hosts_requests():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, client_id=b"h1"))
    sched.add_request(make_request("b", 4, client_id=b"h2"))
    sched.add_request(make_request("c", 4, client_id=b"h1"))
    run_step(sched)
    assert sorted(r.request_id for r in sched.abort_client(b"h1")) == ["a", "c"]
    assert list(sched.requests) == ["b"] and [r.request_id for r in sched.running] == ["b"]


# ------------------------------------------------------------------ admission checks
@pytest.mark.parametrize(
    ("fields", "num_gpu_blocks", "prompt_len", "needle"),
    [
        ({}, 64, 16, "max_model_len=16"),
        ({}, 2, 8, "KV cache"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8}, 64, 9, "enable_chunked_prefill"),
        ({}, 64, 0, "empty"),
    ],
)
def test_add_request_refuses_prompts_that_could_never_run(fields, num_gpu_blocks, prompt_len, needle):
    sched = make_scheduler(num_gpu_blocks=num_gpu_blocks, max_model_len=16, **fields)
    with pytest.raises(InvalidRequestError, match=needle) as info:
        sched.add_request(make_request("a", prompt_len))
    assert info.value.field == "prompt"
    sched.add_request(make_request("ok", 7))  # one token shorter always fits


def test_a_prompt_past_the_kv_cache_names_what_sized_it():
    config = EngineConfig.create("dummy-model", block_size=4)
    sched = Scheduler(config, 2, 16, kv_budget_field="ASYNCLLM_CPU_KVCACHE_SPACE_GB")
    with pytest.raises(InvalidRequestError, match="raise ASYNCLLM_CPU_KVCACHE_SPACE_GB / kv_cache_memory_bytes / "
                                                  "num_gpu_blocks_override or tensor_parallel_size") as info:
        sched.add_request(make_request("a", 8))
    assert "gpu_memory_utilization" not in str(info.value)


def test_add_request_refuses_a_request_id_in_use():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(InvalidRequestError) as info:
        sched.add_request(make_request("a", 4))
    assert info.value.field == "request_id"


def test_a_priority_is_refused_unless_the_policy_is_priority():
    request = make_request("a", 4)
    request.priority = 1
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'") as info:
        make_scheduler().add_request(request)
    assert info.value.field == "priority"
    make_scheduler(scheduling_policy="priority").add_request(request)
    make_scheduler().add_request(make_request("b", 4))  # priority 0: any policy


def test_from_add_request_copies_the_message():
    msg = protocol.AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=4), [2, 3], 12.5, priority=3)
    req = Request.from_add_request(msg, b"client")
    assert (req.request_id, req.prompt_token_ids, req.num_prompt_tokens, req.eos_token_ids) == ("r", [1, 2, 3], 3, [2, 3])
    assert (req.arrival_time, req.priority, req.client_id, req.status) == (12.5, 3, b"client", RequestStatus.WAITING)
    assert (req.params.max_tokens, req.cache_salt, req.all_token_ids) == (4, None, [1, 2, 3])


# ------------------------------------------------------------------ queues
def test_fcfs_queue_puts_preempted_requests_first():
    queue = FCFSRequestQueue()
    a, b, c = (make_request(x, 1) for x in "abc")
    queue.add(a)
    queue.add(b)
    queue.add_preempted(c)
    assert [r.request_id for r in queue] == ["c", "a", "b"]
    queue.remove_requests({"a"})
    assert (queue.pop().request_id, queue.peek().request_id, len(queue)) == ("c", "b", 1)


def test_priority_queue_orders_by_priority_then_arrival():
    queue = PriorityRequestQueue()
    reqs = [Request(name, [1], SamplingParams(), [], arrival, priority=prio)
            for name, arrival, prio in (("a", 1.0, 5), ("b", 2.0, 0), ("c", 0.5, 5), ("d", 3.0, 0))]
    for req in reqs:
        queue.add(req)
    assert [r.request_id for r in queue] == ["b", "d", "c", "a"]
    queue.remove_requests({"d"})
    assert [queue.pop().request_id for _ in range(3)] == ["b", "c", "a"]
    assert not queue


def test_reset_prefix_cache_unhashes_free_and_held_blocks():
    sched = make_scheduler()
    prompt = list(range(100, 109))  # 9 tokens: 2 full blocks of 4
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_step(sched)  # a finishes: its 2 full blocks stay cached, free
    sched.add_request(make_request("b", prompt, max_tokens=8))
    run_step(sched)
    assert sched.kv_cache_manager.prefix_cache_hits == 8
    pool = sched.kv_cache_manager.pool
    held = list(sched.kv_cache_manager.req_to_blocks["b"])
    sched.reset_prefix_cache()
    assert all(block.block_hash is None for block in pool.blocks) and sched.kv_cache_manager.num_used_blocks == len(held)
    while sched.has_unfinished_requests():
        run_step(sched)  # b goes on with its blocks; blocks it fills now are cached again
    sched.add_request(make_request("c", prompt, max_tokens=1))
    run_step(sched)
    assert sched.kv_cache_manager.prefix_cache_hits == 8  # nothing of before the reset was hit


def test_a_failed_request_takes_the_requests_that_hit_its_uncomputed_blocks_with_it():
    """Two samples of one prompt admitted in one step: the second hits the blocks the first registered when it was
    scheduled. The workers fail the first (its KV there is not right): the second, which reads those blocks, ends
    with the same error; a request of another prompt runs on, and the blocks leave the prefix cache."""
    sched = make_scheduler(enable_prefix_caching=True)
    prompt = list(range(100, 124))
    for req_id in ("a", "a2"):
        sched.add_request(make_request(req_id, prompt))
    sched.add_request(make_request("b", 24))
    out = sched.schedule()
    assert out.num_scheduled_tokens["a2"] < 24  # its full blocks came from a's as prefix hits
    deltas = sched.fail_requests({"a": "mm_items[0]: laid wrong"})
    assert sorted((d.request_id, d.error) for _, d in deltas) == [("a", "mm_items[0]: laid wrong"),
                                                                  ("a2", "mm_items[0]: laid wrong")]
    assert list(sched.requests) == ["b"]
    sched.add_request(make_request("a3", prompt))
    assert sched.schedule().num_scheduled_tokens["a3"] == 24  # nothing of a's is cached any more
