"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3's latent attention
and experts (asyncllm/models/deepseek.py, deepseek_moe.py) with DeepSeek Sparse Attention.

Each layer adds a lightning indexer beside its latent attention: its own queries from the low-rank query latent
(``wq_b``, ``index_n_heads`` heads of ``index_head_dim``), one key per token (``wk`` then a LayerNorm), both rotated
on their first ``qk_rope_head_dim`` dims (half-split pairs in V3.2, interleaved in GLM-5); a query scores each causal
key ``sum_h relu(q_h . k * index_head_dim ** -0.5) * w_h`` with the per-head weights ``weights_proj(x) *
index_n_heads ** -0.5`` (float32), and attends (the absorbed latent attention) to its ``index_topk`` best keys only:
all of them while its context holds no more.

- **Cache.** Beside each layer's latent cache (one row per token, docs/deepseek.md) a one-part indexer cache of one
  ``index_head_dim``-wide head holds the rotated indexer keys: two cache layers per decoder layer (GLM-5's layers
  that reuse the previous layer's choice, ``indexer_types`` "shared", have no indexer and no second cache), on the
  same blocks, so prefix caching, preemption and the block accounting cover both.
- **Steps.** A step whose every context fits in ``index_topk`` keys is dense: the backend attends as for V3 (the
  indexer only writes its keys). Otherwise the indexer scores each request's queries against its cached keys and
  the chosen latent rows are attended in torch (`sparse_latent_attention`), read through the block tables at their
  slots only (`chosen_slots`: a step reads ``index_topk`` rows a query, whatever the context): a Triton sparse
  kernel is not built, and such steps are not captured in CUDA graphs. Calibrated fp8 KV-cache scales are refused
  at load, as for every one-part latent cache (asyncllm/models/kv_scales.py).
- **Parallelism.** The indexer is whole on every rank (its choice is the same everywhere); the latent attention's
  heads split as V3's. LoRA adapters apply as V3's (the latent attention's projections, the MLPs and experts); an
  adapter of the indexer's own projections is refused by name. A pipeline stage runs its own layers
  (`SparseModel.run_stage`) over its layers' latent and indexer caches; a stage after the first must begin with a
  layer that runs its own indexer (GLM-5's "shared" layers reuse a choice no stage sends on:
  `check_indexer_split`).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import ConfigError
from asyncllm.kernels import reference
from asyncllm.models.deepseek import (
    DeepseekAttention, DeepseekDecoderLayer, DeepseekModel, DeepseekV3ForCausalLM, pairs_to_halves,
)
from asyncllm.models.deepseek_sparse_config import check_indexer_split, has_indexer
from asyncllm.models.layers import TensorParallel, new_param
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.llama import DecoderBuild
from asyncllm.models.pipeline import PipelineStage

__all__ = ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "LightningIndexer", "chosen_slots", "latent_rows",
           "sparse_latent_attention"]

_K_NORM_EPS = 1e-6
"""transformers' indexer ``k_norm``: a LayerNorm with this eps (not ``rms_norm_eps``)."""
_CHUNK_ELEMENTS = 1 << 24
"""How many score or gathered-row elements one chunk of queries may hold (the torch path's memory bound)."""

Selection = list[torch.Tensor | None]
"""Per request of a step: each query's chosen key positions ``[queries, k]`` (-1: none), or None where the request's
context fits in ``index_topk`` (every causal key)."""


class StepChoice:
    """What a layer's indexer chose this step, for GLM-5's "shared" layers after it (one per forward)."""

    selection: Selection | None = None


def _query_chunks(queries: int, per_query: int) -> Iterator[slice]:
    """Slices of ``queries`` rows, each at most `_CHUNK_ELEMENTS` elements of ``per_query``."""
    step = max(1, _CHUNK_ELEMENTS // max(1, per_query))
    return (slice(start, min(start + step, queries)) for start in range(0, queries, step))


def _cached_rows(cache: torch.Tensor, metadata: AttentionMetadata, request: int, dtype: torch.dtype) -> torch.Tensor:
    """Request ``request``'s cached rows ``[context, width]`` in ``dtype``."""
    rows = reference.gather_kv(cache, metadata.block_tables[request], metadata.seq_lens_cpu[request])[0]
    return rows[:, 0].to(dtype)


class LightningIndexer(nn.Module):
    """One layer's indexer: writes its keys to its cache and chooses each query's ``index_topk`` keys."""

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__()
        cfg, whole = b.hf_config, TensorParallel()  # small: whole on every rank
        self.heads, self.dim, self.rope = int(cfg.index_n_heads), int(cfg.index_head_dim), int(cfg.qk_rope_head_dim)
        self.topk = int(cfg.index_topk)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, self.heads * self.dim, False, whole, b.dtype)
        self.wk = ColumnParallelLinear(cfg.hidden_size, self.dim, False, whole, b.dtype)
        self.k_norm = nn.Module()
        self.k_norm.weight = new_param(self.dim, dtype=b.dtype)
        self.k_norm.bias = new_param(self.dim, dtype=b.dtype)
        self.weights_proj = ColumnParallelLinear(cfg.hidden_size, self.heads, False, whole, torch.float32)
        self.interleaved = cfg.model_type == "glm_moe_dsa"  # GLM-5 rotates interleaved pairs, V3.2 half-split
        self.rotary_emb = b.rotary_emb

    def _rotated(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T, heads, dim]`` with its first ``rope`` dims rotated (the rest pass)."""
        if self.interleaved:
            x = torch.cat([pairs_to_halves(x[..., :self.rope]), x[..., self.rope:]], dim=-1)
        return reference.apply_rotary(x, x[:, :1], positions, self.rotary_emb.cos_sin_cache)[0]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, q_latent: torch.Tensor, cache: torch.Tensor,
                metadata: AttentionMetadata) -> Selection | None:
        """Write this step's keys; the step's choice, or None when every context fits in ``index_topk``."""
        key = F.layer_norm(self.wk(hidden), (self.dim,), self.k_norm.weight, self.k_norm.bias, _K_NORM_EPS)
        reference.write_kv_cache(self._rotated(key.unsqueeze(1), positions), None, cache, metadata.slot_mapping)
        if max(metadata.seq_lens_cpu) <= self.topk:
            return None
        query = self._rotated(self.wq_b(q_latent).view(-1, self.heads, self.dim), positions).float()
        weights = self.weights_proj(hidden.float()) * self.heads**-0.5  # [T, heads], float32 as transformers'
        starts = metadata.query_start_loc_cpu
        return [self._choose(query[a:b], weights[a:b], positions[a:b], cache, metadata, i) if context > self.topk
                else None for i, (a, b, context) in enumerate(zip(starts, starts[1:], metadata.seq_lens_cpu))]

    def _choose(self, query: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                metadata: AttentionMetadata, request: int) -> torch.Tensor:
        """One request's queries' best ``index_topk`` causal keys ``[queries, topk]`` (-1 past the causal ones)."""
        keys = _cached_rows(cache, metadata, request, torch.float32)  # [context, dim]
        key_positions = torch.arange(keys.shape[0], device=keys.device)
        chosen = []
        for rows in _query_chunks(query.shape[0], self.heads * keys.shape[0]):
            scores = F.relu(torch.einsum("qhd,kd->qhk", query[rows], keys) * self.dim**-0.5)
            scores = torch.einsum("qhk,qh->qk", scores, weights[rows])
            scores = scores.masked_fill(key_positions[None, :] > positions[rows, None], float("-inf"))
            best, ids = scores.topk(self.topk, dim=-1)
            chosen.append(ids.masked_fill(best == float("-inf"), -1))
        return torch.cat(chosen)


def chosen_slots(metadata: AttentionMetadata, selection: Selection, positions: torch.Tensor) -> torch.Tensor:
    """Each query's chosen keys as latent-cache slots ``[T, k]`` (-1: none; ``k`` the widest choice, at most
    ``index_topk``): a request's chosen positions mapped through its block table (every causal position where its
    selection is None: its context holds no more), so a step reads those rows only, whatever its contexts' length."""
    starts, size = metadata.query_start_loc_cpu, metadata.block_size
    slots = []
    for request, (a, b) in enumerate(zip(starts, starts[1:])):
        ids = selection[request]
        if ids is None:
            every = torch.arange(metadata.seq_lens_cpu[request], device=positions.device)
            ids = every[None, :].masked_fill(every[None, :] > positions[a:b, None], -1)
        blocks = metadata.block_tables[request][ids.clamp(min=0) // size].long()
        slots.append((blocks * size + ids % size).masked_fill(ids < 0, -1))
    width = max(ids.shape[1] for ids in slots)
    return torch.cat([F.pad(ids, (0, width - ids.shape[1]), value=-1) for ids in slots])


def latent_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A one-part cache's rows at ``slots`` (no negatives) -> ``[*slots.shape, width]`` in the cache's dtype."""
    raw = cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache  # fp8: index the bytes (no CPU kernel)
    return raw[0].flatten(0, 1)[slots, 0].view(cache.dtype)


def sparse_latent_attention(query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                            selection: Selection, scale: float, positions: torch.Tensor) -> torch.Tensor:
    """Absorbed queries ``[T, heads, width]`` over each one's chosen rows of the latent cache (every causal row where
    a request's selection is None) -> ``[T, heads, width]``: the softmax-weighted rows, as the backends return. Only
    the chosen rows are read (`chosen_slots`), in chunks of queries that bound the memory."""
    slots = chosen_slots(metadata, selection, positions)
    out = torch.empty_like(query)
    for part in _query_chunks(query.shape[0], slots.shape[1] * max(query.shape[1], query.shape[2])):
        ids = slots[part]
        picked = latent_rows(cache, ids.clamp(min=0)).to(query.dtype).float()  # [queries, k, width]
        scores = torch.einsum("qhd,qkd->qhk", query[part].float(), picked) * scale
        scores = scores.masked_fill((ids < 0)[:, None, :], float("-inf"))
        out[part] = torch.einsum("qhk,qkd->qhd", scores.softmax(dim=-1), picked).to(out.dtype)
    return out


class SparseAttention(DeepseekAttention):
    """DeepSeek-V3's absorbed latent attention over each query's chosen keys (the module doc)."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.interleaved = True  # V3.2's and GLM-5's latent attention rotates interleaved pairs (no rope_interleave)
        self.indexer = LightningIndexer(b) if has_indexer(b.hf_config, layer_idx) else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: Any,
                metadata: AttentionMetadata) -> torch.Tensor:
        """``kv_cache``: (the latent cache, the indexer's or None, the step's `StepChoice`)."""
        latent_cache, index_cache, step = kv_cache
        q_latent = self.query_latent(hidden)
        query, key = self.query_and_key(positions, hidden, q_latent)
        if self.indexer is not None:
            step.selection = self.indexer(positions, hidden, q_latent, index_cache, metadata)
        if step.selection is None:
            out = self.attn(query, key, None, latent_cache, metadata)
        else:  # calibrated fp8 scales are refused at load (asyncllm/models/kv_scales.py: a one-part cache)
            reference.write_kv_cache(key, None, latent_cache, metadata.slot_mapping)
            out = sparse_latent_attention(query, latent_cache, metadata, step.selection, self.attn.scale, positions)
        return self.output(out.view(hidden.shape[0], self.num_heads, -1)[..., self.rope:])


class SparseDecoderLayer(DeepseekDecoderLayer):
    attention_cls = SparseAttention  # type: ignore[assignment]

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.num_kv_caches = 1 + (self.self_attn.indexer is not None)
        """Its latent cache, and its indexer's where it has one (a pipeline stage counts its caches)."""


class SparseModel(DeepseekModel):
    """V3's decoder stack; each layer gets its latent cache, its indexer's, and the step's choice. A pipeline stage
    runs its layers itself (`run_stage`): what crosses a boundary is Llama's (hidden, residual)."""

    layer_cls = SparseDecoderLayer

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        cfg, stage = b.hf_config, b.pipeline
        self.indexed = tuple(has_indexer(cfg, i) for i in range(cfg.num_hidden_layers))
        """Which layers run their own indexer (and keep its cache)."""
        self.hidden_size = int(cfg.hidden_size)
        if stage is not None and stage.size > 1:  # the host checked the whole split; this stage's bounds again
            parts = (stage.start_layer, stage.num_layers, cfg.num_hidden_layers - stage.end_layer)
            check_indexer_split(cfg, [count for count in parts if count])

    def caches_before(self, layer: int) -> int:
        """The KV caches of the layers before ``layer`` (a latent and maybe an indexer cache each): where a stage
        starting there finds its first."""
        return layer + sum(self.indexed[:layer])

    def layer_caches(self, start: int, end: int, kv_caches: list[torch.Tensor]) -> list[Any]:
        """Layers ``[start, end)``'s (latent cache, indexer cache or None, the step's `StepChoice`) from
        ``kv_caches``, theirs in order."""
        if len(kv_caches) != self.caches_before(end) - self.caches_before(start):
            raise ValueError(f"{len(kv_caches)} KV caches for layers {start} to {end - 1} and their indexers")
        caches, step = iter(kv_caches), StepChoice()
        return [(next(caches), next(caches) if self.indexed[i] else None, step) for i in range(start, end)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        grouped = self.layer_caches(0, len(self.layers), kv_caches)
        return super().forward(input_ids, positions, grouped, metadata, inputs_embeds)  # type: ignore[arg-type]

    def stage_widths(self, stage: PipelineStage) -> tuple[int, int]:
        """What a stage after the first receives: the hidden states and the residual stream."""
        return self.hidden_size, self.hidden_size

    def run_stage(self, stage: PipelineStage, received: tuple[torch.Tensor, torch.Tensor] | None,
                  input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                  metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The stage's layers over its caches: the final hidden states on the last stage, else (hidden, residual)
        to send on."""
        hidden, residual = received if received is not None else (self.embed(input_ids, positions, inputs_embeds),
                                                                   None)
        caches = self.layer_caches(stage.start_layer, stage.end_layer, kv_caches)
        for layer, cache in zip(self.layers[stage.start_layer : stage.end_layer], caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, cache, metadata)
        if stage.is_last:
            return self.final(hidden, residual)
        assert residual is not None, "a stage holds at least one layer"
        return hidden, residual


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 (-Exp): V3's layers, each with a lightning indexer choosing its queries' keys."""

    model_cls = SparseModel
    cuda_graphs_off = ("DeepSeek sparse attention's steps past index_topk keys run in torch per request (capturing "
                       "them is not built)")

    @classmethod
    def kv_cache_layers(cls, hf_config: Any) -> int:
        return len(cls.kv_cache_shapes(hf_config))

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        """Per decoder layer: its latent cache (one head of rotary key and latent), then its indexer's (one head of
        ``index_head_dim``) where it has an indexer."""
        latent = (1, int(hf_config.qk_rope_head_dim + hf_config.kv_lora_rank))
        indexer = (1, int(hf_config.index_head_dim))
        return [shape for i in range(hf_config.num_hidden_layers)
                for shape in ([latent, indexer] if has_indexer(hf_config, i) else [latent])]

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_sparse(hf_config)
        super().__init__(hf_config, **kwargs)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: V3.2's layers under GLM's names (its indexer's rope interleaved), and layers that reuse the previous
    indexer's choice (``indexer_types`` "shared")."""


def check_sparse(hf_config: Any) -> None:
    """`ConfigError` for indexer settings these classes cannot run."""
    if hf_config.q_lora_rank is None:
        raise ConfigError("q_lora_rank", None, "a low-rank query (the indexer reads its latent)")
    if hf_config.index_head_dim < hf_config.qk_rope_head_dim:
        raise ConfigError("index_head_dim", hf_config.index_head_dim, f">= qk_rope_head_dim "
                                                                      f"({hf_config.qk_rope_head_dim})")
    if not has_indexer(hf_config, 0):
        raise ConfigError("indexer_types", hf_config.indexer_types, "a first layer with its own indexer ('full')")
