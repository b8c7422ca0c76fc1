"""Families' config arithmetic without torch (the models and the host's LoRA check read it: asyncllm/lora.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["LATENT_TARGETS", "falcon_kv_heads", "kv_heads", "latent_attention_shapes", "lfm2_intermediate_size",
           "mlp_width", "omni_thinker_config"]

LATENT_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
"""Latent attention's projections beyond ``q_proj`` / ``o_proj`` (DeepSeek-V2 / V3's, asyncllm/models/deepseek.py)."""


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


def kv_heads(cfg: Any) -> int:
    """KV heads under each family's fields: Falcon's layouts, GPTBigCode's ``multi_query`` (one), DBRX's
    ``attn_config.kv_n_heads``, else ``num_key_value_heads`` or one per attention head."""
    if hasattr(cfg, "new_decoder_architecture"):
        return falcon_kv_heads(cfg)
    if getattr(cfg, "multi_query", False):
        return 1
    if hasattr(getattr(cfg, "attn_config", None), "kv_n_heads"):  # DBRX's
        return cfg.attn_config.kv_n_heads
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def mlp_width(cfg: Any) -> int:
    """The dense MLP's width under each family's fields: LFM2's computed one, GPT-2's / GPT-J's ``n_inner``, Llama 4's
    ``intermediate_size_mlp``, ``intermediate_size``, OPT's ``ffn_dim``, Falcon's ``ffn_hidden_size``, MPT's
    ``expansion_ratio`` x hidden; 4 x hidden where the config names none (GPT-2, GPT-J, Falcon, BLOOM)."""
    if hasattr(cfg, "block_auto_adjust_ff_dim"):
        return lfm2_intermediate_size(cfg)
    if hasattr(cfg, "expansion_ratio"):
        return int(cfg.expansion_ratio * cfg.hidden_size)
    if hasattr(cfg, "n_inner"):
        return cfg.n_inner or 4 * cfg.hidden_size
    return (getattr(cfg, "intermediate_size_mlp", None) or getattr(cfg, "intermediate_size", None)
            or getattr(cfg, "ffn_dim", None) or getattr(cfg, "ffn_hidden_size", None) or 4 * cfg.hidden_size)


def latent_attention_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """Latent attention's projections, (in, out) features: the query's ``q_proj`` (or ``q_a_proj`` then ``q_b_proj``
    with ``q_lora_rank``), ``kv_a_proj_with_mqa`` (the latent and the shared rotary key), ``kv_b_proj`` (the latent
    to each head's key and value), ``o_proj``."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    query = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    shapes = {"kv_a_proj_with_mqa": (hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
              "kv_b_proj": (cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
              "o_proj": (heads * cfg.v_head_dim, hidden)}
    if cfg.q_lora_rank is None:
        return {"q_proj": (hidden, query), **shapes}
    return {"q_a_proj": (hidden, cfg.q_lora_rank), "q_b_proj": (cfg.q_lora_rank, query), **shapes}


_OMNI_ARCHITECTURES = {"qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
                       "qwen3_omni_moe": "Qwen3OmniMoeForConditionalGeneration"}
"""The full Qwen-Omni configs (thinker, talker, vocoder) whose thinker is served, and their architectures."""


def omni_thinker_config(config: Any) -> Any:
    """A ``Qwen2_5OmniForConditionalGeneration`` or ``Qwen3OmniMoeForConditionalGeneration`` config -> its
    ``thinker_config``, under the checkpoint's architecture (the one served: asyncllm/models/qwen2_5_omni.py and
    qwen3_omni.py, whose talker and vocoder are not built, whatever the checkpoint's ``enable_audio_output``); any
    other config unchanged."""
    thinker = getattr(config, "thinker_config", None)
    architecture = _OMNI_ARCHITECTURES.get(getattr(config, "model_type", None))
    if architecture is None or thinker is None:
        return config
    thinker.architectures = list(getattr(config, "architectures", None) or [architecture])
    return thinker
