"""Scheduler preemption: which request is evicted, how it resumes, the rate-limited warning (exact values)."""

from __future__ import annotations

import logging

import pytest

from asyncllm import protocol
from asyncllm.sched.preemption import preempt_until_allocated
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.scheduler import PreemptionLogger, Scheduler, _Step
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


# ------------------------------------------------------------------ preemption for a higher-priority waiting request
def _priority_request(req_id: str, prompt: list[int] | int, priority: int, arrival: float, max_tokens: int = 40):
    req = make_request(req_id, prompt, max_tokens=max_tokens)
    req.priority, req.arrival_time = priority, arrival
    return req


def _step_summary(out) -> tuple[dict[str, int], list[str], list[str]]:
    return out.num_scheduled_tokens, out.preempted_req_ids, [n.req_id for n in out.new_reqs]


@pytest.mark.parametrize(("prompt", "preempted"), [(24, ["d", "c"]), (30, [])])
def test_priority_preempts_the_fewest_that_admit_the_waiting_request_or_none(prompt, preempted):
    """12 blocks of 4: a (priority 0) holds 5, b, c, d (priority 5) one each; e (priority 1) needs 6 blocks (d and c
    make room) or 8 (7 free with all three gone: preempting them would only make them recompute)."""
    sched = make_scheduler(num_gpu_blocks=12, enable_prefix_caching=False, scheduling_policy="priority")
    sched.add_request(_priority_request("a", 19, 0, 0.0))
    for i, req_id in enumerate("bcd"):
        sched.add_request(_priority_request(req_id, 2, 5, 1.0 + i))
    run_step(sched)
    sched.add_request(_priority_request("e", prompt, 1, 9.0))
    out, _ = run_step(sched)
    if preempted:
        assert _step_summary(out) == ({"a": 1, "b": 1, "e": prompt}, ["d", "c"], ["e"])
    else:
        assert _step_summary(out) == ({"a": 1, "b": 1, "c": 1, "d": 1}, [], [])
    assert sched.num_preemptions_total == len(preempted)


def test_priority_does_not_preempt_a_request_whose_blocks_are_shared():
    """b's first two blocks are a's prefix: preempting b would free one block, and c needs four of the two free."""
    sched = make_scheduler(num_gpu_blocks=6, scheduling_policy="priority")
    prefix = list(range(100, 108))
    sched.add_request(_priority_request("a", prefix + [1, 2, 3], 0, 0.0))
    run_step(sched)
    sched.add_request(_priority_request("b", prefix + [4, 5, 6], 5, 1.0))
    run_step(sched)
    assert (sched.requests["b"].num_cached_tokens, sched.kv_cache_manager.num_free_blocks) == (8, 2)
    sched.add_request(_priority_request("c", 16, 1, 2.0))
    out, _ = run_step(sched)
    assert _step_summary(out) == ({"a": 1, "b": 1}, [], [])
    assert sched.num_preemptions_total == 0


def test_priority_preempts_only_when_the_waiting_request_gets_tokens_in_the_step():
    """One seat left for c (priority 1) if b (priority 5) goes, but a's prefill (priority 0) takes what b's decode
    leaves of the budget of 8 (b was admitted first), and all of it with b gone, until its last chunk: b is
    preempted only in the step that admits c."""
    sched = make_scheduler(scheduling_policy="priority", max_num_seqs=2, max_num_batched_tokens=8,
                           enable_prefix_caching=False)
    sched.add_request(_priority_request("b", 3, 5, 0.0))
    run_step(sched)
    sched.add_request(_priority_request("a", 40, 0, 1.0))
    run_step(sched)  # a: 7 tokens, b: 1
    sched.add_request(_priority_request("c", 3, 1, 2.0))
    steps = [_step_summary(run_step(sched)[0]) for _ in range(5)]
    assert steps == [({"b": 1, "a": 7}, [], [])] * 4 + [({"a": 5, "c": 3}, ["b"], ["c"])]


def test_priority_preempts_the_requests_of_an_adapter_one_too_many_with_the_seat():
    """max_loras=1, three seats: x (priority 5, adapter 1) stays one adapter too many for h (priority 1, adapter 2)
    if only y (priority 5, base model) gives up its seat, so both go and h runs (y alone went, and came back, for
    nothing, step after step)."""
    from asyncllm.lora import LoRARequest

    def with_adapter(req: Request, lora_id: int) -> Request:
        lora = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
        return Request(req.request_id, req.prompt_token_ids, req.params, [2], req.arrival_time, priority=req.priority,
                       lora=lora)

    sched = make_scheduler(scheduling_policy="priority", max_num_seqs=3, enable_lora=True, max_loras=1)
    sched.add_request(_priority_request("a", 4, 0, 0.0))
    sched.add_request(with_adapter(_priority_request("x", 4, 5, 1.0), 1))
    sched.add_request(_priority_request("y", 4, 5, 2.0))
    run_step(sched)
    sched.add_request(with_adapter(_priority_request("h", 4, 1, 3.0), 2))
    steps = [_step_summary(run_step(sched)[0]) for _ in range(2)]
    assert steps == [({"a": 1, "h": 4}, ["y", "x"], ["h"]), ({"a": 1, "h": 1, "y": 1}, [], ["y"])]  # x waits for h


def _spec_step(sched: Scheduler):
    """One step whose model rejects every draft: token 7 for each request whose tokens (and drafts) it reaches."""
    out = sched.schedule()
    requests = sched.requests
    sampled = [[7] if requests[req_id].num_computed_tokens + num >= requests[req_id].num_tokens else []
               for req_id, num in out.num_scheduled_tokens.items()]
    sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, list(out.num_scheduled_tokens), sampled))
    return out.num_scheduled_tokens, out.spec_token_ids, out.preempted_req_ids


@pytest.mark.parametrize(("block_size", "num_gpu_blocks", "drafters", "steps"), [
    # 4 blocks of 4: b's next token needs the one free block, so a's drafts get none
    (4, 4, "a", [({"a": 2, "b": 8}, {"a": [7]}, []), ({"a": 1, "b": 1}, {}, [])]),
    # 8 of 2: b's next token takes one of the two free blocks, a's drafts the other; then none is free, and a
    # drafts only what its last block holds (one, not two)
    (2, 8, "a", [({"a": 2, "b": 8}, {"a": [7]}, []), ({"a": 3, "b": 1}, {"a": [7, 7]}, []),
                 ({"a": 2, "b": 1}, {"a": [7]}, [])]),
    # 6 of 4: a's drafts take the one block b's next token leaves, c's none
    (4, 6, "ac", [({"a": 2, "c": 2, "b": 8}, {"a": [7], "c": [7]}, []), ({"a": 3, "c": 1, "b": 1}, {"a": [7, 7]}, [])]),
])
def test_priority_drafts_take_only_the_blocks_the_others_next_tokens_leave(block_size, num_gpu_blocks, drafters,
                                                                           steps):
    """a (and c; priority 5, admitted first) draft n-grams of 7s: their drafts may not take a block b's (priority
    0) next token needs, after which b (served after them) would preempt itself while they run."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    sched = make_scheduler(num_gpu_blocks=num_gpu_blocks, block_size=block_size, enable_prefix_caching=False,
                           scheduling_policy="priority", speculative_config=spec)
    for i, req_id in enumerate(drafters):
        sched.add_request(_priority_request(req_id, [7, 7], 5, i / 2))
    _spec_step(sched)
    sched.add_request(_priority_request("b", 8, 0, 1.0))
    assert [_spec_step(sched) for _ in steps] == steps


def test_a_request_without_room_preempts_the_lowest_priority_from_itself_on():
    """The running list in admission order x, r, y, z (priority 5, 0, 3, 1), every block taken: r's next token
    takes y's block; x, served before r, is never the victim, nor z, the last one."""
    sched = make_scheduler(num_gpu_blocks=4, enable_prefix_caching=False, scheduling_policy="priority")
    requests = [_priority_request(req_id, 4, priority, float(i)) for i, (req_id, priority) in enumerate(
        (("x", 5), ("r", 0), ("y", 3), ("z", 1)))]
    for request in requests:
        sched.add_request(request)
    run_step(sched)
    sched.running = list(requests)
    step = _Step(64)
    assert preempt_until_allocated(sched, requests[1], 1, step) is not None
    assert (step.preempted_req_ids, [r.request_id for r in sched.running]) == (["y"], ["x", "r", "z"])


def test_priority_drafts_with_blocks_to_spare_skip_the_victim_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under priority with drafts, a step whose running requests' next chunks and every draft fit the free blocks
    plans nothing (the plan sorts and bisects the running list: every step otherwise) and leaves drafts unbounded."""
    from asyncllm.sched import schedule_waiting

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    sched = make_scheduler(num_gpu_blocks=64, block_size=4, enable_prefix_caching=False,
                           scheduling_policy="priority", speculative_config=spec)
    sched.add_request(_priority_request("a", [7, 7], 5, 0.0))
    monkeypatch.setattr(schedule_waiting, "_running_plan", lambda *_, **__: pytest.fail("planned"))
    assert [_spec_step(sched) for _ in range(4)][-1] == ({"a": 4}, {"a": [7, 7, 7]}, [])
