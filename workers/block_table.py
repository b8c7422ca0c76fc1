"""`BlockTable`: every request row's KV block ids, on the host and on the device, kept equal by diffs.

The host table (numpy) is what the input batch reads to compute slot
mappings. The device mirror is what attention reads: a step gathers its rows
on the device (`gather`) instead of uploading a ``[requests, max_blocks]``
table, so the bytes copied per step are the step's diffs (a decode step: one
block id per request that crossed a block boundary) plus one row index per
request, whatever the context length. Writes (`append`, `clear`) go to the
host at once and are queued for the device; `gather` applies the queue in one
copy and one indexed write first (a cell written twice keeps its last value,
so the order of writes holds).

On a CPU device the mirror is the host table itself (no diffs) unless
`MIRROR_ON_CPU` is set, which tests use to check the diff path without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BlockTable"]


class BlockTable:
    """Persistent ``[num_rows, max_blocks_per_req]`` int32 block ids, one row per request.

    Unused entries hold 0 (a valid block id) so that any gather stays in bounds.
    """

    MIRROR_ON_CPU = False
    """Keep a separate device table, updated by diffs, on a CPU device too (tests)."""

    def __init__(self, num_rows: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device
        self.table = np.zeros((num_rows, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int32)
        self._mirrored = device.type != "cpu" or self.MIRROR_ON_CPU
        self._pending: dict[int, int] = {}
        """Device writes not applied yet: flat index (row * max_blocks_per_req + column) -> block id."""
        self.version = 0
        """Bumped by every write (`append`, `clear`, `grow`): rows gathered at an unchanged version still hold what a
        gather would give (`InputBatch` skips gathering them again)."""
        self.device_table = self._new_device_table(num_rows)

    def _new_device_table(self, num_rows: int) -> torch.Tensor:
        if not self._mirrored:
            return torch.from_numpy(self.table)
        return torch.zeros((num_rows, self.max_blocks_per_req), dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------ writes
    def append(self, row: int, block_ids: list[int]) -> None:
        self.version += 1
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        assert end <= self.max_blocks_per_req, f"{end} blocks exceed max_blocks_per_req={self.max_blocks_per_req}"
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end
        if self._mirrored:
            base = row * self.max_blocks_per_req + start
            self._pending.update(zip(range(base, base + len(block_ids)), block_ids))

    def clear(self, row: int) -> None:
        self.version += 1
        end = int(self.num_blocks[row])
        self.table[row, :end] = 0
        self.num_blocks[row] = 0
        if self._mirrored:
            base = row * self.max_blocks_per_req
            self._pending.update(dict.fromkeys(range(base, base + end), 0))

    def grow(self, num_rows: int) -> None:
        self.version += 1
        extra = num_rows - len(self.num_blocks)
        self.table = np.concatenate([self.table, np.zeros((extra, self.max_blocks_per_req), np.int32)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(extra, np.int32)])
        old = self.device_table
        self.device_table = self._new_device_table(num_rows)
        if self._mirrored:
            self.device_table[: old.shape[0]].copy_(old)

    # ------------------------------------------------------------ reads
    def gather(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The block ids of ``rows`` (int64, on the device) into ``out[:len(rows)]``, after the pending writes."""
        self.flush()
        return torch.index_select(self.device_table, 0, rows, out=out[: rows.shape[0]])

    def flush(self) -> None:
        """Apply the queued writes to the device table (one host-to-device copy, one indexed write)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        count = len(pending)
        staged = torch.from_numpy(np.stack([np.fromiter(pending.keys(), np.int64, count),
                                            np.fromiter(pending.values(), np.int64, count)]))
        if self.device.type == "cuda":
            staged = staged.pin_memory().to(self.device, non_blocking=True)  # the host allocator keeps it alive
        flat = self.device_table.view(-1)
        flat.index_put_((staged[0],), staged[1].to(torch.int32))
