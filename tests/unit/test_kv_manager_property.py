"""`KVCacheManager` under drawn scheduler-like operations (hypothesis), against a model in plain dicts.

`tests/unit/test_block_pool_property.py` holds the pool's free-queue order; this test holds the manager's contract
at the level the scheduler calls it (asyncllm/sched/schedule_waiting.py, schedule_each.py, decode_step.py,
preemption.py). Drawn: 2 to 8 blocks of 2 or 3 tokens, prompts over tokens 0-1 sharing a stem, and a list of
operations: admit a prompt (with a cache salt, sometimes with prompt logprobs, so skipping cache reads) as
`get_computed_blocks` then `allocate_slots` for its hits and a first chunk, then `cache_full_blocks` up to the
chunk's end (one without room waits and is retried later, as the queue's head is); schedule the running requests'
next prefill chunks or decodes (by `allocate_slots` as `schedule_each` does, or `append_decode_blocks` /
`cache_decode_blocks` as the bulk decode step does); run the step (the scheduled tokens become computed, a finished
prompt samples a token, a request past its output limit is freed); a whole prompt in one step, then freed; free a
request (an abort may come before its step ran); preempt one (freed, recomputed from 0 when readmitted);
`reset_prefix_cache` between steps; and `holders_of`. Four configurations: no prefix caching, prefix caching, a CPU
tier (`CPUPrefixCache`, large enough never to evict) and saved states (`StateCheckpoints`, enough slots never to
replace one; hybrids refuse the CPU tier, so the two are not combined).

The model (docs/scheduling.md "Prefix caching", "CPU offloading", "Prompt sharing in one step";
docs/hybrid-models.md#prefix-caching; the modules' docstrings) is a dict from a block-aligned salted token prefix
to the block registered for it, each request's block table (built from the ids the manager returns, so the model
follows which blocks get evicted without predicting the pool's queue), the prefixes held by the CPU tier and the
saved points. Checked after every call: a lookup's hit is the longest cached prefix of whole blocks that leaves the
last token out (continued by the CPU tier, cut back to the last saved point), the salt separates, a request skipping
reads gets none; its blocks hold exactly those tokens; `allocate_slots` returns None exactly when the free blocks do
not suffice, changing nothing; every table holds cdiv(scheduled tokens, block_size) blocks; free blocks are the
blocks no table holds; the blocks registered for a step that never ran leave the cache; the step's copies out and
in; the hit counters; and `holders_of`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm import protocol
from asyncllm.kv.manager import KVCacheManager
from asyncllm.kv.offload import CPUPrefixCache
from asyncllm.kv.state_checkpoints import StateCheckpoints
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request

SALTS = (None, None, None, "", "t")
MODES = ("off", "plain", "offload", "ckpt")
CPU_BLOCKS = 512
ADMIT, READMIT, ADVANCE, STEP, FREE, PREEMPT, RESET, HOLDERS, ONESHOT, TICK = range(10)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Live:
    """One request as the driver sees it: the real `Request` and what is scheduled for the step being built."""

    def __init__(self, request: Request, max_out: int) -> None:
        self.request = request
        self.max_out = max_out
        self.pending = 0
        self.new = False
        """Admitted in the step being built."""
        self.reg = 0
        """Leading blocks of its table registration was tried for (the manager's `_num_cached_blocks`)."""


class Driver:
    def __init__(self, num_blocks: int, bs: int, mode: str, per_point: int) -> None:
        self.bs, self.mode, self.per_point, self.total = bs, mode, per_point, num_blocks
        self.caching = mode != "off"
        offload = CPUPrefixCache(100, CPU_BLOCKS) if mode == "offload" else None
        ckpt = StateCheckpoints(bs * per_point, bs, 4096) if mode == "ckpt" else None
        self.kv = KVCacheManager(num_blocks, bs, self.caching, checkpoints=ckpt, offload=offload)
        self.running: list[Live] = []
        self.waiting: list[Live] = []
        self.cache: dict[tuple, int] = {}
        """(salt, prefix tokens) -> the block registered for it."""
        self.key_of: dict[int, tuple] = {}
        self.cpu: set[tuple] = set()
        self.saved: set[tuple] = set()
        self.copies_out: list[int] = []
        self.loads: list[int] = []
        self.counters = [0, 0, 0, 0]  # queries, hits, cpu hits, preempted hits
        self.serial = 0

    # ------------------------------------------------------------ model helpers
    def key(self, request: Request, index: int) -> tuple:
        return request.cache_salt, tuple(request.all_token_ids[: (index + 1) * self.bs])

    def held(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for live in self.running:
            for block_id in self.kv.get_block_ids(live.request.request_id):
                refs[block_id] = refs.get(block_id, 0) + 1
        return refs

    def expected_hit(self, request: Request) -> tuple[list[int], int]:
        """GPU hit ids and CPU hit count, from the model."""
        if not self.caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.bs
        gpu = []
        while len(gpu) < max_blocks and self.key(request, len(gpu)) in self.cache:
            gpu.append(self.cache[self.key(request, len(gpu))])
        num = len(gpu)
        while self.mode == "offload" and num < max_blocks and self.key(request, num) in self.cpu:
            num += 1
        if self.mode == "ckpt":
            num = num // self.per_point * self.per_point
            while num and self.key(request, num - 1) not in self.saved:
                num -= self.per_point
            gpu = gpu[:num]
        return gpu, num - len(gpu)

    def register(self, live: Live, end_token: int) -> None:
        """What `cache_full_blocks(request, end_token)` registers: each block not yet tried, unless its prefix is
        held by another block."""
        if not self.caching:
            return
        table = self.kv.get_block_ids(live.request.request_id)
        end = min(end_token // self.bs, len(table))
        for index in range(live.reg, end):
            block_id, key = table[index], self.key(live.request, index)
            if block_id not in self.key_of and key not in self.cache:
                self.cache[key], self.key_of[block_id] = block_id, key
        live.reg = max(live.reg, end)

    def uncache(self, block_id: int) -> None:
        key = self.key_of.pop(block_id, None)
        if key is not None:
            del self.cache[key]

    def take_new(self, new_ids: list[int], refs: dict[int, int]) -> None:
        """Blocks handed out: they were free, and what a cached one held is evicted (to the CPU tier)."""
        assert len(set(new_ids)) == len(new_ids), new_ids
        for block_id in new_ids:
            assert not refs.get(block_id), (block_id, refs)
            key = self.key_of.get(block_id)
            if key is not None and self.mode == "offload" and key not in self.cpu:
                self.cpu.add(key)
                self.copies_out.append(block_id)
            self.uncache(block_id)

    # ------------------------------------------------------------ operations
    def admit(self, live: Live, chunk: int) -> None:
        request, bs = live.request, self.bs
        exp_gpu, exp_cpu = self.expected_hit(request)
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert [b.block_id for b in hits] == exp_gpu and num_hit == (len(exp_gpu) + exp_cpu) * bs, (
            [b.block_id for b in hits], num_hit, exp_gpu, exp_cpu)
        for index, block in enumerate(hits):
            assert block.token_ids == tuple(request.all_token_ids[index * bs : (index + 1) * bs])
        assert num_hit < request.num_tokens
        chunk = min(chunk, request.num_tokens - num_hit)
        refs = self.held()
        needed = cdiv(num_hit + chunk, bs) - len(hits) + sum(1 for b in exp_gpu if not refs.get(b))
        before = (self.kv.num_free_blocks, self.kv.prefix_cache_queries, self.kv.prefix_cache_hits)
        ids = self.kv.allocate_slots(request, num_hit - len(hits) * bs + chunk, hits)
        if ids is None:
            assert needed > self.total - len(refs), (needed, refs)
            assert (self.kv.num_free_blocks, self.kv.prefix_cache_queries, self.kv.prefix_cache_hits) == before
            assert request.request_id not in self.kv.req_to_blocks
            return
        assert needed <= self.total - len(refs), (needed, refs)
        assert ids[: len(hits)] == exp_gpu and len(ids) == cdiv(num_hit + chunk, bs), ids
        self.take_new(ids[len(hits):], refs)
        self.loads += ids[len(hits) : len(hits) + exp_cpu]
        live.reg = len(hits)
        for _ in range(exp_cpu):  # loaded from the CPU tier: registered at once
            self.register(live, (live.reg + 1) * bs)
        self.count(request, (len(hits) + exp_cpu) * bs, exp_cpu * bs)
        request.num_computed_tokens = num_hit
        live.pending, live.new = chunk, True
        self.running.append(live)
        self.kv.cache_full_blocks(request, num_hit + chunk)
        self.register(live, num_hit + chunk)

    def count(self, request: Request, hit_tokens: int, cpu_tokens: int) -> None:
        if not self.caching or request.skip_reading_prefix_cache:
            return
        if request.num_preemptions:
            self.counters[3] += hit_tokens
        else:
            self.counters[0] += request.num_tokens
            self.counters[1] += hit_tokens
            self.counters[2] += cpu_tokens

    def advance(self, live: Live, chunk: int, bulk: bool) -> None:
        """Schedule a running request's next chunk, or its decode."""
        request, bs = live.request, self.bs
        computed = request.num_computed_tokens
        left = request.num_tokens - computed
        if live.pending or not left:
            return
        if left == 1:
            self.decode(live, bulk)
            return
        chunk = min(chunk, left)
        refs = self.held()
        needed = cdiv(computed + chunk, bs) - len(self.kv.get_block_ids(request.request_id))
        free = self.kv.num_free_blocks
        ids = self.kv.allocate_slots(request, chunk)
        assert (ids is None) == (needed > self.total - len(refs)), (ids, needed, refs)
        if ids is None:
            assert self.kv.num_free_blocks == free
            return
        self.take_new(ids, refs)
        live.pending = chunk
        self.kv.cache_full_blocks(request, computed + chunk)
        self.register(live, computed + chunk)

    def decode(self, live: Live, bulk: bool) -> None:
        request, bs = live.request, self.bs
        computed, req_id = request.num_computed_tokens, request.request_id
        slot = computed % bs
        refs = self.held()
        short = self.total == len(refs)
        if slot == 0:  # its token starts a block
            new_ids: dict[str, list[int]] = {}
            if bulk:
                got = self.kv.append_decode_blocks([request], [computed], new_ids)
                assert got == (0 if short else 1), (got, short)
                ids = None if short else new_ids[req_id]
            else:
                ids = self.kv.allocate_slots(request, 1)
                assert (ids is None) == short, (ids, short)
            if ids is None:
                return
            assert len(ids) == 1, ids
            self.take_new(ids, refs)
        if (computed + 1) % bs == 0:  # its token fills the block
            if bulk:
                self.kv.cache_decode_blocks([request], [computed + 1])
            else:
                self.kv.cache_full_blocks(request, computed + 1)
            self.register(live, computed + 1)
        live.pending = 1

    def step(self, token: int) -> None:
        """The step runs: saved points planned, the scheduled tokens computed, finished prompts sample a token."""
        scheduled = [live for live in self.running if live.pending]
        if self.mode == "ckpt":
            self.plan(scheduled)
        out, loads = self.kv.take_offload_copies()
        assert [gpu for gpu, _ in out] == self.copies_out and [gpu for gpu, _ in loads] == self.loads, (out, loads)
        self.copies_out, self.loads = [], []
        for live in scheduled:
            request = live.request
            request.num_computed_tokens += live.pending
            live.pending, live.new = 0, False
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token(token)
                if request.num_tokens - request.num_prompt_tokens > live.max_out:  # finished: max_tokens
                    self.free(live)

    def plan(self, scheduled: list[Live]) -> None:
        new = [live for live in scheduled if live.new]
        cached = [live for live in scheduled if not live.new]
        num = {live.request.request_id: live.pending for live in scheduled}
        out = protocol.SchedulerOutput(
            step_id=0,
            new_reqs=[protocol.NewRequestData(req_id=live.request.request_id, token_ids=[], num_prompt_tokens=0,
                                              params=SamplingParams(), block_ids=[],
                                              num_computed_tokens=live.request.num_computed_tokens) for live in new],
            cached_reqs=protocol.CachedRequestData(req_ids=[live.request.request_id for live in cached],
                                                   num_computed_tokens=[live.request.num_computed_tokens
                                                                        for live in cached]),
            num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num.values()), spec_token_ids={})
        self.kv.checkpoints.plan(out, {live.request.request_id: live.request for live in scheduled})
        grid = self.bs * self.per_point
        for live in scheduled:
            computed = live.request.num_computed_tokens
            for point in range((computed // grid + 1) * grid, computed + live.pending + 1, grid):
                self.saved.add(self.key(live.request, point // self.bs - 1))

    def free(self, live: Live) -> None:
        request = live.request
        table = self.kv.get_block_ids(request.request_id)
        for block_id in table[request.num_computed_tokens // self.bs : live.reg]:  # their step never ran
            self.uncache(block_id)
        self.kv.free(request)
        self.running.remove(live)
        assert request.request_id not in self.kv.req_to_blocks

    def holders(self, mask: int, first: int) -> None:
        firsts = {live.request.request_id: first for i, live in enumerate(self.running) if mask >> i & 1}
        owner = {}
        for req_id, start in firsts.items():
            for block_id in self.kv.get_block_ids(req_id)[start:]:
                owner[block_id] = req_id
        expected = {}
        for live in self.running:
            req_id = live.request.request_id
            if req_id in firsts:
                continue
            for block_id in self.kv.get_block_ids(req_id):
                if block_id in owner:
                    expected[req_id] = owner[block_id]
                    break
        assert self.kv.holders_of(firsts) == expected, (firsts, expected)

    def reset(self) -> None:
        self.kv.reset_prefix_cache()
        self.cache.clear()
        self.key_of.clear()
        self.cpu.clear()
        self.saved.clear()

    # ------------------------------------------------------------ checks after every operation
    def check(self) -> None:
        refs = self.held()
        assert self.kv.num_free_blocks == self.total - len(refs), (self.kv.num_free_blocks, refs)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), block
        assert set(self.kv.req_to_blocks) == {live.request.request_id for live in self.running}
        for live in self.running:
            request = live.request
            table = self.kv.get_block_ids(request.request_id)
            assert len(table) == cdiv(request.num_computed_tokens + live.pending, self.bs), (table, request)
        for key, block_id in self.cache.items():
            block = self.kv.pool.blocks[block_id]
            assert block.token_ids == key[1][-self.bs:], (key, block)
        assert sum(1 for b in self.kv.pool.blocks if b.block_hash is not None) == len(self.cache)
        kv = self.kv
        got = [kv.prefix_cache_queries, kv.prefix_cache_hits, kv.cpu_prefix_cache_hits, kv.preempted_prefix_cache_hits]
        assert got == self.counters, (got, self.counters)
        for i in range(len(self.running)):
            self.holders(1 << i, 1)

    def run(self, prompts: list[list[int]], op: tuple[int, int, int, int]) -> None:
        kind, a, b, c = op
        if kind in (ADMIT, ONESHOT):
            salt, skip = SALTS[b % 5], b >= 6
            params = SamplingParams(prompt_logprobs=1) if skip else SamplingParams()
            self.serial += 1
            request = Request(f"r{self.serial}", list(prompts[a % len(prompts)]), params, [0], 0.0, cache_salt=salt)
            live = Live(request, a // 8)
            self.admit(live, request.num_tokens if kind == ONESHOT else c)
            if live not in self.running:  # too few free blocks: it waits at the queue's head, retried later
                self.waiting.append(live)
            elif kind == ONESHOT:  # its whole prompt in one step, then it finishes
                self.step(a % 2)
                if live in self.running:
                    self.free(live)
        elif kind == READMIT and self.waiting:
            live = self.waiting[a % len(self.waiting)]
            self.waiting.remove(live)
            self.admit(live, c)
            if live not in self.running:
                self.waiting.append(live)
        elif kind in (ADVANCE, TICK):  # every running request's next chunk or decode, from the a-th on
            for live in self.running[a % max(len(self.running), 1):] + self.running[: a % max(len(self.running), 1)]:
                self.advance(live, c, bool(b % 2))
            if kind == TICK:  # and the step runs
                self.step(a % 2)
        elif kind in (FREE, PREEMPT) and self.running:
            live = self.running[a % len(self.running)]
            if kind == FREE:
                self.free(live)
            elif not live.pending:  # preemption takes a request this step has not scheduled
                self.free(live)
                live.request.num_computed_tokens = 0
                live.request.num_preemptions += 1
                live.reg = 0
                self.waiting.append(live)
        elif kind == STEP:
            self.step(a % 2)
        elif kind == RESET:  # between steps (the core's message loop), after the step's copies were taken
            self.step(a % 2)
            self.reset()
        elif kind == HOLDERS:
            self.holders(a, b % 3)
        self.check()


def run_case(config: tuple[int, int, str, int], stem: list[int], tails: list[tuple[int, list[int]]],
             ops: list[tuple[int, int, int, int]]) -> None:
    num_blocks, bs, mode, per_point = config
    prompts = [stem[:cut] + tail or [0] for cut, tail in tails]
    driver = Driver(num_blocks, bs, mode, per_point)
    for op in ops:
        driver.run(prompts, op)
    for live in list(driver.running):
        driver.free(live)
    assert driver.kv.num_free_blocks == num_blocks and driver.kv.num_used_blocks == 0


configs = st.tuples(st.integers(2, 8), st.sampled_from([2, 3]), st.sampled_from(MODES), st.integers(1, 2))
prompt_cuts = st.lists(st.tuples(st.integers(3, 12), st.lists(st.integers(0, 1), max_size=3)), min_size=1, max_size=3)
KINDS = [ADMIT, TICK, ADVANCE, STEP, READMIT, ONESHOT, FREE, ADMIT, TICK, ONESHOT, READMIT, TICK, PREEMPT, HOLDERS,
         RESET]
operations = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 15), st.integers(0, 7), st.integers(1, 9)),
                      min_size=12, max_size=50)
EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "300"))


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@given(configs, st.lists(st.integers(0, 1), min_size=4, max_size=12), prompt_cuts, operations)
@example((8, 2, "plain", 1), [1, 2, 3, 4, 5], [(5, [])], [(ADMIT, 0, 0, 9), (STEP, 0, 0, 1), (ADMIT, 0, 0, 9)])
# A retried admission whose lookup now finds no CPU block after its GPU hits loads none (a stale earlier lookup's)
@example((4, 2, "offload", 1), [0, 1, 0, 1, 0, 1, 1], [(5, []), (7, []), (0, [1] * 7), (0, [1])],
         [(ONESHOT, 0, 0, 1), (ONESHOT, 2, 0, 1), (ADMIT, 3, 0, 1), (ADMIT, 1, 0, 9), (ADMIT, 4, 0, 9), (FREE, 1, 0, 1),
          (FREE, 0, 0, 1), (READMIT, 0, 0, 9)])
# The CPU tier's blocks continue the GPU hits only up to its first miss (P1 on the GPU alone, P0 and P2 on the CPU)
@example((6, 2, "offload", 1), [0, 0, 1, 1, 0, 0, 1], [(5, []), (3, []), (7, []), (0, [1] * 5)],
         [(ADMIT, 8, 0, 1), (STEP, 0, 0, 1), (ADMIT, 1, 0, 9), (ADVANCE, 0, 0, 9), (STEP, 0, 0, 1), (ADMIT, 2, 0, 9),
          (STEP, 0, 0, 1), (ONESHOT, 3, 0, 1), (ADMIT, 2, 0, 9)])
# States saved before a reset are forgotten with it: a prompt registered again after it hits nothing
@example((8, 2, "ckpt", 1), [0, 1, 1, 0, 1], [(5, [])],
         [(ONESHOT, 0, 0, 1), (RESET, 0, 0, 1), (ADMIT, 0, 0, 9), (ADMIT, 0, 0, 9)])
# A preempted request readmitted on CPU-tier blocks: its hits go to preempted_prefix_cache_hits alone
@example((4, 2, "offload", 1), [0, 1, 0, 1, 0], [(5, []), (0, [1] * 7)],
         [(ADMIT, 8, 0, 9), (STEP, 0, 0, 1), (PREEMPT, 0, 0, 1), (ONESHOT, 1, 0, 1), (READMIT, 0, 0, 9)])
def test_kv_manager_matches_the_model(config, stem, tails, ops) -> None:
    run_case(config, stem, tails, ops)
