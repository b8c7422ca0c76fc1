"""Model-based property test of preemption by swap (`preemption_mode="swap"`).

A real `Scheduler` (no model: `FakeWorker` from test_scheduler_property.py runs a fake KV cache and samples
deterministic tokens) is driven through drawn workloads: arrivals at drawn steps, aborts between steps and while a
step runs, small GPU KV caches and small swap spaces, so that swap-outs, swap-ins and the fall-back to recompute
all happen often. A plain model written from docs/scheduling.md ("Preemption") and the docstrings of
asyncllm/kv/swap.py and asyncllm/sched/preemption.py is checked against every `SchedulerOutput`:

- a victim is swapped when its computed blocks (ceil(computed / block_size)) fit the free CPU blocks, else it is
  recomputed; a swap-out copies exactly the victim's leading computed GPU blocks, in order, into CPU blocks that
  no other swapped request holds (and nothing is copied for a recompute);
- a swapped request comes back with its tokens and at least its swapped computed count (nothing recomputed);
  the swap-in copies exactly its CPU blocks past the leading ones found in the GPU prefix cache, into blocks that
  only requests admitted after it in the same step may share (as prefix hits: workers copy in before the forward),
  and frees those CPU blocks; a CPU block is never written and read in one step;
- a block a step writes is its writer's alone, but for such later same-step hits (no request recomputes KV that
  another holds, e.g. a resumed request whose prefix hits cover more than its swapped copy);
- the waiting queue (swapped and recomputed victims included) admits in the documented order: fcfs puts a
  victim back at the front, 'priority' orders by (priority, arrival); admissions are a prefix of that order;
- aborting a swapped request frees its CPU blocks at once; the swap space's free blocks, `num_swapped_total` and
  `num_preemptions_total` match the model after every call, and it is full again at the end;
- every request finishes within a bounded number of steps (no starvation), with the tokens it would generate
  alone (`generate_alone`); the fake worker checks the KV each step reads (swap copies included).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.scheduler import Scheduler
from test_scheduler_property import EOS, FakeWorker, check_invariants, generate_alone

MAX_MODEL_LEN = 20
DRAIN_STEPS = 300
"""Steps after the last arrival within which every request must have finished (no starvation)."""
EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "200"))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SwapModel:
    """The documented swap behaviour over plain dicts: CPU blocks, block tables, computed counts, queue order."""

    def __init__(self, num_cpu_blocks: int, block_size: int, policy: str, prefix_caching: bool) -> None:
        self.bs, self.policy, self.prefix_caching = block_size, policy, prefix_caching
        self.cpu_free = set(range(num_cpu_blocks))
        self.swapped: dict[str, tuple[list[int], int]] = {}  # req_id -> (its CPU blocks, its computed tokens)
        self.tables: dict[str, list[int]] = {}  # running req_id -> GPU block table, from the step diffs
        self.computed: dict[str, int] = {}  # running req_id -> tokens computed after the last applied step
        self.queue: list[str] = []  # waiting req_ids in admission order
        self.keys: dict[str, tuple[int, float]] = {}
        self.tokens: dict[str, list[int]] = {}  # every known token of each unfinished request
        self.num_preempted = self.num_swapped = 0

    # ------------------------------------------------------------ the queue
    def add(self, req: Request) -> None:
        self.keys[req.request_id] = (req.priority, req.arrival_time)
        self.tokens[req.request_id] = list(req.prompt_token_ids)
        self._enqueue(req.request_id, front=False)

    def _enqueue(self, req_id: str, front: bool) -> None:
        if self.policy == "priority":
            self.queue.append(req_id)
            self.queue.sort(key=self.keys.__getitem__)  # stable: equal keys keep insertion order
        elif front:
            self.queue.insert(0, req_id)
        else:
            self.queue.append(req_id)

    def remove(self, req_id: str) -> None:
        """Aborted or finished: gone from everywhere; a swapped request's CPU blocks are free again."""
        if req_id in self.queue:
            self.queue.remove(req_id)
        self.tables.pop(req_id, None)
        self.computed.pop(req_id, None)
        self.tokens.pop(req_id, None)
        entry = self.swapped.pop(req_id, None)
        if entry is not None:
            self.cpu_free.update(entry[0])

    # ------------------------------------------------------------ one step
    def on_schedule(self, out: protocol.SchedulerOutput) -> None:
        cpu_out = {cpu for _, cpu in out.blocks_to_swap_out}
        cpu_in = {cpu for _, cpu in out.blocks_to_swap_in}
        assert not cpu_out & cpu_in, out  # a CPU block is never written and read in one step
        self._preemptions(out)
        swap_in_targets = self._admissions(out)
        for req_id, num_computed in zip(out.cached_reqs.req_ids, out.cached_reqs.num_computed_tokens):
            assert num_computed == self.computed[req_id], (req_id, num_computed, self.computed[req_id])
            self.tables[req_id] += out.cached_reqs.new_block_ids.get(req_id, [])
        new_ids = [new.req_id for new in out.new_reqs]
        for gpu, owner in swap_in_targets:  # copied in before the forward: only a later admission may hit it
            for req_id, table in self.tables.items():
                if gpu in table and req_id != owner:
                    assert req_id in new_ids[new_ids.index(owner) + 1:], (gpu, owner, req_id, self.tables)
                    assert table.index(gpu) < self.computed[req_id] // self.bs, (gpu, req_id, self.tables)
            assert gpu in self.tables[owner], (gpu, owner)
        for table in self.tables.values():
            assert len(set(table)) == len(table), table
        self._check_writes(out, new_ids)

    def _check_writes(self, out: protocol.SchedulerOutput, new_ids: list[str]) -> None:
        """A block written in this step is its writer's alone, but for admissions after it in the step that hit it
        (registered when scheduled): no request recomputes KV another one holds (e.g. a swapped one's hits)."""
        order = list(out.cached_reqs.req_ids) + new_ids  # running requests are served before admissions
        for req_id, num in out.num_scheduled_tokens.items():
            start = self.computed[req_id]
            for gpu in self.tables[req_id][start // self.bs: cdiv(start + num, self.bs)]:
                for other, table in self.tables.items():
                    if gpu in table and other != req_id:
                        later = other in new_ids and order.index(other) > order.index(req_id)
                        assert later and table.index(gpu) < self.computed[other] // self.bs, (req_id, gpu, other)

    def _preemptions(self, out: protocol.SchedulerOutput) -> None:
        pairs = list(out.blocks_to_swap_out)
        assert len(set(out.preempted_req_ids)) == len(out.preempted_req_ids)
        for req_id in out.preempted_req_ids:
            assert req_id in self.tables, (req_id, "preempted but not running")
            table, computed = self.tables.pop(req_id), self.computed.pop(req_id)
            num_blocks = cdiv(computed, self.bs)
            self.num_preempted += 1
            if num_blocks <= len(self.cpu_free):  # swap; else the fall-back: recompute, nothing copied
                mine, pairs = pairs[:num_blocks], pairs[num_blocks:]
                cpu_ids = [cpu for _, cpu in mine]
                assert [gpu for gpu, _ in mine] == table[:num_blocks], (req_id, mine, table, computed)
                assert len(set(cpu_ids)) == len(cpu_ids) and set(cpu_ids) <= self.cpu_free, (cpu_ids, self.cpu_free)
                self.cpu_free -= set(cpu_ids)
                self.swapped[req_id] = (cpu_ids, computed)
                self.num_swapped += 1
            self._enqueue(req_id, front=True)
        assert not pairs, ("swap-out copies of no victim", pairs)

    def _admissions(self, out: protocol.SchedulerOutput) -> list[tuple[int, str]]:
        """Check the admissions and their swap-ins; the GPU blocks copied into, with the request of each."""
        new_ids = [new.req_id for new in out.new_reqs]
        assert new_ids == self.queue[: len(new_ids)], (new_ids, self.queue)
        del self.queue[: len(new_ids)]
        pairs, targets = list(out.blocks_to_swap_in), []
        for new in out.new_reqs:
            assert list(new.token_ids) == self.tokens[new.req_id], new
            entry = self.swapped.pop(new.req_id, None)
            if entry is None:
                assert self.prefix_caching or new.num_computed_tokens == 0, new  # recomputed from scratch
            else:
                rest = self._swap_in(new, entry, pairs)
                targets += [(gpu, new.req_id) for gpu, _ in pairs[: len(pairs) - len(rest)]]
                pairs = rest
            self.tables[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        assert not pairs, ("swap-in copies of no resumed request", pairs)
        return targets

    def _swap_in(self, new: protocol.NewRequestData, entry: tuple[list[int], int],
                 pairs: list[list[int]]) -> list[list[int]]:
        """Check one resumed request's copies (taken from the front of `pairs`); the pairs left."""
        cpu_ids, computed = entry
        assert new.num_computed_tokens >= computed, (new, computed)  # resumes where it was: nothing recomputed
        num_copied = 0
        while num_copied < len(pairs) and pairs[num_copied][1] in cpu_ids:
            num_copied += 1
        num_hits = len(cpu_ids) - num_copied  # the leading blocks found in the GPU prefix cache
        expected = [[new.block_ids[i], cpu_ids[i]] for i in range(num_hits, len(cpu_ids))]
        assert pairs[:num_copied] == expected, (new, cpu_ids, pairs)
        if not self.prefix_caching:
            assert num_hits == 0 and new.num_computed_tokens == computed, (new, computed)
        elif new.num_computed_tokens > computed:  # hits cover more than the swapped copy: nothing copied
            assert num_copied == 0 and new.num_computed_tokens % self.bs == 0, (new, computed)
        self.cpu_free.update(cpu_ids)
        return pairs[num_copied:]

    def on_update(self, out: protocol.SchedulerOutput, deltas: list[protocol.RequestOutputDelta]) -> None:
        for req_id, num in out.num_scheduled_tokens.items():
            if req_id in self.computed:  # not aborted while the step ran
                self.computed[req_id] += num
        for delta in deltas:
            self.tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                self.remove(delta.request_id)

    def compare(self, sched: Scheduler) -> None:
        swap = sched.swap_space
        assert swap is not None
        assert set(swap.free_block_ids()) == self.cpu_free and swap.num_free_blocks == len(self.cpu_free)
        assert {req_id: entry.cpu_block_ids for req_id, entry in swap.swapped.items()} == {
            req_id: cpu_ids for req_id, (cpu_ids, _) in self.swapped.items()}
        stats = sched.get_stats()
        assert (stats.num_preemptions_total, stats.num_swapped_total) == (self.num_preempted, self.num_swapped)
        assert [r.request_id for r in sched.waiting] == self.queue
        assert [r.request_id for r in sched.running] == [i for i in self.tables]  # admission order
        for req_id in self.swapped:
            assert sched.requests[req_id].status is RequestStatus.PREEMPTED


STEM = [1, 2, 0, 4, 5, 1, 2, 0, 4, 5]
"""A shared prompt beginning, so that a resumed request often finds leading blocks in the GPU prefix cache."""
LONG = STEM + [3, 3, 1, 2]

requests = st.lists(
    st.fixed_dictionaries({
        "arrival": st.integers(0, 6),
        "prompt": st.builds(lambda n, tail: (STEM[:n] + tail) or [0], st.integers(0, 6),
                            st.lists(st.integers(0, 5), max_size=3)),
        "max_tokens": st.integers(3, 14),
        "priority": st.integers(0, 2),
        "abort": st.one_of(st.none(), st.tuples(st.integers(1, 16), st.booleans())),
    }),
    min_size=2, max_size=8,
)


def run(reqs: list[dict], num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, budget: int,
        max_num_seqs: int, policy: str, prefix_caching: bool, chunked: bool) -> SwapModel:
    """Play the workload step by step, checking the scheduler against the model after every call."""
    config = EngineConfig.create(
        "dummy-model", block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching, preemption_mode="swap",
        scheduling_policy=policy,
    )
    sched = Scheduler(config, num_gpu_blocks, MAX_MODEL_LEN, num_cpu_blocks=num_cpu_blocks)
    worker = FakeWorker(num_gpu_blocks, block_size, num_cpu_blocks)
    model = SwapModel(num_cpu_blocks, block_size, policy, prefix_caching)
    added: dict[str, Request] = {}
    aborted: set[str] = set()
    outputs: dict[str, list[int]] = {}

    def abort(t: int, mid_step: bool) -> None:
        for i, spec in enumerate(reqs):
            req_id = f"r{i}"
            if spec["abort"] == (t, mid_step) and req_id in sched.requests:
                assert [r.request_id for r in sched.abort_requests([req_id])] == [req_id]
                aborted.add(req_id)
                model.remove(req_id)
                model.compare(sched)

    last_arrival = max(spec["arrival"] for spec in reqs)
    for t in range(last_arrival + DRAIN_STEPS):
        for i, spec in enumerate(reqs):
            if spec["arrival"] == t:
                req = add(sched, config, f"r{i}", spec)
                if req is not None:
                    added[req.request_id] = req
                    model.add(req)
        abort(t, False)
        out = sched.schedule()
        model.on_schedule(out)
        abort(t, True)
        deltas = [delta for _, delta in sched.update_from_output(out, worker.execute(out))]
        for delta in deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        model.on_update(out, deltas)
        check_invariants(sched)
        model.compare(sched)
        if t >= last_arrival and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests(), ("starved", [(r.request_id, r.status) for r in sched.requests.values()])
    assert sched.swap_space.num_free_blocks == num_cpu_blocks and not model.swapped
    for req_id, req in added.items():
        if req_id not in aborted:
            assert (outputs[req_id], req.status.is_finished) == (generate_alone(req, sched.max_seq_len)[0], True)
    return model


def add(sched: Scheduler, config: EngineConfig, req_id: str, spec: dict) -> Request | None:
    """Queue the drawn request; None when the scheduler refuses it (a prompt it could never run)."""
    priority = spec["priority"] if config.scheduling_policy == "priority" else 0
    req = Request(req_id, list(spec["prompt"]), SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True), [EOS],
                  float(req_id[1:]), priority=priority)
    try:
        sched.add_request(req)
    except InvalidRequestError:
        num_prompt = len(req.prompt_token_ids)
        unsplit = not sched.enable_chunked_prefill and num_prompt > sched.max_num_batched_tokens
        assert num_prompt > sched.max_seq_len - 1 or unsplit
        return None
    return req


def _req(arrival: int, prompt: list[int], max_tokens: int, priority: int, abort: tuple | None = None) -> dict:
    return {"arrival": arrival, "prompt": prompt, "max_tokens": max_tokens, "priority": priority, "abort": abort}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    num_gpu_blocks=st.integers(4, 8),
    num_cpu_blocks=st.sampled_from([0, 1, 2, 3, 4, 6, 16]),
    block_size=st.sampled_from([2, 2, 4]),
    budget=st.sampled_from([6, 16, 64]),
    max_num_seqs=st.integers(2, 4),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix_caching=st.booleans(),
    chunked=st.booleans(),
)
@example(  # r0 is swapped out mid-prefill (6 tokens) for r1 (priority 0), which computes the shared prompt on to 12:
    # r0 resumes with those 12 from the prefix cache (more than its swapped copy), nothing copied in
    reqs=[_req(0, LONG, 3, 1), _req(1, LONG + [5], 3, 0)], num_gpu_blocks=12, num_cpu_blocks=8, block_size=2,
    budget=6, max_num_seqs=4, policy="priority", prefix_caching=True, chunked=True,
)
@example(  # r3 is swapped in to blocks [1, 0]; r4 (the same prompt), admitted after it, hits block 1 being copied in
    reqs=[_req(0, [0], 3, 0), _req(0, [0], 3, 1), _req(1, [0, 0, 0], 3, 0), _req(0, [1, 2, 0], 3, 0),
          _req(0, [1, 2, 0], 3, 0)],
    num_gpu_blocks=4, num_cpu_blocks=2, block_size=2, budget=6, max_num_seqs=2, policy="priority",
    prefix_caching=True, chunked=False,
)
@example(  # r1 is swapped out at step 3 and aborted at step 4, between steps: its 2 CPU blocks are free at once
    reqs=[_req(0, STEM[:6], 10, 0), _req(0, STEM[:5] + [2], 4, 0, (4, False))], num_gpu_blocks=4,
    num_cpu_blocks=16, block_size=4, budget=64, max_num_seqs=4, policy="fcfs", prefix_caching=False, chunked=True,
)
@example(  # r1 is aborted while the step that swaps it out runs
    reqs=[_req(0, STEM[:6], 10, 0), _req(0, STEM[:5] + [2], 4, 0, (3, True))], num_gpu_blocks=4,
    num_cpu_blocks=16, block_size=4, budget=64, max_num_seqs=4, policy="fcfs", prefix_caching=False, chunked=True,
)
@example(  # r1's 2 computed blocks do not fit 1 CPU block: recompute, nothing copied, r1 resumes from 0
    reqs=[_req(0, STEM[:6], 10, 0), _req(0, STEM[:5] + [2], 4, 0)], num_gpu_blocks=4,
    num_cpu_blocks=1, block_size=4, budget=64, max_num_seqs=4, policy="fcfs", prefix_caching=False, chunked=True,
)
def test_swap_preemption_follows_the_model(reqs, num_gpu_blocks, num_cpu_blocks, block_size, budget, max_num_seqs,
                                           policy, prefix_caching, chunked):
    run(reqs, num_gpu_blocks, num_cpu_blocks, block_size, budget, max_num_seqs, policy, prefix_caching, chunked)
