"""Saved recurrent states, so that hybrid models get prefix-cache hits (docs/hybrid-models.md#prefix-caching).

A hybrid's state layers (Gated DeltaNet, Mamba2, short convolutions) keep one state per request instead of a KV
cache, so a prefix-cache hit on the attention layers' blocks is usable only up to a point whose states are known.
The workers save a request's states each time it reaches a multiple of ``mamba_block_size`` tokens, into one of
``mamba_checkpoint_slots`` slots; `StateCheckpoints` (in the core, owned by the `KVCacheManager`) picks each
save's slot, keyed by the hash of the block that ends at the point, and cuts a request's hit back to the last
point in it whose states are saved.

- A save becomes usable from the next step on: the workers run steps in order, so a step that loads it runs after
  the step that wrote it (a request admitted in the step that saves it recomputes).
- In a step the workers load every planned state before they save any (each state layer does both), so a slot can
  be loaded and given to a new save in one step.
- The least recently saved or hit point is replaced first; a step never replaces its own saves (points beyond the
  slots left are not saved).
- A drafted request's drafts are never saved (speculative decoding): they may be rejected.
- With async scheduling a decode can reach a point before the token that ends its block is known, so the block has
  no hash yet: the save goes ahead and is keyed a step or two later, once the token arrived (its slot is released
  if it never does).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from typing import Any, Protocol, Sequence

from asyncllm.kv.hashing import BlockHash
from asyncllm.protocol import SchedulerOutput

__all__ = ["StateCheckpoints"]


class _Request(Protocol):
    request_id: str
    block_hashes: list[BlockHash]


class StateCheckpoints:
    def __init__(self, grid: int, block_size: int, num_slots: int) -> None:
        assert grid % block_size == 0 and num_slots > 0, (grid, block_size, num_slots)
        self.grid = grid
        """Tokens between saved points (``mamba_block_size``)."""
        self.blocks_per_point = grid // block_size
        self.num_slots = num_slots
        self.saved: OrderedDict[BlockHash, int] = OrderedDict()
        """Hash of the block ending at a saved point -> its slot, least recently used first."""
        self._free = list(range(num_slots))[::-1]
        self._loads: dict[str, int] = {}
        """Requests looked up since the last `plan` -> the slot of their hit's end."""
        self._unkeyed: list[tuple[_Request, int, int, int]] = []
        """(request, block index, slot, plan number) of saves whose block had no hash yet (async scheduling)."""
        self._num_plans = 0

    def cut_hit(self, request: _Request, hits: Sequence[Any]) -> int:
        """How many of the hit blocks the request can use: up to the last saved point in them (0: none)."""
        self._loads.pop(request.request_id, None)
        per_point = self.blocks_per_point
        for num_blocks in range(len(hits) // per_point * per_point, 0, -per_point):
            block_hash = request.block_hashes[num_blocks - 1]
            slot = self.saved.get(block_hash)
            if slot is not None:
                self.saved.move_to_end(block_hash)
                self._loads[request.request_id] = slot
                return num_blocks
        return 0

    def plan(self, out: SchedulerOutput, requests: dict[str, _Request]) -> None:
        """The step's loads (requests admitted on a hit) and saves (points its tokens reach) into ``out``."""
        self._num_plans += 1
        self._key_unkeyed()
        loads, self._loads = self._loads, {}
        begun = {new.req_id: new.num_computed_tokens for new in out.new_reqs}
        out.state_loads = {req_id: slot for req_id, slot in loads.items() if begun.get(req_id)}
        cached = out.cached_reqs
        grid, scheduled, new = self.grid, out.num_scheduled_tokens, {}
        drafts = out.spec_token_ids
        for req_id, computed in chain(begun.items(), zip(cached.req_ids, cached.num_computed_tokens)):
            end = computed + scheduled[req_id] - len(drafts.get(req_id, ()))  # drafts may be rejected: no point
            if end // grid > computed // grid:
                points = self._points(requests[req_id], int(computed), end, new)
                if points:
                    out.state_saves[req_id] = points
        self.saved.update(new)  # usable from the next step

    def _points(self, request: _Request, computed: int, end: int, new: dict[BlockHash, int]) -> list[list[int]]:
        """[point, slot] for each point in (computed, end] whose block is hashed and not saved yet."""
        points = []
        for point in range((computed // self.grid + 1) * self.grid, end + 1, self.grid):
            index = point // self.grid * self.blocks_per_point - 1
            block_hash = request.block_hashes[index] if index < len(request.block_hashes) else None
            if block_hash in self.saved or block_hash in new:
                continue
            slot = self._take_slot()
            if slot is None:
                break
            if block_hash is None:
                self._unkeyed.append((request, index, slot, self._num_plans))
            else:
                new[block_hash] = slot
            points.append([point, slot])
        return points

    def _key_unkeyed(self) -> None:
        """Key the saves whose block got its hash since; release the slots of those that waited three steps."""
        waiting = []
        for request, index, slot, planned in self._unkeyed:
            if index < len(request.block_hashes):
                block_hash = request.block_hashes[index]
                if block_hash in self.saved:
                    self._free.append(slot)
                else:
                    self.saved[block_hash] = slot
            elif self._num_plans - planned < 3:
                waiting.append((request, index, slot, planned))
            else:
                self._free.append(slot)
        self._unkeyed = waiting

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self.saved:
            return self.saved.popitem(last=False)[1]
        return None

    def reset(self) -> None:
        """Forget every saved point (with the prefix cache)."""
        self.saved.clear()
        self._free = list(range(self.num_slots))[::-1]
        self._loads.clear()
        self._unkeyed.clear()
