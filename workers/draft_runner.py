"""The draft model in a worker (speculative decoding with ``method="draft_model"``; docs/speculative.md).

A small model with the target's vocabulary runs next to it on every rank,
with the same tensor-parallel size. It has paged KV cache tensors of its own
that share the target's block ids: the target's block tables and slot
mapping address both caches, so the core's one KV manager serves both (a
block costs the target's bytes plus the draft's, counted when the cache is
sized), and prefix-cache hits, preemption and swapping carry the draft's KV
with the target's.

Each step, after the target verified its drafts:

1. the draft runs over the step's own tokens (the same input ids, positions
   and attention metadata as the target), so its cache holds its KV at every
   position the target computed (rejected drafts' positions are behind the
   request's computed length, as in the target's cache, and rewritten later);
2. every request that sampled this step and may be drafted proposes
   ``num_speculative_tokens`` tokens greedily: k single-token passes, the
   first over the token just sampled, each next one over the previous
   pass's argmax. Their KV goes to positions past the request's computed
   length, in its own blocks where it has them, else in scratch blocks of
   the draft cache (after the shared ones; ``ceil(k / block_size)`` per
   request of the step), never in a block another request may read.

Greedy drafts are proposals with certainty, which the one-hot rejection
sampler (workers/spec_decode.py) verifies exactly for sampled requests too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model, resolve_model_path
from asyncllm.models.registry import KVCacheSpec, kv_cache_spec
from asyncllm.spec.config import SpeculativeConfig
from asyncllm.workers.block_table import BlockTable
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.input_types import RequestState, StepInputs

__all__ = ["DraftModelRunner"]


class DraftModelRunner:
    """The draft model, its KV cache and its proposals on one rank."""

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, device: torch.device) -> None:
        assert (spec.model is not None or spec.method == "mtp") and config.max_model_len is not None
        self.config = config
        self.spec = spec
        self.device = device
        self.k = spec.num_speculative_tokens
        self.block_size: int = config.block_size
        self.max_len: int = min(spec.max_model_len or config.max_model_len, config.max_model_len)
        """Requests whose drafts would pass this length get none."""
        self.scratch_per_request = -(-self.k // self.block_size)
        self.num_scratch_blocks = config.max_num_seqs * self.scratch_per_request
        self.model: Any = None
        self.kv_spec: KVCacheSpec | None = None
        self.kv_cache_dtype: torch.dtype | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.scratch_start = 0
        """The first scratch block id (the number of shared blocks)."""

    def load_model(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, rank: int, tp_size: int) -> None:
        """Build the draft through the engine's loader, with the target's dtype and KV cache dtype; with
        ``draft_tensor_parallel_size=1`` every rank holds the whole draft and computes the same proposals (no
        collective: a small draft beside a sharded target)."""
        spec = self.spec
        if spec.draft_tensor_parallel_size == 1:
            rank, tp_size = 0, 1
        hf_config = load_hf_config(resolve_model_path(spec.model, spec.revision))  # type: ignore[arg-type]
        draft_config = self.config.replace(model=spec.model, revision=spec.revision, quantization=spec.quantization,
                                           speculative_config=None, enable_lora=False, tensor_parallel_size=tp_size)
        self.model = load_model(draft_config, hf_config, self.device, dtype, rank, tp_size)
        self.kv_spec = kv_cache_spec(hf_config, tp_size)
        self.kv_cache_dtype = kv_cache_dtype

    @property
    def bytes_per_block(self) -> int:
        """The draft's KV bytes of one block on this rank."""
        assert self.kv_spec is not None and self.kv_cache_dtype is not None, "load_model() first"
        return self.kv_spec.bytes_per_block(self.block_size, self.kv_cache_dtype)

    @property
    def scratch_bytes(self) -> int:
        return self.num_scratch_blocks * self.bytes_per_block

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        """The draft's cache: ``num_blocks`` shared block ids, then the scratch blocks."""
        assert self.kv_spec is not None and self.kv_cache_dtype is not None, "load_model() first"
        self.scratch_start = num_blocks
        self.kv_caches = self.kv_spec.allocate(num_blocks + self.num_scratch_blocks, self.block_size,
                                               self.kv_cache_dtype, self.device)
        return self.kv_caches

    @torch.inference_mode()
    def step(self, inputs: StepInputs, sampled: list[RequestState], batch: InputBatch,
             hidden: torch.Tensor, rope_positions: torch.Tensor | None = None) -> dict[str, list[int]]:
        """Run the draft over the step's tokens, then propose for the ``sampled`` requests (after verification).
        ``hidden``, ``rope_positions``: the target's output and rotary positions of the step (what an EAGLE head
        reads; a draft model, for text targets only, needs neither)."""
        self.model(inputs.input_ids, self._within_table(inputs.positions), self.kv_caches, inputs.attn_metadata)
        proposing = self.proposing(sampled)
        if not proposing:
            return {}
        ids = torch.tensor([s.token_ids[-1] for s in proposing], dtype=torch.int64, device=self.device)
        drafts = self._chain(proposing, batch.block_table, ids, None, self.k).tolist()
        return {state.req_id: row for state, row in zip(proposing, drafts)}

    def _within_table(self, positions: torch.Tensor) -> torch.Tensor:
        """`positions` held below ``max_len`` (a draft's own position table, GPT-2's, may end there): the draft's KV
        past ``max_len`` is never read, as no request proposes there."""
        return positions if self.max_len >= self.config.max_model_len else positions.clamp(max=self.max_len - 1)

    def proposing(self, sampled: list[RequestState]) -> list[RequestState]:
        """The requests that sampled and get drafts: those with room for ``k`` more tokens."""
        return [s for s in sampled
                if s.num_computed_tokens == s.num_tokens - 1 and s.num_tokens - 1 + self.k <= self.max_len]

    def _chain(self, states: list[RequestState], block_table: BlockTable, ids: torch.Tensor,
               hidden: torch.Tensor | None, passes: int) -> torch.Tensor:
        """``passes`` single-token greedy passes from ``ids`` at each request's last token's position (``hidden``:
        what an EAGLE head carries from pass to pass): the proposals, ``[len(states), passes]``."""
        num_reqs, device = len(states), self.device
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs)  # the last token's position
        tables = self._block_tables(states, block_table)
        gpu_tables = torch.from_numpy(tables).to(device)
        query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32, device=device)
        proposed = []
        for p in range(passes):
            positions = starts + p
            slots = tables[np.arange(num_reqs), positions // self.block_size].astype(np.int64) * self.block_size
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots + positions % self.block_size).to(device),
                query_start_loc=query_start_loc,
                seq_lens=torch.from_numpy((positions + 1).astype(np.int32)).to(device),
                block_tables=gpu_tables,
                query_start_loc_cpu=list(range(num_reqs + 1)),
                seq_lens_cpu=(positions + 1).tolist(),
                block_size=self.block_size,
            )
            ids, hidden = self.one_pass(ids, torch.from_numpy(positions).to(device), meta, hidden)
            proposed.append(ids)
        return torch.stack(proposed, dim=1).cpu()

    def one_pass(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per request: (the greedy next ids, what the next pass carries)."""
        out = self.model(ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(out).argmax(dim=-1), None

    def _block_tables(self, states: list[RequestState], block_table: BlockTable) -> np.ndarray:
        """Each request's blocks, then its scratch blocks (where its proposals pass its allocated blocks)."""
        max_blocks = block_table.max_blocks_per_req
        tables = np.zeros((len(states), max_blocks), np.int32)
        per_request = self.scratch_per_request
        for i, state in enumerate(states):
            num = int(block_table.num_blocks[state.row])
            tables[i, :num] = block_table.table[state.row, :num]
            end = min(num + per_request, max_blocks)
            first = self.scratch_start + i * per_request
            tables[i, num:end] = np.arange(first, first + end - num)
        return tables
