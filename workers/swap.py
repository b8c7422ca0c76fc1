"""The worker's CPU swap space: where preempted requests' KV blocks wait (preemption_mode='swap').

The scheduler decides which blocks move (`asyncllm.kv.swap.SwapSpace`); a
`SchedulerOutput` carries ``blocks_to_swap_out`` and ``blocks_to_swap_in`` as
``[gpu_block, cpu_block]`` pairs, and the runner calls `CPUSwapSpace.swap`
before the step's forward: copies out first (the blocks they free may be
rewritten by this very step), then copies in.

Per layer the CPU tensor has the GPU cache's layout,
``[2, num_cpu_blocks, block_size, num_kv_heads, head_dim]`` (``[1, ...]`` for a latent cache), in pinned memory
on CUDA so that copies in are DMA transfers; a copy is one gather and one
scatter per layer, whatever the number of blocks. An fp8 cache is copied as
bytes (``uint8`` views: torch's CPU ``index_copy_`` has no float8 kernel).
"""

from __future__ import annotations

import torch

__all__ = ["CPUSwapSpace", "num_swap_blocks"]


def num_swap_blocks(swap_space_gib: float, bytes_per_block: int) -> int:
    """How many KV blocks of `bytes_per_block` fit in `swap_space_gib` GiB."""
    return int(swap_space_gib * 2**30) // bytes_per_block


class CPUSwapSpace:
    """`num_blocks` CPU blocks per layer, shaped like the GPU KV cache's blocks."""

    def __init__(self, num_blocks: int, gpu_caches: list[torch.Tensor]) -> None:
        assert num_blocks > 0 and gpu_caches, (num_blocks, len(gpu_caches))
        pin = gpu_caches[0].device.type == "cuda"
        self.num_blocks = num_blocks
        self.caches = [
            torch.empty((cache.shape[0], num_blocks, *cache.shape[2:]), dtype=cache.dtype, pin_memory=pin)
            for cache in gpu_caches
        ]

    def swap(self, gpu_caches: list[torch.Tensor], blocks_to_swap_out: list[list[int]],
             blocks_to_swap_in: list[list[int]]) -> None:
        """Copy ``[gpu, cpu]`` pairs out to the CPU, then the other pairs back in to the GPU cache."""
        gpu_caches, cpu_caches = [_copyable(c) for c in gpu_caches], [_copyable(c) for c in self.caches]
        if blocks_to_swap_out:
            gpu_ids, cpu_ids = self._indices(blocks_to_swap_out, gpu_caches[0].device)
            for gpu_cache, cpu_cache in zip(gpu_caches, cpu_caches):
                cpu_cache.index_copy_(1, cpu_ids, gpu_cache.index_select(1, gpu_ids).cpu())
        if blocks_to_swap_in:
            gpu_ids, cpu_ids = self._indices(blocks_to_swap_in, gpu_caches[0].device)
            for gpu_cache, cpu_cache in zip(gpu_caches, cpu_caches):
                gpu_cache.index_copy_(1, gpu_ids, cpu_cache.index_select(1, cpu_ids).to(gpu_cache.device))

    @staticmethod
    def _indices(pairs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
        return ids[:, 0].to(device), ids[:, 1].contiguous()


def _copyable(cache: torch.Tensor) -> torch.Tensor:
    """The cache itself, or for a one-byte (fp8) cache a ``uint8`` view of the same memory."""
    return cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache
