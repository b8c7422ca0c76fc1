"""`StateCheckpoints` under drawn steps (hypothesis), driven as the scheduler and `KVCacheManager` drive it.

Drawn: the block size, the points' spacing (``mamba_block_size``), the slots, sync or async scheduling, and a
few requests, some sharing a prefix (their block hashes equal up to a drawn block); then steps of prefix-cache
lookups (a drawn number of hit blocks, `cut_hit`), admissions (on the cut hit, or cold), prefill chunks, decodes
with drafts (some accepted), tokens arriving late (async: the block ending at a decode's token has no hash until
then), preemptions, finished requests and resets, each step closed by `plan`.

Checked at every call against `Model`, the module docstring's rules written naively (plain lists and sets): what
each lookup is cut back to, the slot each admitted request loads, each step's saves (points, and slots: a free one
if any, else the least recently saved or hit point's; never a slot this step saved into; none inside drafts), and
when late saves are keyed (by the third plan after theirs) or released. `Workers` plays the workers, loads before
saves in each step: every load must find the states of the very point it resumes from, so no slot is overwritten
while something still reads it.
Explicit cases reach what drawn ones seldom do: two late saves of one point (one keyed, one freed), a hash keyed
by the third plan after its save or arriving after its slot was freed, a reset while a save waits for its hash, and
a cold admission after a hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm import protocol
from asyncllm.kv.state_checkpoints import StateCheckpoints
from asyncllm.sampling import SamplingParams

WAIT_PLANS = 3
"""A save whose block has no hash yet is keyed by any plan up to the third after its own that finds the hash;
that third plan frees its slot if the hash is still missing."""
MAX_TOKENS = 24


@dataclass
class Req:
    """A drawn request; the checkpoints read its `request_id` and `block_hashes` (hashes of its known blocks)."""

    request_id: str
    family: str
    diverge: int
    """Its first block that no other request of its family shares."""
    num_tokens: int
    block_size: int
    computed: int = 0
    confirmed: int = 0
    """Tokens whose ids are known (async scheduling: sampled tokens arrive later)."""
    running: bool = False
    block_hashes: list[bytes] = field(default_factory=list)

    def hash_of(self, index: int) -> bytes:
        owner = self.family if index < self.diverge else self.request_id
        return f"{owner}/{index}".encode()

    def confirm(self, num_tokens: int) -> None:
        self.confirmed = max(self.confirmed, num_tokens)
        while len(self.block_hashes) < self.confirmed // self.block_size:
            self.block_hashes.append(self.hash_of(len(self.block_hashes)))


@dataclass
class Scheduled:
    request: Req
    computed: int
    num_new: int
    num_drafts: int = 0
    num_accepted: int = 0


class Model:
    """The saved points and slots the docstring's rules give."""

    def __init__(self, grid: int, block_size: int, num_slots: int) -> None:
        self.grid, self.block_size, self.num_slots = grid, block_size, num_slots
        self.reset()

    def reset(self) -> None:
        self.saved: list[list] = []
        """[block hash, slot] of each usable point, least recently saved or hit first."""
        self.free = set(range(self.num_slots))
        self.loads: dict[str, int] = {}
        self.unkeyed: list[tuple[Req, int, int, int]] = []
        """(request, block index, slot, plan number) of saves waiting for their block's hash."""
        self.plans = 0

    def slot_of(self, block_hash: bytes) -> int | None:
        return next((slot for saved_hash, slot in self.saved if saved_hash == block_hash), None)

    def cut(self, request: Req, num_hits: int) -> int:
        """Back to the last saved point within the hit, which becomes the most recently used."""
        self.loads.pop(request.request_id, None)
        per_point = self.grid // self.block_size
        for num_blocks in reversed(range(per_point, num_hits + 1, per_point)):
            block_hash = request.block_hashes[num_blocks - 1]
            slot = self.slot_of(block_hash)
            if slot is not None:
                self.saved.remove([block_hash, slot])
                self.saved.append([block_hash, slot])
                self.loads[request.request_id] = slot
                return num_blocks
        return 0

    def plan(self, new: list[Scheduled], cached: list[Scheduled], actual: dict[str, list[list[int]]]):
        """The step's loads and saves; a free slot is the object's choice (``actual``) when that one is free."""
        self.plans += 1
        self._key_unkeyed()
        loads, self.loads = self.loads, {}
        expected_loads = {s.request.request_id: loads[s.request.request_id] for s in new
                          if s.computed and s.request.request_id in loads}
        this_step: list[list] = []
        saves = {}
        for s in new + cached:
            chosen = [slot for _, slot in actual.get(s.request.request_id, [])]
            points = self._points(s, this_step, chosen)
            if points:
                saves[s.request.request_id] = points
        self.saved += this_step
        return expected_loads, saves

    def _points(self, s: Scheduled, this_step: list[list], chosen: list[int]) -> list[list[int]]:
        points = []
        end = s.computed + s.num_new - s.num_drafts
        first = (s.computed // self.grid + 1) * self.grid
        for point in range(first, end + 1, self.grid):
            index = point // self.block_size - 1
            hashes = s.request.block_hashes
            block_hash = hashes[index] if index < len(hashes) else None
            if block_hash is not None and (self.slot_of(block_hash) is not None
                                           or block_hash in [h for h, _ in this_step]):
                continue
            slot = self._take_slot(chosen[len(points)] if len(points) < len(chosen) else None)
            if slot is None:
                break
            if block_hash is None:
                self.unkeyed.append((s.request, index, slot, self.plans))
            else:
                this_step.append([block_hash, slot])
            points.append([point, slot])
        return points

    def _take_slot(self, chosen: int | None) -> int | None:
        if self.free:
            slot = chosen if chosen in self.free else min(self.free)
            self.free.remove(slot)
            return slot
        if self.saved:
            return self.saved.pop(0)[1]
        return None

    def _key_unkeyed(self) -> None:
        waiting = []
        for request, index, slot, planned in self.unkeyed:
            if index < len(request.block_hashes):
                block_hash = request.block_hashes[index]
                if self.slot_of(block_hash) is None:
                    self.saved.append([block_hash, slot])
                else:
                    self.free.add(slot)
            elif self.plans - planned >= WAIT_PLANS:
                self.free.add(slot)
            else:
                waiting.append((request, index, slot, planned))
        self.unkeyed = waiting


class Workers:
    """What each slot holds once the steps ran: the hash of the block ending at the point whose states it has."""

    def __init__(self) -> None:
        self.slots: dict[int, bytes] = {}

    def run(self, out: protocol.SchedulerOutput, by_id: dict[str, Scheduled]) -> None:
        for req_id, slot in out.state_loads.items():  # every load before any save
            s = by_id[req_id]
            assert self.slots.get(slot) == s.request.hash_of(s.computed // s.request.block_size - 1), (req_id, slot)
        written = [slot for points in out.state_saves.values() for _, slot in points]
        assert len(written) == len(set(written)), out.state_saves
        for req_id, points in out.state_saves.items():
            request = by_id[req_id].request
            for point, slot in points:
                self.slots[slot] = request.hash_of(point // request.block_size - 1)


def scheduler_output(new: list[Scheduled], cached: list[Scheduled]) -> protocol.SchedulerOutput:
    scheduled = {s.request.request_id: s.num_new for s in new + cached}
    return protocol.SchedulerOutput(
        step_id=0,
        new_reqs=[protocol.NewRequestData(req_id=s.request.request_id, token_ids=[], num_prompt_tokens=0,
                                          params=SamplingParams(), block_ids=[], num_computed_tokens=s.computed)
                  for s in new],
        cached_reqs=protocol.CachedRequestData(req_ids=[s.request.request_id for s in cached],
                                               num_computed_tokens=[s.computed for s in cached]),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        spec_token_ids={s.request.request_id: [0] * s.num_drafts for s in cached if s.num_drafts})


class Driver:
    """One engine's core: builds steps from the drawn operations and checks each call."""

    def __init__(self, config: tuple[int, int, int, int]) -> None:
        """``config``: see `cases`."""
        self.block_size, per_point, num_slots, self.token_delay = config
        grid = self.block_size * per_point
        self.checkpoints = StateCheckpoints(grid, self.block_size, num_slots)
        self.model, self.workers = Model(grid, self.block_size, num_slots), Workers()
        self.requests: dict[str, Req] = {}
        self.num_added = self.num_steps = 0
        self.arrivals: list[tuple[int, Req, int]] = []
        """(step, request, tokens): async scheduling, a step's sampled tokens are known from that step on."""
        self.new: list[Scheduled] = []
        self.cached: list[Scheduled] = []
        self.touched: set[str] = set()

    def add(self, family: int, diverge: int, num_tokens: int) -> None:
        request = Req(f"r{self.num_added}", f"f{family % 2}", diverge, num_tokens, self.block_size)
        request.confirm(num_tokens)
        self.requests[request.request_id] = request
        self.num_added += 1

    def lookup(self, request: Req, a: int, b: int) -> None:
        """`get_computed_blocks`: ``a`` picks the GPU and CPU hit blocks, ``b`` whether and how it is admitted."""
        max_hits = min((request.num_tokens - 1) // request.block_size, len(request.block_hashes))
        num_hits = max_hits if a < 6 else a % (max_hits + 1)  # mostly every block the prefix cache could hold
        num_blocks = self.checkpoints.cut_hit(request, [object()] * num_hits)
        assert num_blocks == self.model.cut(request, num_hits), (request, num_hits)
        if b % 4:
            self.admit(request, num_blocks * request.block_size, b)

    def admit(self, request: Req, computed: int, b: int) -> None:
        request.running, request.computed = True, computed
        self.new.append(Scheduled(request, computed, 1 + b % (request.num_tokens - computed)))
        self.touched.add(request.request_id)

    def run(self, request: Req, a: int, b: int) -> None:
        """A prefill chunk, or a decode with drafts when its last token is known (some accepted)."""
        remaining = request.num_tokens - request.computed
        if remaining > 1:
            self.cached.append(Scheduled(request, request.computed, 1 + a % remaining))
        elif request.num_tokens < MAX_TOKENS:
            num_drafts = a % 3 if request.confirmed == request.num_tokens else 0
            self.cached.append(Scheduled(request, request.computed, 1 + num_drafts, num_drafts, b % (num_drafts + 1)))
        self.touched.add(request.request_id)

    def step(self) -> None:
        """`schedule()`'s end: `plan`, checked against the model; the workers run it; the requests advance."""
        self._arrive()
        out = scheduler_output(self.new, self.cached)
        self.checkpoints.plan(out, dict(self.requests))
        loads, saves = self.model.plan(self.new, self.cached, out.state_saves)
        assert (out.state_loads, out.state_saves) == (loads, saves)
        self.workers.run(out, {s.request.request_id: s for s in self.new + self.cached})
        for s in self.new + self.cached:
            self._advance(s)
        self.new, self.cached, self.touched = [], [], set()
        self.num_steps += 1

    def _arrive(self) -> None:
        due = [(request, num_tokens) for step, request, num_tokens in self.arrivals if step <= self.num_steps]
        self.arrivals = [arrival for arrival in self.arrivals if arrival[0] > self.num_steps]
        for request, num_tokens in due:
            request.confirm(num_tokens)

    def _advance(self, s: Scheduled) -> None:
        request = s.request
        request.computed = s.computed + s.num_new - s.num_drafts + s.num_accepted
        request.num_tokens += s.num_accepted
        if request.computed == request.num_tokens:
            request.num_tokens += 1  # the sampled token
        if self.token_delay:
            self.arrivals.append((self.num_steps + self.token_delay, request, request.num_tokens))
        else:
            request.confirm(request.num_tokens)

    def candidates(self, kind: str) -> list[Req]:
        untouched = [r for r in self.requests.values() if r.request_id not in self.touched]
        if kind in ("lookup", "cold"):
            return [r for r in untouched if not r.running]
        if kind in ("run", "preempt"):
            return [r for r in untouched if r.running]
        if kind == "arrive":
            return [r for r in self.requests.values() if r.confirmed < r.num_tokens]
        return untouched if kind == "finish" else []

    def apply(self, kind: str, index: int, a: int, b: int) -> None:
        candidates = self.candidates(kind)
        request = candidates[index % len(candidates)] if candidates else None
        if kind == "step":
            self.step()
        elif kind == "reset":
            self.step()
            self.checkpoints.reset()
            self.model.reset()
        elif kind == "add" and self.num_added < 8:
            self.add(index, a, 1 + b)
        elif request is None:
            return
        elif kind == "arrive":  # a token sooner than most
            request.confirm(request.num_tokens)
        elif kind == "lookup":
            self.lookup(request, a, b)
        elif kind == "cold":  # reads no prefix-cache block: no lookup
            self.admit(request, 0, b)
        elif kind == "run":
            self.run(request, a, b)
        elif kind == "preempt":
            request.running, request.computed = False, 0
            self.touched.add(request.request_id)
        elif kind == "finish":  # its late tokens never arrive
            del self.requests[request.request_id]
            self.arrivals = [arrival for arrival in self.arrivals if arrival[1] is not request]


KINDS = [*["add"] * 2, *["lookup"] * 4, *["run"] * 6, *["step"] * 4, *["preempt"] * 2,
         "arrive", "cold", "finish", "reset"]


ADD_3 = ("add", 0, 11, 2)  # a 3-token prompt of family 0, which shares all its blocks
STEP = ("step", 0, 0, 0)
RUN_BOTH = [("run", 0, 0, 0)] * 2
ADD_6 = ("add", 0, 11, 5)
LATE_HASH = [ADD_3, ADD_6, ("lookup", 0, 0, 2), STEP, ("run", 0, 0, 0), *[STEP] * 4, ("lookup", 0, 0, 3), STEP]


@st.composite
def cases(draw: st.DrawFn):
    """(block size, blocks between points, slots, token delay), operations (kind, which request, a, b). A step's
    sampled tokens are known ``token delay`` steps on (async scheduling: 2, stragglers more), at once if 0."""
    config = (draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])), draw(st.integers(1, 6)),
              draw(st.sampled_from([0, 0, 1, 2, 3, 4, 5])))
    op = st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(0, 11), st.integers(0, 11))
    return config, draw(st.lists(op, min_size=20, max_size=80))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
# async (tokens known two steps on): two requests sharing their prefix decode to 4 before token 3 is known, both
# saves wait for the hash; r0's later tokens come early; one is keyed, the other's slot freed and taken at 6
@example(case=((1, 2, 4, 2), [ADD_3, ADD_3, ("lookup", 0, 0, 2), ("lookup", 0, 0, 2), STEP, *RUN_BOTH, STEP,
                              ("arrive", 0, 0, 0), *RUN_BOTH, STEP, *RUN_BOTH, STEP]))
# r0's save at 4 waits for its hash: four steps on, the third plan keys it, and r1's hit reaches 4; five steps on,
# that plan frees its slot instead, r1's hit is cut back to 2 and r1 saves 4 into the slot
@example(case=((1, 2, 2, 4), LATE_HASH))
@example(case=((1, 2, 2, 5), LATE_HASH))
# a reset forgets a save waiting for its hash: keyed by no later plan
@example(case=((1, 2, 2, 2), [ADD_3, ADD_6, ("lookup", 0, 0, 2), STEP, ("run", 0, 0, 0), ("reset", 0, 0, 0), STEP,
                              ("lookup", 0, 0, 3), STEP]))
# a request looked up on a hit but admitted cold loads nothing
@example(case=((1, 1, 2, 0), [ADD_3, ("lookup", 0, 0, 2), STEP, ("add", 0, 11, 3), ("lookup", 0, 0, 0),
                              ("cold", 0, 0, 0), STEP]))
def test_each_step_saves_loads_and_cuts_as_the_rules_say(case) -> None:
    config, ops = case
    driver = Driver(config)
    for kind, index, a, b in ops:
        driver.apply(kind, index, a, b)
    for _ in range(WAIT_PLANS + 1):  # late saves keyed or released
        driver.step()
