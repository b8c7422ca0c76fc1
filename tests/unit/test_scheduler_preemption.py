"""Scheduler preemption: which request is evicted, how it resumes, the rate-limited warning (exact values)."""

from __future__ import annotations

import logging

from asyncllm.sched.request import RequestStatus
from asyncllm.sched.scheduler import PreemptionLogger, Scheduler
from test_scheduler import make_request, make_scheduler, run_step


def _preemption_scenario(caplog) -> tuple[Scheduler, list]:
    """4 blocks of 4 tokens; a and b (6-token prompts) fill them; a's 9th token needs b's blocks."""
    sched = make_scheduler(num_gpu_blocks=4, max_model_len=16, enable_prefix_caching=False)
    sched.add_request(make_request("a", 6, max_tokens=10))
    sched.add_request(make_request("b", 6, max_tokens=4))
    with caplog.at_level(logging.WARNING, logger="asyncllm.sched"):
        steps = [run_step(sched) for _ in range(4)]
    return sched, steps


def test_preemption_evicts_the_latest_admitted_request(caplog):
    sched, steps = _preemption_scenario(caplog)
    out, _ = steps[3]
    assert out.preempted_req_ids == ["b"]
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_reqs.new_block_ids == {"a": [2]}
    b = sched.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == [7, 7, 7]
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert sched.get_stats().num_preemptions_total == 1
    assert sched.kv_cache_manager.get_block_ids("a") == [0, 1, 2]
    [record] = caplog.records
    assert record.name == "asyncllm.sched"
    message = record.getMessage()
    for part in ("Request b", "mode=recompute", "1 preemptions so far", "gpu_memory_utilization",
                 "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens"):
        assert part in message


def test_a_preempted_request_resumes_as_a_new_request_with_its_outputs(caplog):
    sched, _ = _preemption_scenario(caplog)
    b = sched.requests["b"]
    assert b.output_token_ids == [7, 7, 7]
    steps = []
    while not any(n.req_id == "b" for out, _ in steps for n in out.new_reqs):
        steps.append(run_step(sched))
    out, _ = steps[-1]
    [new] = out.new_reqs
    assert new.token_ids == list(range(2000, 2006)) + [7, 7, 7]
    assert (new.num_prompt_tokens, new.num_computed_tokens) == (6, 0)
    assert out.num_scheduled_tokens["b"] == 9
    assert "b" not in sched.requests  # its 4th token, sampled after the recompute, was the last


def test_resumed_requests_keep_generating_after_recompute():
    sched = make_scheduler(num_gpu_blocks=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", 6, max_tokens=6))
    sched.add_request(make_request("b", 6, max_tokens=6))
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    preempted = []
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        out, deltas = run_step(sched, next_token=lambda req: req.num_tokens)
        preempted += out.preempted_req_ids
        for d in deltas:
            outputs[d.request_id] += d.new_token_ids
    assert preempted == ["b"]
    assert outputs == {"a": [6, 7, 8, 9, 10, 11], "b": [6, 7, 8, 9, 10, 11]}
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_the_request_needing_a_block_can_be_the_victim_and_waits():
    sched = make_scheduler(num_gpu_blocks=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", 6, max_tokens=16))
    sched.add_request(make_request("b", 8, max_tokens=16))
    run_step(sched)  # a and b hold 2 blocks each
    out, _ = run_step(sched)  # a's 7th token fits its blocks; b's 9th needs a third block
    assert out.preempted_req_ids == ["b"] and out.num_scheduled_tokens == {"a": 1}
    assert sched.requests["b"].num_preemptions == 1
    assert [r.request_id for r in sched.running] == ["a"]


def test_two_preemptions_in_one_step_log_one_warning(caplog):
    sched = make_scheduler(num_gpu_blocks=3, max_model_len=12, enable_prefix_caching=False)
    for req_id in "abc":
        sched.add_request(make_request(req_id, 4))
    run_step(sched)  # one block each, all full
    with caplog.at_level(logging.WARNING, logger="asyncllm.sched"):
        out, _ = run_step(sched)  # a takes c's block; b finds none and preempts itself
    assert out.preempted_req_ids == ["c", "b"] and out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.num_preemptions_total == 2
    assert [r.getMessage().split(" was")[0] for r in caplog.records] == ["Request c"]


def test_priority_policy_preempts_the_lowest_priority_request_first():
    sched = make_scheduler(num_gpu_blocks=3, max_model_len=12, enable_prefix_caching=False, scheduling_policy="priority")
    for req_id, priority in (("a", 0), ("b", 5), ("c", 1)):
        req = make_request(req_id, 4)
        req.priority = priority
        sched.add_request(req)
    run_step(sched)
    out, _ = run_step(sched)  # a needs a block: b (priority 5) goes; then c needs one and is the only candidate
    assert out.preempted_req_ids == ["b", "c"] and out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["c", "b"]


def test_without_chunked_prefill_a_resumed_request_longer_than_a_step_is_chunked():
    sched = make_scheduler(
        num_gpu_blocks=5, max_model_len=20, max_num_batched_tokens=8,
        enable_chunked_prefill=False, enable_prefix_caching=False,
    )
    sched.add_request(make_request("a", 4, max_tokens=7))
    sched.add_request(make_request("b", 4, max_tokens=10))
    steps = [run_step(sched)[0] for _ in range(8)]
    assert [out.num_scheduled_tokens for out in steps[4:]] == [
        {"a": 1, "b": 1}, {"a": 1}, {"a": 1, "b": 7}, {"b": 2}
    ]
    assert steps[5].preempted_req_ids == ["b"]
    assert [(n.req_id, len(n.token_ids)) for n in steps[6].new_reqs] == [("b", 9)]


def test_preemption_warnings_are_rate_limited(caplog):
    now = [0.0]
    log = PreemptionLogger(interval_s=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="asyncllm.sched"):
        for t, total in ((0.0, 1), (1.0, 2), (4.9, 3), (6.0, 4)):
            now[0] = t
            log.record(f"r{total}", "recompute", total)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "Request r1" in messages[0] and "not logged" not in messages[0]
    assert "Request r4" in messages[1] and "4 preemptions so far (2 more not logged)" in messages[1]
