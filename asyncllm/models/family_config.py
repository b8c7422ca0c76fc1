"""Families' config arithmetic without torch (the models and the host's LoRA check read it: asyncllm/lora.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["falcon_kv_heads", "lfm2_intermediate_size"]


def lfm2_intermediate_size(cfg: Any) -> int:
    """The MLP's width: ``intermediate_size``, or with ``block_auto_adjust_ff_dim`` two thirds of it, times
    ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of`` (transformers' rule)."""
    size = cfg.intermediate_size
    if not getattr(cfg, "block_auto_adjust_ff_dim", False):  # LFM2-MoE's dense layers: as it is
        return size
    size = int(2 * size / 3)
    if cfg.block_ffn_dim_multiplier is not None:
        size = int(cfg.block_ffn_dim_multiplier * size)
        size = cfg.block_multiple_of * ((size + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
    return size


def falcon_kv_heads(hf_config: Any) -> int:
    """Falcon's KV heads: ``num_kv_heads`` in the new architecture, one with ``multi_query``, else one per head."""
    if hf_config.new_decoder_architecture:
        return hf_config.num_kv_heads
    return 1 if hf_config.multi_query else hf_config.num_attention_heads
