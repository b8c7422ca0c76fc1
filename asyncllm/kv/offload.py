"""`CPUPrefixCache`: a second prefix-cache tier in CPU memory (``kv_offloading_size`` GiB, vLLM's knob of that name;
docs/scheduling.md#cpu-offloading).

A cached GPU block that is evicted (handed out again by the `BlockPool`) is copied to a CPU block first, keyed by
its hash; a later request whose prefix runs past its GPU hits into blocks held here gets fresh GPU blocks that the
workers fill from the CPU blocks before the step's forward, and those count as computed. Plain Python over
integers, like the pool: the workers hold the CPU tensors (after the swap space's, which preemption uses: the ids
here start at ``first_id``) and copy when a `SchedulerOutput` says so, every copy out before every copy in, both
before the forward (workers/swap.py).

- A block evicted while already held here costs no copy (its tokens, so its KV, are the same).
- The CPU tier evicts its least recently offloaded or hit entry; an entry a request hit, or a block written, in
  the step being scheduled is pinned until the step's copies are taken (`take_copies`), so no offload
  overwrites a CPU block that the same step reads or writes.
- `reset` (with the GPU prefix cache: new weights, a restart of the workers, `reset_prefix_cache`) forgets all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from asyncllm.kv.hashing import BlockHash

__all__ = ["CPUPrefixCache"]


class CPUPrefixCache:
    def __init__(self, first_id: int, num_blocks: int) -> None:
        assert num_blocks > 0, num_blocks
        self.num_blocks = num_blocks
        self._free = list(range(first_id + num_blocks - 1, first_id - 1, -1))
        self._lru: OrderedDict[BlockHash, tuple[int, tuple[int, ...]]] = OrderedDict()
        """hash -> (CPU block id, its tokens), least recently offloaded or hit first."""
        self._pinned: set[int] = set()
        self.offloads: list[list[int]] = []
        """[gpu, cpu] copies out of this step."""
        self.loads: list[list[int]] = []
        """[gpu, cpu] copies in of this step."""

    @property
    def num_used_blocks(self) -> int:
        return len(self._lru)

    def offload(self, gpu_block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """An evicted GPU block: keep its KV here (a copy out this step), unless held already or nothing is free."""
        entry = self._lru.get(block_hash)
        if entry is not None:
            self._lru.move_to_end(block_hash)
            return
        cpu_id = self._take()
        if cpu_id is None:
            return
        self._lru[block_hash] = (cpu_id, token_ids)
        self._pinned.add(cpu_id)  # written once a step: no later offload of the step takes it again
        self.offloads.append([gpu_block_id, cpu_id])

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The CPU block holding this block's KV (pinned for the step), or None."""
        entry = self._lru.get(block_hash)
        if entry is None or entry[1] != tuple(token_ids):
            return None
        self._lru.move_to_end(block_hash)
        self._pinned.add(entry[0])
        return entry[0]

    def load(self, cpu_block_id: int, gpu_block_id: int) -> None:
        """Copy a hit CPU block into a GPU block this step."""
        self.loads.append([gpu_block_id, cpu_block_id])

    def take_copies(self) -> tuple[list[list[int]], list[list[int]]]:
        """The step's (copies out, copies in); unpins its hits."""
        copies = self.offloads, self.loads
        self.offloads, self.loads = [], []
        self._pinned.clear()
        return copies

    def reset(self) -> None:
        """Forget every entry (their KV is stale, or the workers' CPU blocks are new)."""
        self._free.extend(cpu_id for cpu_id, _ in self._lru.values())
        self._free.sort(reverse=True)
        self._lru.clear()
        self._pinned.clear()
        self.offloads, self.loads = [], []

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, (cpu_id, _) in self._lru.items():  # the least recently used entry not read this step
            if cpu_id not in self._pinned:
                del self._lru[block_hash]
                return cpu_id
        return None
