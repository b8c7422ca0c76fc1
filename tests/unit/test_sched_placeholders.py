"""Overlapped scheduling (async_scheduling) at the scheduler level: step N+1 is scheduled on output placeholders
before step N's output is applied, and the outputs are exactly those of running each request alone.

The driver plays the engine core's overlapped loop (asyncllm/engine/overlap.py) over the fake worker of
test_scheduler_property (which checks every step's KV against the tokens): collect the step in flight first
when `may_preempt` says so, schedule, advance, submit (the fake worker runs a step when it is submitted: real
workers run steps in submission order, so nothing the core does later can change what a step computes), and
collect the older step once two are in flight. Aborts and timeouts land while steps are in flight.

With pipeline micro-batches (``pipeline_parallel_size`` P > 1) up to P steps are in flight, and each new step
must hold none of the requests that sample in a step in flight, and at most 1/P of the seats.
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import EngineOverloadedError, InvalidRequestError
from asyncllm.sampling import SamplingParams
from asyncllm.sched.placeholders import OutputPlaceholders
from asyncllm.sched.recovery import requeue_all_for_recompute
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.scheduler import Scheduler
from test_scheduler import make_pooling_request, make_request
from test_scheduler_property import EOS, FakeWorker, check_invariants, generate_alone, prompts


class OverlapDriver:
    """The core's overlapped step over a `Scheduler` and a `FakeWorker`."""

    def __init__(self, sched: Scheduler, worker: FakeWorker) -> None:
        self.sched, self.worker = sched, worker
        self.placeholders = OutputPlaceholders(sched)
        self.pending: deque[protocol.ModelRunnerOutput] = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.num_ahead = 0
        """Steps scheduled while another was in flight."""
        self.step_sizes: list[int] = []
        """Requests in each step submitted."""
        self.depth = max(2, sched.concurrent_batches)
        """Steps in flight before the oldest is collected (asyncllm/engine/overlap.py)."""

    def record(self, deltas: list[protocol.RequestOutputDelta]) -> None:
        for delta in deltas:
            assert delta.request_id not in self.finish, f"{delta.request_id} got a delta after finishing"
            self.outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                self.finish[delta.request_id] = delta.finish_reason

    def collect(self) -> None:
        self.record([delta for _, delta in self.placeholders.commit(self.pending.popleft())])

    def step(self) -> None:
        if self.placeholders and self.placeholders.may_preempt():
            self.drain()
        out = self.sched.schedule()
        if not (out.total_num_scheduled_tokens or out.finished_req_ids or out.preempted_req_ids):
            if self.placeholders:
                self.collect()
            return
        self.num_ahead += bool(self.placeholders)
        if self.sched.concurrent_batches > 1:
            self.check_micro_batch(out)
        self.placeholders.advance(out)
        self.step_sizes.append(len(out.num_scheduled_tokens))
        self.pending.append(self.worker.execute(out))
        if len(self.placeholders) >= self.depth:
            self.collect()
        check_invariants(self.sched)

    def check_micro_batch(self, out: protocol.SchedulerOutput) -> None:
        """No request of a step in flight that samples there, and at most 1/P of the seats."""
        sampling = {req_id for pending in self.pending
                    for req_id, tokens in zip(pending.req_ids, pending.sampled_token_ids) if tokens}
        assert sampling.isdisjoint(out.num_scheduled_tokens), (sampling, out.num_scheduled_tokens)
        seats = -(-self.sched.max_num_seqs // self.sched.concurrent_batches)
        assert len(out.num_scheduled_tokens) <= seats, (out.num_scheduled_tokens, seats)

    def drain(self) -> None:
        while self.placeholders:
            self.collect()

    def workers_lost(self) -> None:
        """A worker restart: the steps in flight never return, new workers start empty."""
        self.placeholders.discard_all()
        self.pending.clear()
        requeue_all_for_recompute(self.sched)
        self.worker.tokens.clear()
        self.worker.block_ids.clear()


def make_scheduler(config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int, now: list[float]) -> Scheduler:
    return Scheduler(config, num_gpu_blocks, max_model_len=20, num_cpu_blocks=num_cpu_blocks, clock=lambda: now[0])


def run_overlapped(ops: list[tuple], config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> OverlapDriver:
    now = [0.0]
    sched = make_scheduler(config, num_gpu_blocks, num_cpu_blocks, now)
    driver = OverlapDriver(sched, FakeWorker(num_gpu_blocks, config.block_size, num_cpu_blocks))
    added: list[Request] = []
    aborted: set[str] = set()
    for kind, prompt, max_tokens, ignore_eos, index, priority, timeout in ops:
        if kind == "add":
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
            if config.scheduling_policy != "priority":
                priority = 0  # the fcfs scheduler refuses a priority it would ignore
            req = Request(f"r{len(added)}", prompt, params, [EOS], float(len(added)), priority=priority, timeout=timeout)
            try:
                sched.add_request(req)
            except (InvalidRequestError, EngineOverloadedError):
                continue
            added.append(req)
        elif kind == "abort" and added:
            aborted.update(r.request_id for r in sched.abort_requests([added[index % len(added)].request_id]))
        elif kind == "step":
            driver.step()
        elif kind == "tick":
            now[0] += 1.0
            driver.record([delta for _, delta in sched.finish_expired_requests()])
        elif kind == "lose":
            driver.workers_lost()
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        driver.step()
    driver.drain()
    assert not sched.has_unfinished_requests()
    kv = sched.kv_cache_manager
    assert kv.num_used_blocks == 0 and not kv.req_to_blocks
    for req in added:
        assert req.status.is_finished
        if req.request_id in aborted:
            continue
        expected, reason = generate_alone(req, sched.max_seq_len)
        got = driver.outputs.get(req.request_id, [])
        if req.status is RequestStatus.FINISHED_TIMEOUT:
            assert got == expected[: len(got)]
            continue
        assert (got, driver.finish[req.request_id]) == (expected, reason), req.request_id
        assert req.output_token_ids == expected and req.num_tokens == len(req.all_token_ids)
    return driver


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "abort", "step", "step", "step", "step", "step", "tick", "lose"]),
        prompts, st.integers(1, 10), st.booleans(), st.integers(0, 40),
        st.integers(0, 2), st.sampled_from([None, None, None, 2, 5]),
    ),
    min_size=8,
    max_size=50,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_gpu_blocks=st.integers(4, 12),
    block_size=st.sampled_from([2, 4]),
    budget=st.sampled_from([4, 8, 64]),
    max_num_seqs=st.integers(1, 4),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    preemption_mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    stages=st.sampled_from([1, 1, 2, 3]),
)
def test_overlapped_schedules_give_each_request_its_own_output(
    ops, num_gpu_blocks, block_size, budget, max_num_seqs, chunked, prefix_caching, preemption_mode, policy, stages,
):
    config = EngineConfig.create(
        "dummy-model", block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching, preemption_mode=preemption_mode,
        scheduling_policy=policy, pipeline_parallel_size=stages,
    )
    run_overlapped(ops, config, num_gpu_blocks, num_cpu_blocks=8 if preemption_mode == "swap" else 0)


def _add(sched: Scheduler, req_id: str, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> Request:
    req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), [EOS], 0.0)
    sched.add_request(req)
    return req


def test_decodes_run_ahead_and_a_finished_requests_extra_token_is_dropped():
    """Plenty of blocks: every step after the first is scheduled ahead; max_tokens=1 and 5 end exactly."""
    config = EngineConfig.create("dummy-model", block_size=4, max_num_batched_tokens=64)
    now = [0.0]
    sched = make_scheduler(config, 32, 0, now)
    driver = OverlapDriver(sched, FakeWorker(32, 4))
    short, long = _add(sched, "short", [1, 2, 4], 1), _add(sched, "long", [5, 4, 1, 2, 0], 5)
    driver.step()
    driver.step()  # step 1 was scheduled before step 0 said that "short" is done: it decoded once more
    assert len(driver.worker.tokens["short"]) == 3 + 2 and driver.finish == {"short": "length"}
    while sched.has_unfinished_requests():
        driver.step()
    driver.drain()
    assert driver.outputs == {"short": generate_alone(short, 20)[0], "long": generate_alone(long, 20)[0]}
    assert len(driver.outputs["short"]) == 1 and len(driver.outputs["long"]) == 5  # the extra token was dropped
    assert driver.num_ahead == sched.num_steps_total - 1  # only the first step had nothing in flight
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_placeholders_count_one_token_per_sampling_request_until_committed():
    config = EngineConfig.create("dummy-model", block_size=4, max_num_batched_tokens=64)
    sched = make_scheduler(config, 32, 0, [0.0])
    placeholders = OutputPlaceholders(sched)
    worker = FakeWorker(32, 4)
    req = _add(sched, "a", [1, 2, 4, 0, 5, 1], 8)
    first = sched.schedule()
    placeholders.advance(first)
    assert (req.num_computed_tokens, req.num_tokens, len(req.all_token_ids)) == (6, 7, 6)
    second = sched.schedule()  # scheduled on the placeholder: one token at position 6
    assert second.num_scheduled_tokens == {"a": 1} and second.cached_reqs.num_computed_tokens == [6]
    placeholders.advance(second)
    assert (req.num_computed_tokens, req.num_tokens) == (7, 8)
    out0, out1 = worker.execute(first), worker.execute(second)
    deltas = placeholders.commit(out0)
    assert [d.new_token_ids for _, d in deltas] == out0.sampled_token_ids
    assert (req.num_computed_tokens, req.num_tokens, len(req.all_token_ids)) == (7, 8, 7)
    placeholders.commit(out1)
    assert (req.num_computed_tokens, req.num_tokens, len(req.all_token_ids)) == (7, 8, 8)
    assert not placeholders


def test_may_preempt_when_running_requests_could_need_more_blocks_than_are_free():
    config = EngineConfig.create("dummy-model", block_size=2, max_num_batched_tokens=64)
    sched = make_scheduler(config, 4, 0, [0.0])
    placeholders = OutputPlaceholders(sched)
    _add(sched, "a", [1, 2, 4], 8)
    _add(sched, "b", [0, 5, 1], 8)
    placeholders.advance(sched.schedule())  # 2 blocks each: none free, and each decode at position 3 fits
    assert sched.kv_cache_manager.num_free_blocks == 0
    assert not placeholders.may_preempt()
    placeholders.advance(sched.schedule())  # position 3 computed: the next decode (position 4) needs a new block
    assert placeholders.may_preempt()


def test_may_preempt_under_priority_when_the_waiting_head_outranks_any_running():
    """low (priority 2) runs before top (priority 0): the running list keeps admission order, so the victim for
    high (priority 1) is not the last running request."""
    config = EngineConfig.create("dummy-model", block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    sched = make_scheduler(config, 32, 0, [0.0])
    placeholders = OutputPlaceholders(sched)
    sched.add_request(Request("low", [1, 2, 4], SamplingParams(max_tokens=8), [EOS], 0.0, priority=2))
    placeholders.advance(sched.schedule())
    assert not placeholders.may_preempt()
    sched.add_request(Request("top", [3, 1], SamplingParams(max_tokens=8), [EOS], 1.0, priority=0))
    placeholders.advance(sched.schedule())
    assert [r.request_id for r in sched.running] == ["low", "top"]
    sched.add_request(Request("same", [1, 2], SamplingParams(max_tokens=8), [EOS], 2.0, priority=2))
    assert not placeholders.may_preempt()
    sched.add_request(Request("high", [5, 4], SamplingParams(max_tokens=8), [EOS], 3.0, priority=1))
    assert placeholders.may_preempt()


def test_a_reused_request_id_never_gets_the_old_requests_tokens():
    """'a' is aborted while in flight and a new 'a' is admitted before the old one's last step returns."""
    config = EngineConfig.create("dummy-model", block_size=4, max_num_batched_tokens=64)
    sched = make_scheduler(config, 32, 0, [0.0])
    driver = OverlapDriver(sched, FakeWorker(32, 4))
    _add(sched, "a", [1, 2, 4], 8)
    driver.step()
    driver.step()  # two steps of the old "a" in flight, one collected
    sched.abort_requests(["a"])
    new = _add(sched, "a", [5, 4, 0, 2], 3)
    while sched.has_unfinished_requests():
        driver.step()
    driver.drain()
    expected = generate_alone(new, 20)[0]
    assert new.output_token_ids == expected
    assert driver.outputs["a"][-len(expected):] == expected
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_a_failure_a_later_step_reports_for_an_ended_id_spares_its_new_request():
    """'a' fails in step 0 while step 1 (which touches 'a' again and will report it again) is in flight; a new 'a'
    admitted meanwhile is not the failed one: only the oldest step's own requests fail."""
    config = EngineConfig.create("dummy-model", block_size=4, max_num_batched_tokens=64)
    sched = make_scheduler(config, 32, 0, [0.0])
    placeholders = OutputPlaceholders(sched)
    worker = FakeWorker(32, 4)
    _add(sched, "a", [1, 2, 4, 0, 5, 1], 8)
    steps = [sched.schedule()]
    placeholders.advance(steps[0])
    steps.append(sched.schedule())
    placeholders.advance(steps[1])
    out0, out1 = worker.execute(steps[0]), worker.execute(steps[1])
    assert placeholders.own({"a": "bad"}) == {"a": "bad"}
    placeholders.fail({"a": "bad"})
    placeholders.commit(out0)
    new = _add(sched, "a", [3, 3, 3], 2)
    assert placeholders.own({"a": "bad again"}) == {}  # step 1's "a" is gone: its report names the old one
    placeholders.commit(out1)
    assert sched.requests["a"] is new


def test_blocks_ending_in_a_placeholder_enter_the_prefix_cache_once_their_token_is_known():
    """A decode fills a block whose last token was a placeholder when it was scheduled: the block is cached
    as soon as that token is committed, so after every step all the computed full blocks are cached (as in
    the synchronous engine, where `schedule()` caches them)."""
    config = EngineConfig.create("dummy-model", block_size=4, max_num_batched_tokens=64)
    sched = make_scheduler(config, 32, 0, [0.0])
    driver = OverlapDriver(sched, FakeWorker(32, 4))
    req = _add(sched, "a", [1, 2, 4], 10)
    pool = sched.kv_cache_manager.pool
    seen = set()
    while sched.has_unfinished_requests():
        driver.step()
        if not req.is_finished:
            assert pool.num_cached_blocks == req.num_computed_tokens // 4, req
            seen.add(pool.num_cached_blocks)
    driver.drain()
    assert seen == {0, 1, 2, 3} and req.output_token_ids == generate_alone(req, 20)[0]


def test_micro_batches_split_the_running_requests_while_the_queue_waits_for_blocks():
    """Two stages, four short requests admitted together and ten long ones waiting for blocks that the short ones
    hold: once running, the four decode two by two (the waiting ones cannot run, so they must not widen the
    micro-batch to all four, which would leave every other step empty), and every output is exact."""
    config = EngineConfig.create("dummy-model", block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                                 pipeline_parallel_size=2)
    sched = make_scheduler(config, 8, 0, [0.0])
    driver = OverlapDriver(sched, FakeWorker(8, 4))
    short = [_add(sched, f"s{i}", [1 + i, 2, 4], 4) for i in range(4)]
    long = [_add(sched, f"l{i}", [(i + j) % 6 for j in range(17)], 3) for i in range(10)]  # 5 blocks each
    driver.step()
    assert driver.step_sizes == [4] and len(sched.running) == 4  # a micro-batch of the 8 seats: the short ones
    while any(not r.is_finished for r in short):
        driver.step()
    sizes = driver.step_sizes[1:]
    assert len(sizes) >= 6 and max(sizes) <= 2 and driver.num_ahead > 0, sizes
    while sched.has_unfinished_requests():
        driver.step()
    driver.drain()
    for req in short + long:
        assert driver.outputs[req.request_id] == generate_alone(req, 20)[0], req.request_id


def test_an_overlapped_step_schedules_no_decode_after_a_full_length_pooling_prompt():
    """async_scheduling: the token its prefill samples ends it, and a decode after it would need a KV position
    past max_model_len (the workers' block tables hold max_model_len): it gets no placeholder."""
    sched = Scheduler(EngineConfig.create("dummy-model", block_size=4), 8, max_model_len=16)
    placeholders = OutputPlaceholders(sched)
    sched.add_request(make_pooling_request("a", 16))
    sched.add_request(make_request("b", 4, max_tokens=2))
    steps = []
    for _ in range(2):
        steps.append(sched.schedule())
        placeholders.advance(steps[-1])
    assert [out.num_scheduled_tokens for out in steps] == [{"a": 16, "b": 4}, {"b": 1}]
    first = placeholders.commit(protocol.ModelRunnerOutput(steps[0].step_id, ["a", "b"], [[7], [7]]))
    second = placeholders.commit(protocol.ModelRunnerOutput(steps[1].step_id, ["b"], [[8]]))
    finished = [(delta.request_id, delta.finish_reason) for _, delta in [*first, *second] if delta.finish_reason]
    assert finished == [("a", "length"), ("b", "length")] and sched.kv_cache_manager.num_used_blocks == 0
