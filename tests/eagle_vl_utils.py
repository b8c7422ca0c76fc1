"""An image-text target and an EAGLE-3 head that computes it exactly, so every greedy draft must be accepted.

The target is a copy of a tiny Qwen2-VL-family (or Llama 4, LLaVA, Gemma 3) checkpoint whose decoder's attention
and MLP outputs are zeroed (``o_proj`` and ``down_proj``, experts' too) and whose final norm scales by a random
vector of either sign (so that a tied LM head's argmax is not the token itself): its next token is ``g(x)``, the
LM head's argmax over the normalized and scaled input row of the last token (an image's feature row where the
prompt ends inside an image). The head (SpecForge's config: ``LlamaForCausalLMEagle3``; ``rope_scaling: {"type":
"mrope", ...}`` for an M-RoPE target) attends to its own row only: its queries and keys are one large vector
(biases; zero weights), rotated by the row's (M-RoPE) position, so a row's score with itself beats every other
row's by far; its values copy the embedding of the row's next token, its residual from the target's states is
zeroed (``hidden_norm`` zero, ``norm_before_residual``), its MLP adds nothing and its final norm scales as the
target's. So at a row followed by token ``x`` it proposes ``g(x)``: the target's token after ``x``, at every draft
of the chain. Rows that share a position (a position read wrong) mix their values, and a draft read from the wrong
token is rejected.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

__all__ = ["make_exact_eagle3_pair"]

SCALE = 160.0
"""The queries' and keys' length: adjacent image rows (one apart on the width axis only) score ~40 below a row's
own."""


def make_exact_eagle3_pair(src: str, root: str) -> tuple[str, str]:
    """(target, head) folders under ``root`` from the image-text checkpoint ``src``."""
    from safetensors.torch import load_file, save_file

    target, head = os.path.join(root, "target"), os.path.join(root, "head")
    shutil.copytree(src, target)
    with open(os.path.join(target, "config.json")) as f:
        text = json.load(f)["text_config"]
    weights = load_file(os.path.join(target, "model.safetensors"))
    norm = next(name for name in ("model.language_model.norm.weight", "language_model.model.norm.weight",
                                  "model.norm.weight") if name in weights)
    decoder = norm.removesuffix("norm.weight")
    for name in weights:  # attention outputs, MLPs', experts' (Llama 4's fused ``experts.down_proj``)
        if name.startswith(decoder + "layers.") and name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
            weights[name] = torch.zeros_like(weights[name])
    scale = torch.randn(weights[norm].shape, generator=torch.Generator().manual_seed(1))  # either sign
    weights[norm] = scale - 1 if text["model_type"].startswith("gemma") else scale  # Gemma's norms scale by 1 + w
    save_file(weights, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(head)
    with open(os.path.join(head, "config.json"), "w") as f:
        json.dump(_head_config(text), f)
    lm_head = next((weight for name, weight in weights.items() if name.endswith("lm_head.weight")),
                   weights[decoder + "embed_tokens.weight"])  # tied
    save_file(_head_weights(text, lm_head, scale), os.path.join(head, "model.safetensors"))
    return target, head


def _head_config(text: dict) -> dict:
    h, heads = text["hidden_size"], text["num_attention_heads"]
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
            "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": h // heads,
            "intermediate_size": text["intermediate_size"], "vocab_size": text["vocab_size"],
            "draft_vocab_size": text["vocab_size"], "rms_norm_eps": text["rms_norm_eps"],
            "max_position_embeddings": text["max_position_embeddings"], "hidden_act": "silu",
            "num_hidden_layers": 1, "attention_bias": True, "norm_before_residual": True,
            "eagle_aux_hidden_state_layer_ids": [0, 1, 1], "tie_word_embeddings": False,
            "rope_theta": 10.0,  # every band turns fast enough to tell adjacent rows apart
            **_head_rope(text)}


def _head_rope(text: dict) -> dict:
    """SpecForge's M-RoPE entry for an M-RoPE target (Qwen2-VL family); none (a plain rope) for another."""
    section = text["rope_parameters"].get("mrope_section")
    return {"rope_scaling": {"type": "mrope", "mrope_section": section}} if section else {}


def _head_weights(text: dict, lm_head: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    h, inter = text["hidden_size"], text["intermediate_size"]
    g = torch.Generator().manual_seed(0)
    direction = torch.ones(h) / (h // text["num_attention_heads"]) ** 0.5  # one unit vector per head
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    return {attn + "q_proj.weight": torch.zeros(h, 2 * h), attn + "k_proj.weight": torch.zeros(h, 2 * h),
            attn + "q_proj.bias": SCALE * direction, attn + "k_proj.bias": SCALE * direction,
            attn + "v_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1), attn + "v_proj.bias": torch.zeros(h),
            attn + "o_proj.weight": torch.eye(h), attn + "o_proj.bias": torch.zeros(h),
            mlp + "gate_proj.weight": torch.randn(inter, h, generator=g), mlp + "up_proj.weight": torch.randn(inter, h, generator=g),
            mlp + "down_proj.weight": torch.zeros(h, inter),
            "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.zeros(h),
            "midlayer.post_attention_layernorm.weight": torch.ones(h), "norm.weight": scale,
            "fc.weight": 0.2 * torch.randn(h, 3 * h, generator=g), "lm_head.weight": lm_head.clone()}
