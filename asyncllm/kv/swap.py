"""`SwapSpace`: the CPU block pool that `preemption_mode="swap"` parks victims' KV in.

Plain Python over integers, like the GPU `BlockPool`: each worker holds the
CPU tensors (`swap_space` GiB, sized from its bytes per block) and copies
blocks when a `SchedulerOutput` says so; this class only decides which CPU
block holds which request's KV.

A swapped-out request holds CPU blocks for its computed tokens and no GPU
block. When it resumes, blocks still in the GPU prefix cache are taken from
there and only the rest is copied back (`SwapSpace.resume`), after which its
CPU blocks are free again.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.kv.manager import cdiv

__all__ = ["SwappedRequest", "SwapSpace"]


@dataclass(slots=True)
class SwappedRequest:
    """Where a swapped-out request's KV waits."""

    cpu_block_ids: list[int]
    """CPU block i holds the request's block i (its first ``num_computed_tokens`` tokens)."""
    num_computed_tokens: int
    """Tokens whose KV was computed when the request was swapped out."""


class SwapSpace:
    """`num_cpu_blocks` CPU blocks with ids 0..N-1 and which request holds which."""

    def __init__(self, num_cpu_blocks: int, block_size: int) -> None:
        assert num_cpu_blocks >= 0, num_cpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        """A stack, lowest id on top at first (a fresh space hands out 0, 1, 2, ...); freed blocks go back on top
        and are handed out again first, so ids stay small and stable for tests."""
        self.swapped: dict[str, SwappedRequest] = {}
        """req_id -> its CPU blocks, for every swapped-out request."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_cpu_blocks - len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free CPU block ids (for tests and debugging)."""
        return list(self._free)

    def is_swapped(self, req_id: str) -> bool:
        return req_id in self.swapped

    def can_swap_out(self, num_computed_tokens: int) -> bool:
        """Whether the free CPU blocks hold `num_computed_tokens` tokens of KV."""
        return cdiv(num_computed_tokens, self.block_size) <= len(self._free)

    def swap_out(self, req_id: str, gpu_block_ids: list[int], num_computed_tokens: int) -> list[list[int]]:
        """Give the request CPU blocks for its computed tokens; the [gpu, cpu] pairs to copy out.

        Only blocks that hold computed KV are copied: a block allocated for
        tokens the model has not run yet holds nothing worth keeping.
        """
        assert req_id not in self.swapped, req_id
        num_blocks = cdiv(num_computed_tokens, self.block_size)
        assert num_blocks <= len(gpu_block_ids) and num_blocks <= len(self._free), (num_blocks, len(gpu_block_ids))
        cpu_block_ids = [self._free.pop() for _ in range(num_blocks)]
        self.swapped[req_id] = SwappedRequest(cpu_block_ids, num_computed_tokens)
        return [[gpu, cpu] for gpu, cpu in zip(gpu_block_ids, cpu_block_ids)]

    def resume(self, req_id: str, num_hit_blocks: int, gpu_block_ids: list[int]) -> list[list[int]]:
        """Free the request's CPU blocks; the [gpu, cpu] pairs to copy back first.

        `num_hit_blocks` leading blocks came from the GPU prefix cache and are
        not copied; CPU block i goes to ``gpu_block_ids[i - num_hit_blocks]``.
        """
        entry = self.swapped.pop(req_id)
        pairs = [[gpu, cpu] for cpu, gpu in zip(entry.cpu_block_ids[num_hit_blocks:], gpu_block_ids)]
        assert len(pairs) == max(len(entry.cpu_block_ids) - num_hit_blocks, 0), (len(pairs), entry, gpu_block_ids)
        self._release(entry.cpu_block_ids)
        return pairs

    def free(self, req_id: str) -> None:
        """Drop a swapped request's CPU blocks (it finished, was aborted or timed out); no-op otherwise."""
        entry = self.swapped.pop(req_id, None)
        if entry is not None:
            self._release(entry.cpu_block_ids)

    def _release(self, cpu_block_ids: list[int]) -> None:
        self._free.extend(reversed(cpu_block_ids))
