"""The adaptable projections of the hybrids whose layers differ (torch-free: the host's LoRA check reads them).

Kimi-Linear: a latent-attention layer has DeepSeek's projections (`latent_attention_shapes`), a Kimi Delta Attention
layer its own, both under ``self_attn.``; a dense layer's MLP has ``gate_proj`` / ``up_proj`` / ``down_proj``, a
mixture of experts' none (its experts and shared experts are checked as DeepSeek-V3's: asyncllm/lora_experts.py).

Zamba2: a hybrid layer's invocation of its shared block has the block's attention (on the ``2 x hidden`` input)
and its MLP's fused ``gate_up_proj`` and ``down_proj`` (PEFT names them ``layers.N.shared_transformer.self_attn.*`` /
``feed_forward.*``: one adapter per hybrid layer, asyncllm/lora_names.py reads them as ``self_attn.`` / ``mlp.``);
a Mamba2 layer has none (its ``in_proj`` / ``out_proj`` are refused, as every hybrid's state layers').

Mamba, Falcon Mamba, Mamba2 (no attention, no MLP): every layer's mixer has ``in_proj`` and ``out_proj``, Mamba's
and Falcon Mamba's ``x_proj`` and ``dt_proj`` too (`state_space_shapes`), under ``mixer.``.

MiniMax-Text-01: a lightning layer has its fused-per-head ``qkv_proj``, ``output_gate`` and ``out_proj`` (named
``o_proj`` here, as asyncllm/lora_names.py writes every attention's ``out_proj``), a softmax layer Llama's attention,
both under ``self_attn.``; every layer's MLP is a mixture of experts (checked as Mixtral's).
"""

from __future__ import annotations

from typing import Any

from asyncllm.models.family_config import latent_attention_shapes

__all__ = ["KDA_TARGETS", "MAMBA_TARGETS", "kimi_linear_shapes", "minimax_shapes", "state_space_shapes",
           "zamba2_shapes"]

MAMBA_TARGETS = ("in_proj", "x_proj", "dt_proj", "out_proj")
"""The attention-free Mamba models' mixer projections (PEFT's and vLLM's targets; Mamba2 has no ``x_proj`` /
``dt_proj``)."""

KDA_TARGETS = ("f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj")
"""A KDA layer's projections beyond ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``: its decay's (transformers'
``forget_gate.f_a_proj`` / ``f_b_proj``), its write strength's and its output gate's."""


def kimi_linear_shapes(cfg: Any) -> list[dict[str, tuple[int, int]]]:
    """Each layer's projections, (input features, output features), by checkpoint name."""
    hidden, head_dim = cfg.hidden_size, cfg.linear_head_dim
    width = cfg.linear_num_heads * head_dim
    kda = {"q_proj": (hidden, width), "k_proj": (hidden, width), "v_proj": (hidden, width),
           "f_a_proj": (hidden, head_dim), "f_b_proj": (head_dim, width), "b_proj": (hidden, cfg.linear_num_heads),
           "g_a_proj": (hidden, head_dim), "g_b_proj": (head_dim, width), "o_proj": (width, hidden)}
    inter = cfg.intermediate_size
    dense = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return [{**(kda if kind == "linear_attention" else latent_attention_shapes(cfg)),
             **(dense if cfg.mlp_layer_types[i] == "dense" else {})} for i, kind in enumerate(cfg.layer_types)]


def zamba2_shapes(cfg: Any) -> list[dict[str, tuple[int, int]]]:
    """Each layer's projections: a hybrid layer's shared-block invocation's, none for a Mamba2 layer."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or 2 * hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim
    block = {"q_proj": (2 * hidden, q), "k_proj": (2 * hidden, kv), "v_proj": (2 * hidden, kv), "o_proj": (q, hidden),
             "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}
    return [dict(block) if kind == "hybrid" else {} for kind in cfg.layer_types]


def minimax_shapes(cfg: Any) -> list[dict[str, tuple[int, int]]]:
    """Each layer's attention projections: a lightning layer's or a softmax layer's."""
    hidden, head_dim = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    width, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    lightning = {"qkv_proj": (hidden, 3 * width), "output_gate": (hidden, width), "o_proj": (width, hidden)}
    softmax = {"q_proj": (hidden, width), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (width, hidden)}
    return [dict(lightning if kind == "linear_attention" else softmax) for kind in cfg.layer_types]


def state_space_shapes(cfg: Any) -> dict[str, tuple[int, int]] | None:
    """An attention-free Mamba model's mixer projections (every layer's); None for any other model."""
    model_type = getattr(cfg, "model_type", None)
    hidden = cfg.hidden_size
    if model_type in ("mamba", "falcon_mamba"):
        inner, rank, state = cfg.intermediate_size, int(cfg.time_step_rank), cfg.state_size
        return {"in_proj": (hidden, 2 * inner), "x_proj": (inner, rank + 2 * state), "dt_proj": (rank, inner),
                "out_proj": (inner, hidden)}
    if model_type == "mamba2":
        inner = cfg.num_heads * cfg.head_dim
        return {"in_proj": (hidden, 2 * inner + 2 * cfg.n_groups * cfg.state_size + cfg.num_heads),
                "out_proj": (inner, hidden)}
    return None
