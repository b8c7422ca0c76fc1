"""Priority scheduling, admission control (queue limits; the prompts that fit) and per-request timeouts (exact
values)."""

from __future__ import annotations

import pytest

from asyncllm.config import EngineConfig
from asyncllm.errors import EngineOverloadedError, InvalidRequestError
from asyncllm.sched.deadlines import DeadlineHeap
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.scheduler import Scheduler
from test_scheduler import make_pooling_request, make_request, run_step


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(num_gpu_blocks: int = 16, max_model_len: int = 64, clock: Clock | None = None, num_cpu_blocks: int = 0,
              **fields) -> Scheduler:
    config = EngineConfig.create("dummy-model", block_size=4, **fields)
    return Scheduler(config, num_gpu_blocks, max_model_len, num_cpu_blocks=num_cpu_blocks, clock=clock or Clock())


def request(req_id: str, prompt: int, priority: int = 0, arrival: float = 0.0, **params) -> Request:
    req = make_request(req_id, prompt, **params)
    req.priority, req.arrival_time = priority, arrival
    return req


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# ------------------------------------------------------------------ priority
def test_a_higher_priority_arrival_takes_the_seat_of_a_lower_priority_request():
    sched = scheduler(scheduling_policy="priority", max_num_seqs=1)
    sched.add_request(request("a", 5, priority=5, max_tokens=3))
    run_step(sched)
    sched.add_request(request("b", 6, priority=0, arrival=1.0, max_tokens=2))
    out, _ = run_step(sched)
    assert out.preempted_req_ids == ["a"] and out.num_scheduled_tokens == {"b": 6}
    assert (ids(sched.running), ids(sched.waiting)) == (["b"], ["a"])
    assert sched.num_preemptions_total == 1
    run_step(sched)  # b finishes; a comes back (its first block is a prefix hit)
    out, _ = run_step(sched)
    assert [(n.req_id, n.num_computed_tokens) for n in out.new_reqs] == [("a", 4)]


def test_a_higher_priority_arrival_swaps_out_a_request_holding_the_blocks_it_needs():
    sched = scheduler(num_gpu_blocks=4, max_model_len=16, num_cpu_blocks=8, scheduling_policy="priority",
                      preemption_mode="swap", enable_prefix_caching=False)
    sched.add_request(request("a", 10, priority=5, max_tokens=3))
    run_step(sched)  # a holds 3 of the 4 blocks
    sched.add_request(request("b", 7, priority=0, arrival=1.0, max_tokens=2))
    out, _ = run_step(sched)
    assert out.preempted_req_ids == ["a"] and out.blocks_to_swap_out == [[0, 0], [1, 1], [2, 2]]
    assert [(n.req_id, n.block_ids) for n in out.new_reqs] == [("b", [0, 1])]  # copied out before the forward
    run_step(sched)  # b finishes
    out, _ = run_step(sched)
    assert out.blocks_to_swap_in == [[0, 0], [1, 1], [2, 2]]
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.new_reqs] == [("a", [0, 1, 2], 10)]


@pytest.mark.parametrize("waiting_priority", [5, 6])
def test_equal_or_lower_priority_arrivals_wait(waiting_priority):
    sched = scheduler(scheduling_policy="priority", max_num_seqs=1)
    sched.add_request(request("a", 5, priority=5, max_tokens=3))
    run_step(sched)
    sched.add_request(request("b", 6, priority=waiting_priority, arrival=1.0))
    out, _ = run_step(sched)
    assert out.preempted_req_ids == [] and out.num_scheduled_tokens == {"a": 1}


def test_fcfs_refuses_priorities_and_never_preempts_for_a_waiting_request():
    sched = scheduler(max_num_seqs=1)
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'"):
        sched.add_request(request("x", 5, priority=5))
    sched.add_request(request("a", 5, max_tokens=3))
    run_step(sched)
    sched.add_request(request("b", 6, arrival=1.0))
    assert run_step(sched)[0].preempted_req_ids == []


def test_priority_running_requests_keep_admission_order_under_the_budget():
    """As vLLM V1: the running requests are served in admission order, so the decodes of b and a (priority 1, 2)
    keep their tokens ahead of c's prefill (priority 0, admitted after them), which gets the rest of the budget."""
    sched = scheduler(scheduling_policy="priority", max_num_batched_tokens=11)
    sched.add_request(request("a", 4, priority=2, arrival=0.0))
    sched.add_request(request("b", 4, priority=1, arrival=1.0))
    run_step(sched)
    sched.add_request(request("c", 20, priority=0, arrival=2.0))
    sched.add_request(request("d", 20, priority=1, arrival=0.5))
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("b", 1), ("a", 1), ("c", 9)]
    assert ids(sched.running) == ["b", "a", "c"]
    steps = [list(run_step(sched)[0].num_scheduled_tokens.items()) for _ in range(2)]
    assert steps == [[("b", 1), ("a", 1), ("c", 9)], [("b", 1), ("a", 1), ("c", 2), ("d", 7)]]
    assert ids(sched.running) == ["b", "a", "c", "d"]


def test_priority_preempts_the_lowest_priority_running_request_wherever_it_was_admitted():
    """b (priority 5) was admitted before a (priority 0): when a's decode needs a block and none is free, b is the
    victim (vLLM's max over (priority, arrival)), not a, which comes after it in the running list."""
    sched = scheduler(num_gpu_blocks=4, max_model_len=16, scheduling_policy="priority", enable_prefix_caching=False)
    sched.add_request(request("b", 4, priority=5, max_tokens=8))
    run_step(sched)
    sched.add_request(request("a", 8, priority=0, arrival=1.0, max_tokens=8))
    out, _ = run_step(sched)
    assert (out.num_scheduled_tokens, ids(sched.running)) == ({"b": 1, "a": 8}, ["b", "a"])
    out, _ = run_step(sched)  # b's decode fits its block; a's starts a new one, and the 4 blocks are taken
    assert (out.num_scheduled_tokens, out.preempted_req_ids, ids(sched.running)) == ({"a": 1}, ["b"], ["a"])


def test_priority_admits_nobody_in_a_step_that_preempted_for_blocks():
    """As vLLM V1: 6 blocks of 4, a (priority 0) holds 4, b (priority 5) 2; a's decode needs a block and none is
    free, so b goes, and c (priority 3) waits a step although its prompt fits the block b's preemption left."""
    sched = scheduler(num_gpu_blocks=6, max_model_len=32, scheduling_policy="priority", enable_prefix_caching=False)
    sched.add_request(request("b", 7, priority=5, max_tokens=10))
    sched.add_request(request("a", 16, priority=0, arrival=1.0, max_tokens=10))
    run_step(sched)
    assert (ids(sched.running), sched.kv_cache_manager.num_free_blocks) == (["a", "b"], 0)
    sched.add_request(request("c", 1, priority=3, arrival=2.0, max_tokens=2))
    out, _ = run_step(sched)
    assert (out.num_scheduled_tokens, out.preempted_req_ids, out.new_reqs) == ({"a": 1}, ["b"], [])
    assert sched.kv_cache_manager.num_free_blocks == 1
    out, _ = run_step(sched)
    assert (out.num_scheduled_tokens, ids(sched.running)) == ({"a": 1, "c": 1}, ["a", "c"])


# ------------------------------------------------------------------ admission control
def test_max_num_queued_requests_refuses_while_the_queue_is_full():
    sched = scheduler(max_num_queued_requests=2, max_num_seqs=1)
    sched.add_request(request("a", 4))
    sched.add_request(request("b", 4))
    with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=2: 2 requests are already waiting"):
        sched.add_request(request("c", 4))
    assert ids(sched.waiting) == ["a", "b"] and "c" not in sched.requests
    run_step(sched)  # a runs: one seat left in the queue
    sched.add_request(request("c", 4))
    assert ids(sched.waiting) == ["b", "c"]


def test_max_num_queued_tokens_counts_waiting_prompts():
    sched = scheduler(max_num_queued_tokens=10, max_num_seqs=1)
    sched.add_request(request("a", 30))  # an empty queue accepts any prompt
    run_step(sched)
    sched.add_request(request("b", 6))
    with pytest.raises(EngineOverloadedError, match="max_num_queued_tokens=10: 6 tokens are already waiting"):
        sched.add_request(request("c", 5))
    sched.add_request(request("d", 4))
    assert (ids(sched.waiting), sched.waiting.num_tokens, sched.get_stats().num_waiting_tokens) == (["b", "d"], 10, 10)


def _samples(req_id: str, n: int, prompt: int = 4) -> list[Request]:
    """An n > 1 request's core requests as the host sends them: sample 0 counts for all n, the others for none."""
    samples = [request(f"{req_id}-{i}", prompt) for i in range(n)]
    for i, sample in enumerate(samples):
        sample.num_samples = 0 if i else n
    return samples


def test_an_n_request_is_checked_once_for_its_samples_and_an_empty_queue_takes_any_n():
    sched = scheduler(max_num_queued_requests=3, max_num_queued_tokens=10, max_num_seqs=4)
    for sample in _samples("a", 4):  # n=4 > max_num_queued_requests, 16 tokens > max_num_queued_tokens: queue empty
        sched.add_request(sample)
    assert len(sched.waiting) == 4
    run_step(sched)  # all 4 run
    sched.add_request(request("b", 2))
    with pytest.raises(EngineOverloadedError, match="1 requests are already waiting and this request has n=3 sampl"):
        sched.add_request(_samples("c", 3, prompt=2)[0])
    for sample in _samples("d", 2, prompt=2):  # 1 + 2 waiting, 2 + 4 tokens: within both limits
        sched.add_request(sample)
    assert ids(sched.waiting) == ["b", "d-0", "d-1"]


# ------------------------------------------------------------------ timeouts
def test_deadline_heap_skips_finished_requests():
    heap = DeadlineHeap()
    a, b, c = (request(x, 2) for x in "abc")
    heap.add(b, 5.0, 3)
    heap.add(a, 3.0, 3)
    heap.add(c, 4.0, 3)
    c.finish(RequestStatus.FINISHED_STOPPED)
    assert heap.pop_expired(2.9) == [] and heap.next_deadline() == 3.0
    assert ids(heap.pop_expired(4.5)) == ["a"] and len(heap) == 1
    assert ids(heap.pop_expired(10.0)) == ["b"] and not heap


def test_finished_requests_leave_the_deadline_heap_before_their_deadline():
    heap, live = DeadlineHeap(), request("live", 2)
    heap.add(live, 3600.0, 1)
    for i in range(1000):  # each finishes long before its hour is up, as requests under a generous timeout do
        done = request(f"r{i}", 2)
        heap.add(done, 3600.0, 2)
        done.finish(RequestStatus.FINISHED_STOPPED)
    assert len(heap) <= 2 * 2 + 64 + 1  # a finished request is not kept for its whole timeout
    assert ids(heap.pop_expired(3600.0)) == ["live"]


def _expire(sched: Scheduler, clock: Clock, seconds: float) -> list[tuple[str, list[int], str | None]]:
    clock.now += seconds
    return [(d.request_id, d.new_token_ids, d.finish_reason) for _, d in sched.finish_expired_requests()]


def test_a_waiting_request_times_out_in_the_queue():
    clock = Clock()
    sched = scheduler(clock=clock, max_num_seqs=1)
    sched.add_request(request("a", 4, max_tokens=50))
    sched.add_request(Request("b", [9, 9], make_request("b", 1).params, [2], 0.0, timeout=2.0))
    run_step(sched)
    assert _expire(sched, clock, 1.9) == []
    assert _expire(sched, clock, 0.1) == [("b", [], "timeout")]
    assert (ids(sched.waiting), list(sched.requests)) == ([], ["a"])
    assert run_step(sched)[0].finished_req_ids == ["b"]


@pytest.mark.parametrize("where", ["prefilling", "decoding"])
def test_a_running_request_times_out_and_frees_its_blocks(where):
    clock = Clock()
    sched = scheduler(clock=clock, max_num_batched_tokens=4)
    sched.add_request(Request("a", list(range(10)), make_request("a", 1, max_tokens=50).params, [2], 0.0, timeout=5.0))
    for _ in range(1 if where == "prefilling" else 3):
        run_step(sched)
    a = sched.running[0]
    assert (a.num_computed_tokens, a.num_output_tokens) == ((4, 0) if where == "prefilling" else (10, 1))
    assert sched.kv_cache_manager.num_used_blocks == (1 if where == "prefilling" else 3)
    assert _expire(sched, clock, 5.0) == [("a", [], "timeout")]
    assert (a.status, a.finish_reason, sched.running) == (RequestStatus.FINISHED_TIMEOUT, "timeout", [])
    assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()


def test_a_swapped_request_times_out_and_frees_its_cpu_blocks():
    clock = Clock()
    sched = scheduler(num_gpu_blocks=4, max_model_len=16, clock=clock, num_cpu_blocks=8, preemption_mode="swap",
                      enable_prefix_caching=False)
    sched.add_request(request("a", 6, max_tokens=10))
    sched.add_request(Request("b", list(range(2000, 2006)), make_request("b", 1).params, [2], 0.0, timeout=30.0))
    for _ in range(4):
        run_step(sched)
    assert sched.swap_space.num_used_blocks == 2
    assert _expire(sched, clock, 30.0) == [("b", [], "timeout")]
    assert sched.swap_space.num_used_blocks == 0 and not sched.swap_space.swapped and not sched.waiting


def test_a_request_that_finished_first_is_not_timed_out():
    clock = Clock()
    sched = scheduler(clock=clock)
    sched.add_request(Request("a", [5, 6], make_request("a", 1, max_tokens=1).params, [2], 0.0, timeout=1.0))
    run_step(sched)
    assert not sched.has_unfinished_requests()
    assert _expire(sched, clock, 5.0) == [] and not sched.deadlines


def test_a_pooling_prompt_may_fill_max_model_len_and_the_kv_cache():
    """It generates nothing: no position is kept for a generated token (as vLLM)."""
    sched = scheduler(num_gpu_blocks=4, max_model_len=16)  # 4 blocks of 4: the KV cache holds max_model_len
    sched.add_request(make_pooling_request("a", 16))
    with pytest.raises(InvalidRequestError, match="at most 16 prompt tokens$"):
        sched.add_request(make_pooling_request("b", 17))
    with pytest.raises(InvalidRequestError, match="at most 15 prompt tokens and one generated token"):
        sched.add_request(make_request("c", 16))
    _, deltas = run_step(sched)
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("a", "length")]
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_a_max_tokens_1_prompt_may_fill_max_model_len_and_the_kv_cache():
    """Its one sampled token ends it, never stored (the OpenAI server's echo with max_tokens 0, as vLLM's)."""
    sched = scheduler(num_gpu_blocks=4, max_model_len=16)
    sched.add_request(make_request("a", 16, max_tokens=1))
    with pytest.raises(InvalidRequestError, match="at most 16 prompt tokens$"):
        sched.add_request(make_request("b", 17, max_tokens=1))
    out, deltas = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 16}
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in deltas] == [("a", [7], "length")]
    assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()


def test_no_preemption_for_a_request_whose_adapter_cannot_run_yet():
    """max_loras=1, adapter 1 running at priority 0: a waiting priority-1 request of adapter 2 is skipped all the
    same, so the priority-5 base request is not preempted for it (it was, every other step, and recomputed)."""
    from asyncllm.lora import LoRARequest
    from asyncllm.sampling import SamplingParams

    def lora_request(req_id: str, lora_id: int, priority: int, arrival: float) -> Request:
        lora = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
        return Request(req_id, [7] * 6, SamplingParams(max_tokens=20, ignore_eos=True), [0], arrival,
                       priority=priority, lora=lora)

    sched = scheduler(scheduling_policy="priority", max_num_seqs=2, enable_lora=True, max_loras=1)
    sched.add_request(lora_request("a", 1, 0, 0.0))
    sched.add_request(request("base", 6, priority=5, arrival=0.5, max_tokens=20))
    run_step(sched)
    sched.add_request(lora_request("c", 2, 1, 1.0))
    for _ in range(6):
        run_step(sched)
    assert sched.num_preemptions_total == 0 and ids(sched.running) == ["a", "base"] and ids(sched.waiting) == ["c"]
