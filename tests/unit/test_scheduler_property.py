"""Property test: random add / abort / step / timeout sequences never leak, double-own or corrupt KV blocks.

A fake worker keeps per-request state from the `SchedulerOutput` diffs alone
(as the real one does) and a fake KV cache whose slot for position p holds the
tokens up to p, plus a fake CPU swap space it copies blocks to and from as the
step says (out first, then in). Every step it checks that the KV a request is
told it has computed (prefix hits and swapped-in blocks included) is right,
and it samples a token that is a function of the tokens so far (and of the
request's LoRA adapter, whose KV differs for the same tokens), so each
request's output must equal what it would generate alone, whatever the
batching, chunking, policy, preemption (recompute or swap), prefix hits or
adapters (no more than max_loras among the running requests).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import EngineOverloadedError, InvalidRequestError
from asyncllm.lora import LoRARequest
from asyncllm.sampling import SamplingParams
from asyncllm.sched.preemption import priority_key
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.scheduler import Scheduler

EOS = 3
VOCAB = 6


def next_token(tokens: list[int], lora_id: int = 0) -> int:
    """The fake model: a deterministic function of every token so far and of the adapter."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens) + lora_id) % VOCAB


def generate_alone(req: Request, max_seq_len: int) -> tuple[list[int], str]:
    """What `req` outputs when it runs alone (the reference for every schedule)."""
    tokens, out = list(req.prompt_token_ids), []
    while True:
        token = next_token(tokens, req.lora_int_id)
        tokens.append(token)
        out.append(token)
        if token == EOS and not req.params.ignore_eos:
            return out, "stop"
        if len(out) >= req.params.max_tokens or len(tokens) >= max_seq_len:
            return out, "length"


class FakeWorker:
    """Per-request token lists and block tables built from the step diffs, over a fake KV cache."""

    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.kv: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.lora_ids: dict[str, int] = {}

    def execute(self, out: protocol.SchedulerOutput) -> protocol.ModelRunnerOutput:
        for gpu, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self.kv[gpu])
        for gpu, cpu in out.blocks_to_swap_in:
            self.kv[gpu] = list(self.cpu[cpu])
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.tokens.pop(req_id, None)
            self.block_ids.pop(req_id, None)
        computed = {}
        for new in out.new_reqs:
            assert new.req_id not in self.tokens
            self.tokens[new.req_id] = list(new.token_ids)
            self.block_ids[new.req_id] = list(new.block_ids)
            self.lora_ids[new.req_id] = new.lora.lora_int_id if new.lora is not None else 0
            computed[new.req_id] = new.num_computed_tokens
        cached = out.cached_reqs
        assert len(cached.req_ids) == len(cached.num_computed_tokens) and set(cached.new_block_ids) <= set(cached.req_ids)
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.block_ids[req_id] += cached.new_block_ids.get(req_id, [])
            computed[req_id] = num_computed
        req_ids, sampled = [], []
        for req_id, num in out.num_scheduled_tokens.items():
            req_ids.append(req_id)
            sampled.append(self._run(req_id, computed[req_id], num, out.spec_token_ids.get(req_id, [])))
        return protocol.ModelRunnerOutput(out.step_id, req_ids, sampled)

    def _run(self, req_id: str, num_computed: int, num: int, drafts: list[int]) -> list[int]:
        """Drafts (speculative decoding) are inputs like known tokens: their KV is written, then the ones the
        fake model agrees with are accepted, and one token more, as the real worker does."""
        tokens, table, bs = self.tokens[req_id], self.block_ids[req_id], self.block_size
        lora_id = self.lora_ids[req_id]
        inputs = tokens + drafts
        assert num > 0 and num_computed + num <= len(inputs) and len(table) * bs >= num_computed + num
        assert not drafts or num_computed + num == len(inputs) and num == len(drafts) + 1
        for pos in range(num_computed):
            assert self.kv[table[pos // bs]][pos % bs] == (lora_id, *tokens[: pos + 1]), (req_id, pos)
        for pos in range(num_computed, num_computed + num):
            self.kv[table[pos // bs]][pos % bs] = (lora_id, *inputs[: pos + 1])
        if num_computed + num < len(inputs):
            return []
        sampled = []
        for draft in drafts:
            sampled.append(next_token(tokens + sampled, lora_id))
            if sampled[-1] != draft:
                break
        else:
            sampled.append(next_token(tokens + sampled, lora_id))
        tokens += sampled
        return sampled


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.pool
    owners: Counter[int] = Counter()
    for req_id, blocks in kv.req_to_blocks.items():
        req = sched.requests[req_id]
        assert req.status is RequestStatus.RUNNING
        ids = [b.block_id for b in blocks]
        assert len(set(ids)) == len(ids), ids
        assert len(blocks) * kv.block_size >= req.num_computed_tokens
        owners.update(ids)
    assert [b.ref_cnt for b in pool.blocks] == [owners[b.block_id] for b in pool.blocks]
    free = pool.free_block_ids()
    assert len(free) == len(set(free))
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert kv.num_used_blocks + kv.num_free_blocks == kv.num_gpu_blocks
    assert pool.num_cached_blocks == sum(b.block_hash is not None for b in pool.blocks)
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    assert running == set(kv.req_to_blocks) and not running & waiting
    assert running | waiting == set(sched.requests)
    assert len(running) <= sched.max_num_seqs
    assert len({r.lora_int_id for r in sched.running if r.lora_int_id}) <= sched.max_loras
    assert sched.waiting.num_tokens == sum(r.num_tokens for r in sched.waiting)
    check_swap_space(sched)


def check_swap_space(sched: Scheduler) -> None:
    """Swapped requests wait, hold no GPU block, and own disjoint CPU blocks covering their computed tokens."""
    swap = sched.swap_space
    if swap is None:
        return
    owned = [cpu for entry in swap.swapped.values() for cpu in entry.cpu_block_ids]
    assert len(owned) == len(set(owned))
    assert sorted(owned + swap.free_block_ids()) == list(range(swap.num_cpu_blocks))
    for req_id, entry in swap.swapped.items():
        req = sched.requests[req_id]
        assert req.status is RequestStatus.PREEMPTED and req_id not in sched.kv_cache_manager.req_to_blocks
        assert len(entry.cpu_block_ids) == -(-entry.num_computed_tokens // sched.block_size)
        assert 0 < entry.num_computed_tokens < req.num_tokens


STEMS = ([1, 2, 0, 4, 5, 1, 2, 0, 4, 5, 1, 2, 0, 4, 5, 1], [5, 4, 0, 2, 1, 5, 4, 0, 2, 1, 5, 4, 0, 2, 1, 5])
"""Shared prompt beginnings, so that prefix hits happen often."""

prompts = st.builds(
    lambda stem, stem_len, suffix: (STEMS[stem][:stem_len] + suffix) or [0],
    st.integers(0, 1), st.integers(0, 12), st.lists(st.integers(0, VOCAB - 1), max_size=4),
)
ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "abort", "step", "step", "step", "step", "tick"]),
        prompts, st.integers(1, 10), st.booleans(), st.integers(0, 40),
        st.integers(0, 2), st.sampled_from([None, None, None, 2, 5]),
    ),
    min_size=8,
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_gpu_blocks=st.integers(4, 10),
    block_size=st.sampled_from([2, 4]),
    budget=st.sampled_from([4, 8, 64]),
    max_num_seqs=st.integers(1, 4),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    threshold=st.sampled_from([0, 5]),
    preemption_mode=st.sampled_from(["recompute", "swap"]),
    num_cpu_blocks=st.sampled_from([0, 2, 16]),
    policy=st.sampled_from(["fcfs", "priority"]),
    max_queued=st.sampled_from([None, 3]),
    max_loras=st.sampled_from([0, 1, 2]),
    num_drafts=st.sampled_from([0, 0, 1, 3]),
    num_offload_blocks=st.sampled_from([0, 0, 2, 16]),
)
@example(  # r0's drafts (priority 2, admitted first) took the block r1 (priority 1) then preempted itself for
    ops=[("add", [0, 2], 6, True, 0, 2, None), ("step", [0], 1, True, 1, 0, None), ("add", [4], 4, True, 0, 1, None)],
    num_gpu_blocks=5, block_size=2, budget=64, max_num_seqs=4, chunked=True, prefix_caching=False, threshold=0,
    preemption_mode="recompute", num_cpu_blocks=0, policy="priority", max_queued=None, max_loras=0, num_drafts=3,
    num_offload_blocks=0,
)
def test_random_schedules_keep_the_kv_cache_consistent(
    ops, num_gpu_blocks, block_size, budget, max_num_seqs, chunked, prefix_caching, threshold,
    preemption_mode, num_cpu_blocks, policy, max_queued, max_loras, num_drafts, num_offload_blocks,
):
    """max_loras 0: LoRA off; else requests take adapters 0 (none) to 3 by their index. num_drafts > 0:
    n-gram speculative decoding (the fake model's small vocabulary makes drafts often right, often wrong).
    num_offload_blocks > 0 (with prefix caching): the CPU prefix-cache tier (kv_offloading_size), its loads and
    offloads mixed with swap, preemption, priority and drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": num_drafts, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    config = EngineConfig.create(
        "dummy-model", block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching, long_prefill_token_threshold=threshold,
        preemption_mode=preemption_mode, scheduling_policy=policy, max_num_queued_requests=max_queued,
        enable_lora=max_loras > 0, max_loras=max(max_loras, 1), speculative_config=spec if num_drafts else None,
    )
    run_ops(ops, config, num_gpu_blocks, num_cpu_blocks, num_offload_blocks if prefix_caching else 0)


pressure_ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "step", "abort", "tick"]),
        prompts, st.integers(4, 10), st.just(True), st.integers(0, 40),
        st.integers(0, 3), st.sampled_from([None, None, None, 4]),
    ),
    min_size=20,
    max_size=60,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=pressure_ops,
    num_gpu_blocks=st.integers(4, 7),
    num_cpu_blocks=st.sampled_from([3, 6, 32]),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix_caching=st.booleans(),
    max_num_seqs=st.integers(2, 4),
)
def test_swap_and_priority_under_memory_pressure(ops, num_gpu_blocks, num_cpu_blocks, policy, prefix_caching, max_num_seqs):
    """Few GPU blocks and long outputs, so that requests are swapped out and in (and preempted by priority) often."""
    config = EngineConfig.create(
        "dummy-model", block_size=2, max_num_batched_tokens=16, max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching, preemption_mode="swap", scheduling_policy=policy,
    )
    run_ops(ops, config, num_gpu_blocks, num_cpu_blocks)


def run_ops(ops: list[tuple], config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int,
            num_offload_blocks: int = 0) -> None:
    """Play the ops (add, abort, step, tick = one second passes), then run to the end; check every step. The CPU
    prefix-cache tier's blocks follow the swap space's in the fake worker's CPU array (their ids do)."""
    now = [0.0]
    sched = Scheduler(config, num_gpu_blocks, max_model_len=20, num_cpu_blocks=num_cpu_blocks, clock=lambda: now[0],
                      num_offload_blocks=num_offload_blocks)
    worker = FakeWorker(num_gpu_blocks, config.block_size, num_cpu_blocks + num_offload_blocks)
    budget = sched.max_num_batched_tokens
    added: list[Request] = []
    aborted: set[str] = set()
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}

    def record(deltas: list[protocol.RequestOutputDelta]) -> None:
        for delta in deltas:
            assert delta.request_id not in finish
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                finish[delta.request_id] = delta.finish_reason

    def step(abort_index: int | None = None) -> None:
        out = sched.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= budget
        assert not set(out.num_scheduled_tokens) & set(out.preempted_req_ids), out  # never served, then preempted
        if config.scheduling_policy == "priority" and out.preempted_req_ids and out.num_scheduled_tokens:
            keys = {req_id: priority_key(sched.requests[req_id]) for req_id in sched.requests}
            assert max(map(keys.get, out.num_scheduled_tokens)) < min(map(keys.get, out.preempted_req_ids)), out
        if abort_index is not None and added:  # an abort that lands while the step runs
            aborted.update(r.request_id for r in sched.abort_requests([added[abort_index % len(added)].request_id]))
        runner_out = worker.execute(out)
        record([delta for _, delta in sched.update_from_output(out, runner_out)])
        check_invariants(sched)

    for kind, prompt, max_tokens, ignore_eos, index, priority, timeout in ops:
        if kind == "add":
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
            if config.scheduling_policy != "priority":
                priority = 0  # the fcfs scheduler refuses a priority it would ignore
            lora_id = index % 4 if config.enable_lora else 0
            lora = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
            req = Request(f"r{len(added)}", prompt, params, [EOS], float(len(added)), priority=priority, timeout=timeout,
                          lora=lora)
            try:
                sched.add_request(req)
            except InvalidRequestError:
                assert len(prompt) > sched.max_seq_len - 1 or (not config.enable_chunked_prefill and len(prompt) > budget)
                continue
            except EngineOverloadedError:
                assert config.max_num_queued_requests is not None and len(sched.waiting) >= config.max_num_queued_requests
                continue
            added.append(req)
        elif kind == "abort" and added:
            aborted.update(r.request_id for r in sched.abort_requests([added[index % len(added)].request_id]))
            check_invariants(sched)
        elif kind == "step":
            step(index if index % 4 == 0 else None)
        elif kind == "tick":
            now[0] += 1.0
            expired = sched.finish_expired_requests()
            assert all(delta.finish_reason == "timeout" and not delta.new_token_ids for _, delta in expired)
            record([delta for _, delta in expired])
            check_invariants(sched)

    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.kv_cache_manager.req_to_blocks
    if sched.swap_space is not None:
        assert sched.swap_space.num_used_blocks == 0 and not sched.swap_space.swapped
    for req in added:
        assert req.status.is_finished
        if req.request_id in aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
            continue
        expected, reason = generate_alone(req, sched.max_seq_len)
        if req.status is RequestStatus.FINISHED_TIMEOUT:
            got = outputs.get(req.request_id, [])
            assert finish[req.request_id] == "timeout" and got == expected[: len(got)] and req.timeout is not None
            continue
        assert (outputs[req.request_id], finish[req.request_id]) == (expected, reason)
        assert req.output_token_ids == expected
