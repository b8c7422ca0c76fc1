"""`CPUPrefixCache` (the CPU tier of ``kv_offloading_size``) under drawn steps (hypothesis), driven as
`KVCacheManager` drives it.

Drawn: the tier's first id (the swap space's CPU blocks come before it) and size (1 to 5 blocks), a few prompts as
chains of block hashes (most sharing a stem), and steps, some after a reset (the manager resets between steps). A
step's calls are those the manager makes while one step is scheduled: a cached GPU block handed out again
(`BlockPool.on_evict` is `offload`, with the block's hash and tokens), and admissions: a drawn number of leading
blocks hit on the GPU, then `lookup` of the prompt's next blocks up to the first miss (one sometimes with other
tokens: the token re-check), then, when the request fits, its new GPU blocks handed out (some evicting a cached
block: `offload`) and each CPU hit loaded into one of them (`load`); and a block loaded this step handed out again
before the step ends. `take_copies` ends every step.

`Model` is the module docstring's rules in plain lists: an offload of a hash held already is no copy (and counts as
recent); else it takes a free CPU block (lowest id first) or the block of the least recently offloaded or hit entry
not pinned, or, when every entry is pinned, is dropped; an entry hit or written in the step is pinned until its
copies are taken; `reset` forgets all. After every call the tier must equal the model, observed through its public
calls on copies of it (`lookup` of every hash; the CPU blocks that offloads of new hashes would take next, before
and after the step's copies are taken): which hash each CPU block holds, the LRU order, the free blocks, the pinned
ones, the copies listed so far. Checked on their own too: every id in [first_id, first_id + size); an entry hit or
written in a step holds its CPU block the whole step; no CPU block is written twice in a step, and a block read in
a step was written in it, if at all, with the very hash read; a block loaded this step and handed out again is no
copy out (its KV arrives only with the step's copies in). A simulated worker applies each step's copies (every
copy out, then every copy in): each load must bring the hash it was looked up for, and after the step every CPU
block must hold the hash the tier keys it by.
Explicit cases reach what drawn ones seldom do: a block offloaded and hit in one step (written, then read: the copy
out comes first), evictions dropped while every entry is pinned, a hit beside a miss on other tokens (no pin), a
loaded block handed out again in its step, and ids from first_id again after a reset.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.kv.offload import CPUPrefixCache

NUM_HASHES = 6
NUM_GPU_BLOCKS = 16
"""GPU blocks a step can hand out (ids reused from step to step)."""
PLAIN = -1
"""What a plain GPU block (no cached block's KV) holds at the start of a step."""


def digest(h: int) -> bytes:
    return b"block-%d" % h


def tokens_of(h: int) -> tuple[int, ...]:
    return (h, 7 * h + 1)


class Model:
    """The tier's rules in plain lists."""

    def __init__(self, first_id: int, num_blocks: int) -> None:
        self.ids = list(range(first_id, first_id + num_blocks))
        self.reset()

    def reset(self) -> None:
        self.free = list(self.ids)
        """Free CPU blocks, taken lowest id first."""
        self.lru: list[tuple[int, int]] = []
        """(hash, CPU block), least recently offloaded or hit first."""
        self.pinned: set[int] = set()
        self.out: list[list[int]] = []
        self.in_: list[list[int]] = []

    def held(self, h: int) -> int | None:
        return next((c for k, c in self.lru if k == h), None)

    def offload(self, g: int, h: int) -> None:
        c = self.held(h)
        if c is not None:  # its KV is here already: no copy, but recent
            self.lru.remove((h, c))
            self.lru.append((h, c))
            return
        if self.free:
            c = self.free.pop(0)
        else:
            victims = [entry for entry in self.lru if entry[1] not in self.pinned]
            if not victims:
                return
            self.lru.remove(victims[0])
            c = victims[0][1]
        self.lru.append((h, c))
        self.pinned.add(c)
        self.out.append([g, c])

    def lookup(self, h: int, same_tokens: bool) -> int | None:
        c = self.held(h)
        if c is None or not same_tokens:
            return None
        self.lru.remove((h, c))
        self.lru.append((h, c))
        self.pinned.add(c)
        return c

    def take(self) -> tuple[list[list[int]], list[list[int]]]:
        copies = self.out, self.in_
        self.out, self.in_, self.pinned = [], [], set()
        return copies


@dataclass
class Step:
    """What the manager and the workers know of the step being scheduled."""

    gpu: dict[int, int] = field(default_factory=dict)
    """GPU block handed out this step -> what it holds at the step's start (what a copy out of it reads)."""
    loaded: dict[int, int] = field(default_factory=dict)
    """GPU block -> the hash loaded into it this step."""
    handed_again: set[int] = field(default_factory=set)
    pins: dict[int, int] = field(default_factory=dict)
    """CPU block -> the hash this step hits or writes there (it must stay there until the copies are taken)."""

    def hand_out(self, content: int) -> int:
        g = len(self.gpu)
        self.gpu[g] = content
        return g


class Op(NamedTuple):
    kind: str
    """"evict" (a cached GPU block handed out), "admit", or "again" (a block loaded this step handed out again)."""
    pick: int = 0
    """evict: the hash; admit: the prompt; again: which loaded block."""
    num_gpu_hits: int = 0
    """admit: its leading blocks hit on the GPU (not looked up here)."""
    wrong_at: int = -1
    """admit: the block looked up with other tokens (-1: none)."""
    fits: bool = True
    """admit: whether its new blocks fit (else only its lookups happen)."""
    evicted: tuple[int | None, ...] = ()
    """admit: the hash each of its new GPU blocks evicts (None, or past the end: a plain block)."""
    extra: int = 0
    """admit: its new blocks past those loaded from the CPU tier."""


def next_takes(tier: CPUPrefixCache, unpin: bool) -> list[int]:
    """The CPU blocks that offloads of new hashes would take, in order, until one finds none (on a copy)."""
    probe = copy.deepcopy(tier)
    if unpin:
        probe.take_copies()
    taken = []
    for k in range(tier.num_blocks + 1):
        num = len(probe.offloads)
        probe.offload(NUM_GPU_BLOCKS + k, b"new-%d" % k, (k,))
        if len(probe.offloads) == num:
            break
        taken.append(probe.offloads[-1][1])
    return taken


def check(tier: CPUPrefixCache, model: Model, step: Step) -> None:
    probe = copy.deepcopy(tier)
    held = {h: c for h in range(NUM_HASHES) if (c := probe.lookup(digest(h), tokens_of(h))) is not None}
    assert held == dict(model.lru)
    pinned_takes, takes = next_takes(tier, unpin=False), next_takes(tier, unpin=True)
    assert pinned_takes == model.free + [c for _, c in model.lru if c not in model.pinned]  # free, then unpinned LRU
    assert takes == model.free + [c for _, c in model.lru]  # with `held`: the LRU order of the hashes
    assert sorted(takes) == model.ids  # every CPU block free or held, ids in [first_id, first_id + size)
    assert tier.num_used_blocks == len(model.lru)
    assert (tier.offloads, tier.loads) == (model.out, model.in_)
    for c, h in step.pins.items():  # hit or written this step: never evicted before the copies are taken
        assert held.get(h) == c, (h, c, held)


def evict(tier: CPUPrefixCache, model: Model, step: Step, h: int, g: int) -> None:
    num = len(model.out)
    tier.offload(g, digest(h), tokens_of(h))
    model.offload(g, h)
    if len(model.out) > num:
        step.pins[model.out[-1][1]] = h
    check(tier, model, step)


def admit(tier: CPUPrefixCache, model: Model, step: Step, prompt: list[int], op: Op) -> None:
    """`get_computed_blocks` (its CPU lookups after the GPU hits), then `allocate_slots` and its loads."""
    hits: list[tuple[int, int]] = []
    for index in range(min(op.num_gpu_hits, len(prompt)), len(prompt)):
        h, same = prompt[index], index != op.wrong_at
        c = tier.lookup(digest(h), tokens_of(h) if same else (h, -1))
        assert c == model.lookup(h, same), (index, h, same)
        if c is None:
            check(tier, model, step)
            break
        step.pins[c] = h
        hits.append((h, c))
        check(tier, model, step)
    num_new = len(hits) + op.extra
    if not op.fits or len(step.gpu) + num_new > NUM_GPU_BLOCKS:
        return  # `allocate_slots` finds too few free blocks and changes nothing
    blocks = []
    for i in range(num_new):
        evicted = op.evicted[i] if i < len(op.evicted) else None
        g = step.hand_out(PLAIN if evicted is None else evicted)
        if evicted is not None:
            evict(tier, model, step, evicted, g)
        blocks.append(g)
    for (h, c), g in zip(hits, blocks):
        tier.load(c, g)
        model.in_.append([g, c])
        step.loaded[g] = h
        check(tier, model, step)


def hand_out_again(tier: CPUPrefixCache, model: Model, step: Step, pick: int) -> None:
    """A GPU block loaded this step, registered with its hash, freed and handed out again in the same step."""
    candidates = [g for g in step.loaded if g not in step.handed_again]
    if not candidates:
        return
    g = candidates[pick % len(candidates)]
    step.handed_again.add(g)
    num = len(model.out)
    evict(tier, model, step, step.loaded[g], g)
    assert len(model.out) == num  # its hash is held and pinned: no copy out of a block filled only by a copy in


def end_step(tier: CPUPrefixCache, model: Model, step: Step, memory: dict[int, int]) -> None:
    """`take_copies`, then the workers: every copy out, then every copy in."""
    out, in_ = tier.take_copies()
    assert (out, in_) == model.take()
    written = {c: step.gpu[g] for g, c in out}
    assert len(written) == len(out), out  # no CPU block written twice in a step
    for g, c in in_:  # a block read this step was written in it, if at all, with the very hash read
        assert written.get(c, step.loaded[g]) == step.loaded[g], (g, c, written)
    for g, c in out:
        memory[c] = step.gpu[g]
    for g, c in in_:
        assert memory.get(c) == step.loaded[g], (g, c)
    for h, c in model.lru:
        assert memory.get(c) == h, (h, c)
    assert tier.take_copies() == ([], [])
    check(tier, model, Step())


def run(first_id: int, num_blocks: int, prompts: list[list[int]], steps: list[tuple[bool, list[Op]]]) -> None:
    tier, model = CPUPrefixCache(first_id, num_blocks), Model(first_id, num_blocks)
    memory: dict[int, int] = {}
    """CPU block -> the hash whose KV the workers hold there."""
    check(tier, model, Step())
    for reset, ops in steps:
        if reset:
            tier.reset()
            model.reset()
            check(tier, model, Step())
        step = Step()
        for op in ops:
            if op.kind == "evict":
                if len(step.gpu) < NUM_GPU_BLOCKS:
                    evict(tier, model, step, op.pick, step.hand_out(op.pick))
            elif op.kind == "admit":
                admit(tier, model, step, prompts[op.pick % len(prompts)], op)
            else:
                hand_out_again(tier, model, step, op.pick)
        end_step(tier, model, step, memory)


HASHES = st.integers(0, NUM_HASHES - 1)
EVICT = st.builds(Op, st.just("evict"), HASHES)
ADMIT = st.builds(Op, st.just("admit"), st.integers(0, 3), st.sampled_from([0, 0, 1, 2]), st.integers(-1, 4),
                  st.sampled_from([True, True, True, False]), st.lists(st.none() | HASHES, max_size=5).map(tuple),
                  st.integers(0, 2))
OPS = st.one_of(EVICT, ADMIT, EVICT, ADMIT, st.builds(Op, st.just("again"), st.integers(0, 5)))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, list[list[int]], list[tuple[bool, list[Op]]]]:
    first_id, num_blocks = draw(st.integers(0, 6)), draw(st.integers(1, 5))
    stem = draw(st.lists(HASHES, unique=True, max_size=3))
    suffixes = draw(st.lists(st.lists(HASHES, unique=True, min_size=1, max_size=4), min_size=1, max_size=3))
    prompts = [[h for h in s if h not in stem] if draw(st.booleans()) else stem + [h for h in s if h not in stem]
               for s in suffixes]
    prompts = [p or s for p, s in zip(prompts, suffixes)]
    steps = draw(st.lists(st.tuples(st.integers(0, 5).map(lambda k: k == 0), st.lists(OPS, max_size=7)),
                          min_size=1, max_size=8))
    return first_id, num_blocks, prompts, steps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
# offloaded, then hit in the same step: the CPU block is written and read in one step, the write (a copy out) first
@example(case=(3, 2, [[0, 1]], [(False, [Op("evict", 0), Op("evict", 1), Op("admit", 0, evicted=(2, 3))])]))
# every entry hit this step: its evictions find no block and are dropped; then a hit and a miss on other tokens (no
# pin) leave the other entry least recent, so the next eviction takes its block
@example(case=(0, 2, [[0, 1]], [(False, [Op("evict", 0), Op("evict", 1)]),
                                (False, [Op("admit", 0, evicted=(2, 3))]),
                                (False, [Op("admit", 0, wrong_at=1, fits=False), Op("evict", 4)])]))
# a block loaded this step handed out again: no copy out of it (its KV comes with this step's copies in)
@example(case=(5, 1, [[0]], [(False, [Op("evict", 0)]), (False, [Op("admit", 0, evicted=(1,)), Op("again")])]))
# a reset frees every block: ids from first_id again
@example(case=(2, 3, [[0, 1, 2]], [(False, [Op("evict", 0), Op("evict", 1)]),
                                   (True, [Op("evict", 2), Op("admit", 0, extra=1)])]))
def test_the_cpu_tier_matches_a_model_of_its_entries_lru_pins_and_copies(case) -> None:
    run(*case)
