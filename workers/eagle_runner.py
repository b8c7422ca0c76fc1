"""An EAGLE head in a worker (speculative decoding with ``method="eagle"`` / ``"eagle3"``; docs/speculative.md).

It keeps the draft model's arrangement (workers/draft_runner.py): a paged KV
cache of its own on the target's block ids, scratch blocks for proposals past
a request's blocks, proposals after the step's drafts were verified. What
differs is what the head reads: at position ``p`` the token at ``p + 1`` and
the target's hidden state at ``p`` (EAGLE-1: the final one; EAGLE-3: ``fc``
over three layers' inputs, which the target's decoder keeps for it:
`LlamaModel.aux_layers`).

Each step:

1. the head runs over the step's rows with each row's *next* token, read from
   the request's tokens after verification (a prompt chunk's last row reads
   the next chunk's first token, a sampling request's last accepted row the
   token just sampled; rows of rejected drafts read a pad, and their KV, past
   the request's computed length, is rewritten later);
2. the output at each proposing request's last accepted row gives its first
   draft; ``k - 1`` single-token passes follow, each over the previous draft
   and the head's own output, at the positions after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncllm.models.eagle import Eagle3LlamaForCausalLM, EagleLlamaForCausalLM, eagle3_aux_layers, load_head_config
from asyncllm.models.eagle_targets import causal, chain_offsets, head_mrope, target_decoder
from asyncllm.models.loader import (checkpoint_files, iterate_safetensors, load_model,
                                    resolve_model_path)
from asyncllm.models.checkpoint import served_hf_config
from asyncllm.models.mtp import mtp_cache_config, mtp_class, mtp_layer_config, mtp_target
from asyncllm.models.registry import kv_cache_spec
from asyncllm.workers.draft_runner import DraftModelRunner
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.input_types import RequestState, StepInputs

__all__ = ["EagleRunner", "MTPRunner"]


class EagleRunner(DraftModelRunner):
    """An EAGLE head, its KV cache and its proposals on one rank."""

    target: Any = None
    mrope: Any = None
    """An M-RoPE head's image-text target's positions (workers/mm_runner.py `MRopePositions`); None otherwise."""
    chain_offsets: torch.Tensor | None = None
    """The proposing requests' M-RoPE deltas, added to their drafts' positions (None: none has one)."""

    @property
    def reads_layers(self) -> bool:
        """EAGLE-3: the target's steps keep some layers' inputs (so they run eagerly, not in CUDA graphs)."""
        return self.spec.method == "eagle3"

    def load_model(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, rank: int, tp_size: int) -> None:
        spec = self.spec
        path = resolve_model_path(spec.model, spec.revision)  # type: ignore[arg-type]
        hf_config = load_head_config(path)
        cls = Eagle3LlamaForCausalLM if self.reads_layers else EagleLlamaForCausalLM
        if self.reads_layers:
            names = (name for name, _ in iterate_safetensors(checkpoint_files(path)))
            hf_config.draft_has_embeddings = any(name.removeprefix("model.") == "embed_tokens.weight" for name in names)
        draft_config = self.config.replace(model=path, revision=None, quantization=None, speculative_config=None,
                                           enable_lora=False)
        self.model = load_model(draft_config, hf_config, self.device, dtype, rank, tp_size, model_cls=cls)
        self.kv_spec = kv_cache_spec(hf_config, tp_size)
        self.kv_cache_dtype = kv_cache_dtype
        self.hf_config = hf_config

    def share_target(self, target: Any, mm_runner: Any = None) -> None:
        """Lend the head the target's embeddings and LM head; EAGLE-3: have its decoder keep the layers' inputs.
        ``mm_runner``: an image-text target's (an M-RoPE head reads its requests' positions)."""
        self.target = target
        self.model.share_target(target)
        if head_mrope(self.hf_config)[0]:
            self.mrope = getattr(mm_runner, "mrope", None)
        if self.reads_layers:
            decoder = target_decoder(target)
            decoder.aux_layers = eagle3_aux_layers(self.hf_config, len(decoder.layers))

    @torch.inference_mode()
    def step(self, inputs: StepInputs, sampled: list[RequestState], batch: InputBatch,
             hidden: torch.Tensor, rope_positions: torch.Tensor | None = None) -> dict[str, list[int]]:
        """``rope_positions``: the target's (M-RoPE's, for an image-text target), which an M-RoPE head rotates at;
        a 1-D head rotates at the tokens' indices (asyncllm/models/eagle_targets.py)."""
        meta = causal(inputs.attn_metadata)  # (not the target's both-ways image rows)
        decoder = target_decoder(self.target)
        target_hidden = self.model.combine(hidden, [decoder.aux_hidden[i] for i in decoder.aux_layers])
        firsts = _first_positions(inputs)
        next_ids = torch.from_numpy(self._next_ids(inputs, batch, firsts)).to(self.device)
        positions = rope_positions if self.mrope is not None and rope_positions is not None else inputs.positions
        if positions.dim() == 1:  # (an MTP layer has no M-RoPE table to enter)
            out, carried = self.model(next_ids, positions, self.kv_caches, meta, target_hidden)
        else:
            with self.model.layer_positions(positions) as flat:
                out, carried = self.model(next_ids, flat, self.kv_caches, meta, target_hidden)
        proposing = self.proposing(sampled)
        if not proposing:
            return {}
        self.chain_offsets = (None if self.mrope is None else
                              chain_offsets(self.mrope, [state.req_id for state in proposing], self.device))
        rows = torch.tensor(self._last_rows(inputs, proposing, firsts), dtype=torch.int64, device=self.device)
        first = self.model.draft_ids(out.index_select(0, rows))
        drafts = [first.cpu()]
        if self.k > 1:
            drafts.append(self._chain(proposing, batch.block_table, first, carried.index_select(0, rows), self.k - 1))
        rows_out = torch.cat([d.reshape(len(proposing), -1) for d in drafts], dim=1).tolist()
        return {state.req_id: row for state, row in zip(proposing, rows_out)}

    def one_pass(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                 hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.chain_offsets is not None:  # an M-RoPE head: drafts at index + delta, as the target decodes
            positions = positions + self.chain_offsets
        out, carried = self.model(ids, positions, self.kv_caches, meta, hidden)
        return self.model.draft_ids(out), carried

    @staticmethod
    def _next_ids(inputs: StepInputs, batch: InputBatch, firsts: list[int]) -> np.ndarray:
        """Each row's next token (a pad where it is not known: a rejected draft's row); ``firsts``:
        `_first_positions`."""
        starts = inputs.attn_metadata.query_start_loc_cpu
        ids = np.zeros(inputs.num_tokens, np.int64)
        for i, (req_id, first) in enumerate(zip(inputs.req_ids, firsts)):
            state = batch.requests.get(req_id)
            if state is None:
                continue
            following = state.token_ids[first + 1 : first + 1 + starts[i + 1] - starts[i]]
            ids[starts[i] : starts[i] + len(following)] = following
        return ids

    @staticmethod
    def _last_rows(inputs: StepInputs, states: list[RequestState], firsts: list[int]) -> list[int]:
        """Each request's row of its last accepted token (the one before the token just sampled)."""
        starts = inputs.attn_metadata.query_start_loc_cpu
        index = {req_id: i for i, req_id in enumerate(inputs.req_ids)}
        return [starts[index[s.req_id]] + s.num_tokens - 2 - firsts[index[s.req_id]] for s in states]



def _first_positions(inputs: StepInputs) -> list[int]:
    """The position of each request's first row in the step (its rows are the last of its sequence)."""
    meta = inputs.attn_metadata
    starts = meta.query_start_loc_cpu
    return [meta.seq_lens_cpu[i] - (starts[i + 1] - starts[i]) for i in range(len(inputs.req_ids))]

class MTPRunner(EagleRunner):
    """The target checkpoint's multi-token-prediction layer as its draft head (``method="mtp"``;
    asyncllm/models/mtp.py): read from the target's own checkpoint, it reads the target's final hidden states."""

    def load_model(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, rank: int, tp_size: int) -> None:
        config = self.config
        path = resolve_model_path(config.model, config.revision)
        target_cls, target_config = mtp_target(served_hf_config(path, config.hf_overrides, config.trust_remote_code))
        draft_config = config.replace(model=path, revision=None, speculative_config=None, enable_lora=False)
        self.model = load_model(draft_config, mtp_layer_config(target_config), self.device, dtype, rank, tp_size,
                                model_cls=mtp_class(target_cls))
        self.kv_spec = kv_cache_spec(mtp_cache_config(target_config), tp_size)
        self.kv_cache_dtype = kv_cache_dtype
        self.hf_config = target_config
