"""Adapter tensor names as the models name their projections (the host's check and the workers' load read them
alike; torch-free).

PEFT names an adapter's matrices after transformers' modules; asyncllm's models name some of them otherwise
(checkpoint names are renamed as they load). `canonical_name` writes an adapter's name as the model's, so that one
table of projection names and shapes (asyncllm/lora.py) serves every family.
"""

from __future__ import annotations

import re

__all__ = ["canonical_name"]

_PER_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Mixtral's original expert matrix names -> the gate / up / down projections."""
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.")
_DENSE_SWIGLU = re.compile(r"\.mlp\.(w1|w2|w3)\.")
_LAYER_PREFIXES = ("transformer.h.", "model.decoder.layers.", "gpt_neox.layers.")
_GPT_LAYER_NAMES = ((re.compile(r"^(model\.layers\.\d+)\.fc1\."), r"\1.mlp.c_fc."),  # OPT's MLP, on the layer
                    (re.compile(r"^(model\.layers\.\d+)\.fc2\."), r"\1.mlp.c_proj."),
                    (re.compile(r"\.attn\."), ".self_attn."),  # GPT-J's
                    (re.compile(r"\.mlp\.fc_in\."), ".mlp.c_fc."), (re.compile(r"\.mlp\.fc_out\."), ".mlp.c_proj."),
                    (re.compile(r"\.self_attn\.c_attn\."), ".self_attn.qkv_proj."),  # GPT-2's, GPTBigCode's
                    (re.compile(r"\.self_attn\.c_proj\."), ".self_attn.o_proj."),
                    (re.compile(r"\.self_attention\.query_key_value\."), ".self_attn.qkv_proj."),  # Falcon's
                    (re.compile(r"\.self_attention\.dense\."), ".self_attn.o_proj."),
                    (re.compile(r"\.attention\.query_key_value\."), ".self_attn.qkv_proj."),  # GPT-NeoX's
                    (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
                    (re.compile(r"\.mlp\.dense_h_to_4h\."), ".mlp.c_fc."),
                    (re.compile(r"\.mlp\.dense_4h_to_h\."), ".mlp.c_proj."))
"""GPT-J's, OPT's, GPT-2's, GPTBigCode's, Falcon's and GPT-NeoX's layer names as the models name them."""
_DBRX_NAMES = ((".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
               (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
               (".ffn.router.layer.", ".mlp.gate."),
               (".attn.Wqkv.", ".self_attn.qkv_proj."), (".attn.out_proj.", ".self_attn.o_proj."),  # MPT's
               (".ffn.up_proj.", ".mlp.c_fc."), (".ffn.down_proj.", ".mlp.c_proj."))
"""DBRX's and MPT's layer names as the models name them (DBRX's router then refused as any model's)."""
_PHI_NAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.c_fc."), (".mlp.fc2.", ".mlp.c_proj."))
"""Phi-1 / 1.5 / 2's attention output and GELU MLP as the model names them (StarCoder2's ``c_fc`` / ``c_proj``)."""
_MIXER = re.compile(r"\.mixer\.(q_proj|k_proj|v_proj|o_proj|up_proj|down_proj)\.")


def canonical_name(name: str) -> str:
    """A tensor name with Mixtral's ``block_sparse_moe.experts.{e}.w1`` written as ``mlp.experts.{e}.gate_proj``,
    Llama 4's and LFM2's ``feed_forward.`` as ``mlp.``, a dense SwiGLU's ``w1`` / ``w3`` / ``w2`` (LFM2's) as
    ``gate_proj`` / ``up_proj`` / ``down_proj``, an attention's ``out_proj`` (LFM2's) and ``dense`` (Phi's) as
    ``o_proj`` and Phi's ``fc1`` / ``fc2`` as ``c_fc`` / ``c_proj``, GPT-J's and OPT's layers as Llama's: the model's
    names; Nemotron-H's ``backbone.`` as ``model.`` and its attention and MLP layers' ``mixer.`` as ``self_attn.`` /
    ``mlp.`` (its Mamba2 and MoE mixers' names stay, refused); DBRX's ``transformer.blocks.N.norm_attn_norm.attn.Wqkv``
    / ``out_proj`` as ``model.layers.N.self_attn.qkv_proj`` / ``o_proj``; Kimi-Linear's ``self_attn.forget_gate.`` as
    ``self_attn.``; Zamba2's ``layers.N.shared_transformer.self_attn.`` / ``feed_forward.`` as ``layers.N.self_attn.``
    / ``mlp.``."""
    name = "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name
    if name.startswith("transformer.blocks."):  # DBRX's, MPT's
        name = "model.layers." + name.removeprefix("transformer.blocks.")
        for old, new in _DBRX_NAMES:
            name = name.replace(old, new)
    for prefix in _LAYER_PREFIXES:  # GPT-J's transformer.h.N., OPT's model.decoder.layers.N.
        if name.startswith(prefix):
            name = "model.layers." + name.removeprefix(prefix)
            for pattern, replacement in _GPT_LAYER_NAMES:
                name = pattern.sub(replacement, name)
    name = _MIXER.sub(lambda m: f".{'mlp' if m.group(1) in ('up_proj', 'down_proj') else 'self_attn'}.{m.group(1)}.",
                      name)
    name = name.replace(".shared_transformer.", ".")  # Zamba2's hybrid layers' invocations of their shared blocks
    name = name.replace(".feed_forward.", ".mlp.").replace(".self_attn.out_proj.", ".self_attn.o_proj.")
    name = name.replace(".encoder_attn.out_proj.", ".encoder_attn.o_proj.")  # Whisper's cross-attention
    name = name.replace(".self_attn.forget_gate.", ".self_attn.")  # Kimi-Linear's KDA decay projections
    for old, new in _PHI_NAMES:
        name = name.replace(old, new)
    name = _DENSE_SWIGLU.sub(lambda m: f".mlp.{_PER_EXPERT[m.group(1)]}.", name)
    return _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_PER_EXPERT[m.group(2)]}.", name)
