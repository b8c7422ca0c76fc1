"""`LoRARunner`'s slots and CPU cache under drawn traffic (hypothesis), driven as the scheduler and the core drive it.

Drawn: ``max_loras`` 1 to 3 slots and a CPU cache of ``max_loras`` or ``max_loras + 1`` adapters over a tiny Llama,
five adapters of varied ranks and projections (written once per module) plus one whose folder is gone, and a list of
operations: admit a request (base model or an adapter, only as the scheduler would: the running requests' adapters
and the pinned ones stay within ``max_loras``), finish one (or every request of its adapter), run a step of some
running requests (1-3 tokens each), pin an adapter (as the core allows: at most ``max_loras`` pinned, never the last
slot while a request of another adapter runs, so requests running before a pin may push a pinned adapter out of its
slot), unpin one, and release the slots (sleep mode; reallocated before the next step).

The model is plain lists, with the rules of the module's docstring and docs/lora.md ("Workers", `pin_lora`): a step
puts each of its adapters in a slot, keeping one already there (now the most recently used), else taking a free slot
(the lowest: the runner's choice, the docstring names none), else the least recently used unpinned slot the step
does not need, else such a pinned one; then each pinned adapter out of a slot takes a free or unpinned unneeded one
(at its pin too; a step of the base model only changes nothing). The CPU cache holds adapters read, least recently
read into a slot or pinned first, trimmed to ``max_cpu_loras`` from the front, never a pinned one nor one the step
(or the pin) is placing; unpinned, an adapter goes to the front of the slots and the cache. A folder is read exactly when the adapter is not in the cache;
an unreadable one fails its requests only (they run without an adapter and are dropped), or the pin, changing nothing.
After every operation the runner must match the model exactly: the slots (adapter, slot, LRU order), the CPU cache's
order, the pinned adapters (in pin order), the requests it keeps, and the folders read. After every step the mask
must give each request's tokens exactly its adapter's slot (no slot for the base model's and the failed ones; no mask
when none has one), and every projection (the fused qkv and gate-up too) must add to each token exactly its own
adapter's ``scaling * B A x`` computed from the adapter's file, in the rows of the projection it adapts (0 elsewhere,
and for a projection it does not adapt): the request runs as with only its adapter loaded, and a slot holds only its
adapter's weights.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from asyncllm import InvalidRequestError, LoRARequest
from asyncllm.config import EngineConfig, LoRAConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.tiny import tiny_checkpoint
from asyncllm.workers import lora_runner
from asyncllm.workers.lora_runner import LoRARunner

MAX_RANK = 4
SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
          "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64), "mlp.down_proj": (64, 128)}
"""The tiny Llama's projections an adapter here may adapt: (out, in)."""
FUSED_ROWS = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.v_proj": ("self_attn.qkv_proj", 96),
              "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 128),
              "self_attn.o_proj": ("self_attn.o_proj", 0), "mlp.down_proj": ("mlp.down_proj", 0)}
"""Where a checkpoint projection's rows are in the model's (fused q, k, v: 64, 32, 32 rows; gate, up: 128 each)."""
ADAPTERS = {  # id: (rank, alpha, the projections it adapts)
    1: (2, 4, [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("o_proj", "q_proj")]),
    2: (4, 8, [f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("down_proj", "gate_proj")]),
    3: (4, 4, [f"model.layers.{i}.{p}" for i in (0, 1)
               for p in ("self_attn.o_proj", "mlp.down_proj", "self_attn.v_proj")]),
    4: (2, 8, ["model.layers.1.self_attn.o_proj"]),
    5: (3, 6, ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]),
}
BROKEN = 6
"""An adapter whose folder is gone since the host checked it."""
CHOICES = [None, *ADAPTERS, BROKEN]
"""What an admitted request runs: the base model, or an adapter."""
real_read_adapter = lora_runner.read_adapter
"""The runner's folder reader, which the test wraps to see every read."""


class Unreadable(Exception):
    """The model's: reading this adapter's folder fails."""


def write_adapter(folder: str, seed: int, rank: int, alpha: int, modules: list[str]) -> dict[str, tuple]:
    """A PEFT LoRA folder with random A and B on `modules`; each module's model projection, first row there, A and
    scaled B."""
    gen = torch.Generator().manual_seed(seed)
    tensors, products = {}, {}
    for name in modules:
        out_features, in_features = SHAPES[name.split(".", 3)[3]]
        lora_a = torch.randn(rank, in_features, generator=gen) * 0.3
        lora_b = torch.randn(out_features, rank, generator=gen) * 0.3
        tensors[f"base_model.model.{name}.lora_A.weight"] = lora_a
        tensors[f"base_model.model.{name}.lora_B.weight"] = lora_b
        layer, block = name.split(".", 3)[2:]
        fused, row = FUSED_ROWS[block]
        products[name] = (f"model.layers.{layer}.{fused}", row, lora_a, lora_b * (alpha / rank))
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                   "target_modules": sorted({name.rsplit(".", 1)[1] for name in modules})}, f)
    return products


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The tiny Llama, the adapters' requests, and each adapter's matrices (`write_adapter`)."""
    path = tiny_checkpoint("llama")
    model = load_model(EngineConfig.create(path, max_model_len=64), load_hf_config(path), torch.device("cpu"),
                       torch.float32)
    root = tmp_path_factory.mktemp("lora_slots")
    loras, products = {}, {}
    for lora_id, (rank, alpha, modules) in ADAPTERS.items():
        folder = str(root / f"a{lora_id}")
        products[lora_id] = write_adapter(folder, lora_id, rank, alpha, modules)
        loras[lora_id] = LoRARequest(f"a{lora_id}", lora_id, folder)
    loras[BROKEN] = LoRARequest("gone", BROKEN, str(root / "gone"))
    return SimpleNamespace(model=model, loras=loras, products=products,
                           ids={lora.lora_path: lora_id for lora_id, lora in loras.items()})


class Model:
    """What the runner must hold, by the docstring's rules."""

    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.slots: list[int] = []
        """Adapters in a slot, least recently used first."""
        self.slot_of: dict[int, int] = {}
        self.cpu_cache: list[int] = []
        """Adapters read, least recently used first."""
        self.pinned: list[int] = []
        self.released = False
        self.running: dict[str, int | None] = {}
        self.reads: list[int] = []
        """The folders read since the last check."""

    def load(self, lora_id: int, keep: list[int]) -> None:
        if lora_id in self.cpu_cache:
            self.cpu_cache.remove(lora_id)
            self.cpu_cache.append(lora_id)
            return
        self.reads.append(lora_id)
        if lora_id == BROKEN:
            raise Unreadable
        self.cpu_cache.append(lora_id)
        self.trim(keep)

    def trim(self, keep: list[int] = ()) -> None:
        evictable = [i for i in self.cpu_cache if i not in self.pinned and i not in keep]
        for lora_id in evictable[:max(0, len(self.cpu_cache) - self.max_cpu_loras)]:
            self.cpu_cache.remove(lora_id)

    def slot_to_fill(self, needed: list[int], free_only: bool) -> int | None:
        free = [slot for slot in range(self.max_loras) if slot not in self.slot_of.values()]
        if free:
            return free[0]
        unneeded = [i for i in self.slots if i not in needed]
        unpinned = [i for i in unneeded if i not in self.pinned]
        victims = unpinned if unpinned or free_only else unneeded
        return self.slot_of[victims[0]] if victims else None

    def put_in_slot(self, lora_id: int, needed: list[int]) -> None:
        if lora_id in self.slot_of:
            self.slots.remove(lora_id)
            self.slots.append(lora_id)
            return
        self.load(lora_id, needed)
        slot = self.slot_to_fill(needed, free_only=False)
        for holder in [i for i in self.slots if self.slot_of[i] == slot]:
            self.slots.remove(holder)
            del self.slot_of[holder]
        self.slots.append(lora_id)
        self.slot_of[lora_id] = slot

    def place_pinned(self, needed: list[int]) -> None:
        if self.released:
            return
        for lora_id in self.pinned:
            if lora_id not in self.slot_of and self.slot_to_fill(needed, free_only=True) is not None:
                self.put_in_slot(lora_id, needed)

    def step(self, req_ids: list[str]) -> set[int]:
        """The adapters that failed to load."""
        adapters = [self.running[req_id] for req_id in req_ids]
        if not any(adapters):
            return set()
        needed = list(dict.fromkeys(a for a in adapters if a is not None))
        failed = set()
        for lora_id in needed:
            try:
                self.put_in_slot(lora_id, needed)
            except Unreadable:
                failed.add(lora_id)
        self.place_pinned(needed)
        return failed

    def pin(self, lora_id: int) -> None:
        self.load(lora_id, [lora_id])
        if lora_id not in self.pinned:
            self.pinned.append(lora_id)
        self.place_pinned([])

    def unpin(self, lora_id: int) -> None:
        self.pinned.remove(lora_id)
        for cache in (self.slots, self.cpu_cache):
            if lora_id in cache:
                cache.remove(lora_id)
                cache.insert(0, lora_id)
        self.trim()

    def release(self) -> None:
        self.released = True
        self.slots.clear()
        self.slot_of.clear()

    def running_adapters(self) -> set[int]:
        return {a for a in self.running.values() if a is not None}

    def admits(self, lora_id: int | None) -> bool:
        """The scheduler's rule: a pinned adapter counts against ``max_loras``, run or not."""
        return lora_id is None or len(self.running_adapters() | set(self.pinned) | {lora_id}) <= self.max_loras

    def may_pin(self, lora_id: int) -> bool:
        """The core's: at most ``max_loras`` pinned, and not the last slot while another adapter's requests run."""
        pinned = set(self.pinned) | {lora_id}
        if lora_id in self.pinned:
            return True
        if len(pinned) > self.max_loras:
            return False
        return len(pinned) < self.max_loras or self.running_adapters() <= pinned


class Driver:
    """The runner and the model side by side, with the folders the runner reads."""

    def __init__(self, served: SimpleNamespace, max_loras: int, max_cpu_loras: int) -> None:
        self.served = served
        config = LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=MAX_RANK, max_cpu_loras=max_cpu_loras)
        self.runner = LoRARunner(served.model, config, torch.float32, torch.device("cpu"))
        self.model = Model(max_loras, max_cpu_loras)
        self.reads: list[int] = []
        self.next_req = 0

    def read_adapter(self, path: str):
        self.reads.append(self.served.ids[path])
        return real_read_adapter(path)

    def update(self, new: list[tuple[str, int | None]] = (), finished: list[str] = ()) -> None:
        new_reqs = [SimpleNamespace(req_id=req_id, lora=self.served.loras.get(lora_id)) for req_id, lora_id in new]
        self.runner.update_states(SimpleNamespace(new_reqs=new_reqs, finished_req_ids=set(finished),
                                                  preempted_req_ids=set()))

    def add(self, lora_id: int | None) -> None:
        if self.model.admits(lora_id):
            req_id = f"r{self.next_req}"
            self.next_req += 1
            self.model.running[req_id] = lora_id
            self.update(new=[(req_id, lora_id)])

    def finish(self, n: int) -> None:
        """A running request ends, and with it (odd `n`) every other request of its adapter: a slot frees."""
        if self.model.running:
            req_id = list(self.model.running)[n % len(self.model.running)]
            lora_id = self.model.running[req_id]
            ended = [r for r, a in self.model.running.items() if r == req_id or (n % 2 and a == lora_id)]
            for req_id in ended:
                del self.model.running[req_id]
            self.update(finished=ended)

    def pin(self, lora_id: int) -> None:
        if not self.model.may_pin(lora_id):
            return
        try:
            self.model.pin(lora_id)
        except Unreadable:
            with pytest.raises(InvalidRequestError, match="gone"):
                self.runner.pin(self.served.loras[lora_id])
            return
        self.runner.pin(self.served.loras[lora_id])

    def unpin(self, n: int) -> None:
        if self.model.pinned:
            lora_id = self.model.pinned[n % len(self.model.pinned)]
            self.model.unpin(lora_id)
            self.runner.unpin(lora_id)

    def sleep(self) -> None:
        if not self.model.released:
            self.model.release()
            self.runner.release_slots()

    def wake(self) -> None:
        if self.model.released:
            self.model.released = False
            self.runner.reallocate_slots()

    def step(self, tokens: list[int]) -> None:
        """The running requests (in admission order) with a nonzero entry of ``tokens`` (cycled) run that many."""
        running = list(self.model.running)
        counts = {req_id: tokens[i % len(tokens)] for i, req_id in enumerate(running)}
        req_ids = [req_id for req_id in running if counts[req_id]]
        if not req_ids:
            return
        self.wake()  # the engine wakes before it steps again
        adapters = [self.model.running[req_id] for req_id in req_ids]
        failed = self.model.step(req_ids)
        errors = self.runner.prepare(req_ids, counts)
        assert set(errors) == {r for r, a in zip(req_ids, adapters) if a in failed}
        slots = [None if a is None or a in failed else self.model.slot_of[a] for a in adapters]
        self.check_mask(slots, [counts[r] for r in req_ids])
        self.check_products(adapters, slots, [counts[r] for r in req_ids])
        for req_id in errors:  # the core ends them
            del self.model.running[req_id]

    def check_mask(self, slots: list[int | None], counts: list[int]) -> None:
        mask = self.runner.context.mask
        if all(slot is None for slot in slots):
            assert mask is None
            return
        expected = torch.zeros(sum(counts), self.model.max_loras)
        row = 0
        for slot, count in zip(slots, counts):
            if slot is not None:
                expected[row:row + count, slot] = 1
            row += count
        assert mask is not None and torch.equal(mask, expected), (mask, expected)
        assert self.runner.context.experts is False

    def check_products(self, adapters: list[int | None], slots: list[int | None], counts: list[int]) -> None:
        """Every projection adds to a token its own adapter's products, as in the adapter's file, in the rows of
        the checkpoint projection they adapt; nothing else."""
        if self.runner.context.mask is None:
            return
        gen = torch.Generator().manual_seed(sum(counts))
        for name, layer in self.runner.layers.items():
            x = torch.randn(sum(counts), layer.a.shape[1], generator=gen)
            added = layer(x, torch.zeros(sum(counts), layer.b.shape[0]))
            expected = torch.zeros_like(added)
            first = 0
            for lora_id, slot, count in zip(adapters, slots, counts):
                tokens = slice(first, first + count)
                first += count
                if slot is None:  # the base model's, or a failed adapter's
                    continue
                for target, row, lora_a, lora_b in self.served.products[lora_id].values():
                    if target == name:
                        expected[tokens, row:row + lora_b.shape[0]] = x[tokens] @ lora_a.T @ lora_b.T
            torch.testing.assert_close(added, expected, atol=1e-5, rtol=1e-5)

    def check(self) -> None:
        runner, model = self.runner, self.model
        assert list(runner.slots.items()) == [(i, model.slot_of[i]) for i in model.slots]
        assert list(runner.cpu_cache) == model.cpu_cache
        assert list(runner.pinned) == model.pinned
        assert self.reads == model.reads, "folders read"
        assert {r: lora.lora_int_id for r, lora in runner.requests.items()} == \
               {r: a for r, a in model.running.items() if a is not None}
        self.reads.clear()
        model.reads.clear()



def run(served: SimpleNamespace, max_loras: int, extra_cpu: int, ops: list[tuple[str, int, list[int]]]) -> None:
    driver = Driver(served, max_loras, max_loras + extra_cpu)
    with mock.patch.object(lora_runner, "read_adapter", driver.read_adapter):
        for kind, n, tokens in ops:
            if kind == "add":
                driver.add(CHOICES[n % len(CHOICES)])
            elif kind == "finish":
                driver.finish(n)
            elif kind == "step":
                driver.step(tokens)
            elif kind == "pin":
                driver.pin([*ADAPTERS, BROKEN][n % (len(ADAPTERS) + 1)])
            elif kind == "unpin":
                driver.unpin(n)
            else:
                driver.sleep()
            driver.check()


KINDS = ["add"] * 4 + ["finish"] * 2 + ["step"] * 4 + ["pin"] * 2 + ["unpin", "sleep"]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, list[tuple[str, int, list[int]]]]:
    max_loras = draw(st.integers(1, 3))
    extra_cpu = draw(st.integers(0, 1))
    ops = draw(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 20),
                                  st.lists(st.integers(0, 3), min_size=1, max_size=5)), min_size=20, max_size=80))
    return max_loras, extra_cpu, ops


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
# adapters 1 and 2 running, 3 pinned with no free slot: a step of 1 and 2 pushes 3 out (it stays in the CPU cache);
# once 2 finishes, the next step puts 3 back, reading nothing
@example(case=(2, 1, [("add", 1, [1]), ("add", 2, [1]), ("step", 0, [1]), ("pin", 2, [1]), ("step", 0, [2]),
                      ("finish", 1, [1]), ("step", 0, [1]), ("unpin", 0, [1]), ("add", 4, [1]), ("step", 0, [1])]))
# a gone folder fails its requests only; the pin of it pins nothing
@example(case=(2, 0, [("add", 6, [1]), ("add", 1, [1]), ("add", 0, [1]), ("step", 0, [1]), ("pin", 5, [1]),
                      ("step", 0, [1])]))
# sleep mode: the slots are released with a pinned adapter in one, another is pinned meanwhile (read, no slot);
# both take a slot at the next step, after its own adapter, reading nothing
@example(case=(3, 0, [("pin", 0, [1]), ("add", 2, [1]), ("step", 0, [1]), ("sleep", 0, [1]), ("pin", 2, [1]),
                      ("step", 0, [1])]))
# a pinned adapter, least recently read, stays in a full CPU cache while the adapters after it come and go
@example(case=(2, 0, [("pin", 0, [1]), ("add", 2, [1]), ("step", 0, [1]), ("finish", 0, [1]), ("add", 3, [1]),
                      ("step", 0, [1])]))
# two pinned adapters pushed out by the requests running before their pins: neither takes the other's slot
@example(case=(3, 0, [("add", 1, [1]), ("add", 2, [1]), ("add", 3, [1]), ("step", 0, [1]), ("pin", 3, [1]),
                      ("step", 0, [1]), ("finish", 2, [1]), ("pin", 4, [1]), ("step", 0, [1])]))
# after sleep mode, a step of adapters 2 and 1 (2 first) with 1 and 3 in a full CPU cache, 1 least recently used:
# reading 2 evicts 3, not 1, which the step places next (reading no folder twice)
@example(case=(2, 0, [("add", 1, [1]), ("add", 3, [1]), ("step", 0, [1]), ("sleep", 0, [1]), ("finish", 0, [1]),
                      ("finish", 0, [1]), ("add", 2, [1]), ("add", 1, [1]), ("step", 0, [1])]))
def test_slots_and_cpu_cache_follow_the_lru_rules_with_pins(served: SimpleNamespace, case) -> None:
    run(served, *case)
