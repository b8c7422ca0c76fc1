"""Writing a tiny safetensors checkpoint as a GGUF file, as llama.cpp's converter does, for the GGUF tests.

Written from the format (llama.cpp's ``convert_hf_to_gguf.py``), not from asyncllm's loader: the tensors are
renamed with gguf's own name table, a llama file's q and k rows are permuted as ``LlamaModel.permute`` does, 2-D
weights are stored in ``qtype`` (quantized by ``gguf.quants.quantize``, numpy) and 1-D ones (norms, biases) in F32,
and the metadata is what transformers reads back (config keys under the architecture's prefix, token ids) and
what llama.cpp's converter adds for Gemma 2 / 3 and Phi-3 (a Gemma file's norm weights are stored plus one). Rope
scaling is written as llama.cpp writes it: a linear one as ``rope.scaling.type`` / ``factor`` metadata, a llama3 one
(Llama 3.1 / 3.2) as the ``rope_freqs.weight`` tensor of per-frequency divisors and no metadata.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, RopeScalingType, get_tensor_name_map
from gguf.quants import quantize
from safetensors.torch import load_file

_PERMUTED = ("llama",)
_NORM_PLUS_ONE = ("gemma2", "gemma3")
"""Architectures whose norm weights llama.cpp's converter stores plus one (``Gemma2Model.modify_tensors``: Gemma's
RMSNorm scales by ``1 + w``, llama.cpp's by ``w``)."""


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from two rotary halves to interleaved pairs."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _rope(cfg: dict) -> dict:
    """The rope parameters llama.cpp writes: Gemma 3's global (full-attention) layers' for a per-layer-type dict."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    return dict(rope.get("full_attention", rope))


def llama3_rope_freqs(cfg: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.generate_extra_tensors``: per frequency, the divisor taking the base inverse
    frequency to the llama3-scaled one, in its float32 torch arithmetic. One deviation: llama.cpp reads
    original_max_position_embeddings from the config's top level (8192 when absent, every Llama 3.1 / 3.2's
    value); here it is the rope parameters' own, as transformers reads it, so a tiny model can use a small one."""
    rope = _rope(cfg)
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings", 8192))
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _rope_scaling_metadata(writer: GGUFWriter, cfg: dict) -> None:
    """llama.cpp's ``TextModel.set_gguf_parameters`` for linear and YaRN scaling (llama3 writes no metadata)."""
    rope = _rope(cfg)
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _metadata(writer: GGUFWriter, cfg: dict, name: str, head_dim: int) -> None:
    writer.add_name(name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(float(_rope(cfg).get("rope_theta", cfg.get("rope_theta", 1e4))))
    partial = _rope(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))  # Phi-3's rotary share
    writer.add_rope_dimension_count(int(head_dim * partial))
    _rope_scaling_metadata(writer, cfg)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:  # llama.cpp's SpecialVocab (transformers' Phi-3 default is 32000)
        writer.add_pad_token_id(cfg["pad_token_id"])
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if num_experts:  # a mixture of experts, as llama.cpp's converter writes one
        writer.add_key_length(head_dim)
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _family_metadata(writer: GGUFWriter, cfg: dict, arch: str, head_dim: int) -> None:
    """What llama.cpp's ``Gemma2Model`` / ``Gemma3Model`` / ``Phi3MiniModel.set_gguf_parameters`` add."""
    if arch in _NORM_PLUS_ONE:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings")
                                             or cfg["max_position_embeddings"])
        if cfg.get("sliding_window"):
            writer.add_sliding_window(cfg["sliding_window"])


def _tokenizer(writer: GGUFWriter, folder: str) -> None:
    """The byte-level BPE of ``tokenizer.json`` as llama.cpp stores one (``gpt2`` with Qwen2's split, the tiny
    tokenizers' pipeline); added tokens are control tokens."""
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    control = {t["content"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in control else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_add_bos_token(True)


def _gguf_tensor(name: str, weight: torch.Tensor, cfg: dict, arch: str, qtype: GGMLQuantizationType) -> tuple:
    data = weight.float().numpy()
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    kind = name.split(".")[-2]
    if arch in _PERMUTED and kind in heads:
        data = llama_cpp_permute(data, heads[kind])
    if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
        data = data + 1
    if data.ndim == 1 or qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32), GGMLQuantizationType.F32
    return quantize(np.ascontiguousarray(data, dtype=np.float32), qtype), qtype


def _stacked_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert matrices (``mlp.experts.{e}.gate_proj.weight``) stacked by expert as llama.cpp's converter does
    (``mlp.experts.gate_proj.weight``: ``[experts, out, in]``)."""
    out, experts = {}, {}
    for name, weight in weights.items():
        match = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if match is None:
            out[name] = weight
        else:
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = weight
    out.update({name: torch.stack([by[e] for e in sorted(by)]) for name, by in experts.items()})
    return out


def write_gguf(folder: str, path: str, arch: str = "llama",
               qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0, name: str | None = None) -> str:
    """The safetensors checkpoint in ``folder`` (a float32 tiny model) written to ``path`` as a GGUF file
    (``general.name`` ``name``: transformers reads a llama file named "mistral" as Mistral)."""
    cfg = _config(folder)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    gguf_arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)
    table = get_tensor_name_map(gguf_arch, cfg["num_hidden_layers"])
    writer = GGUFWriter(path, arch)
    _metadata(writer, cfg, name or f"tiny-{arch}", head_dim)
    _family_metadata(writer, cfg, arch, head_dim)
    _tokenizer(writer, folder)
    for hf_name, weight in sorted(_stacked_experts(load_file(os.path.join(folder, "model.safetensors"))).items()):
        stem, _, suffix = hf_name.rpartition(".")
        name = f"{table.get_name(stem)}.{suffix}"
        data, stored = _gguf_tensor(name, weight, cfg, arch, qtype)
        writer.add_tensor(name, data, raw_dtype=stored)
    if _rope(cfg).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg, head_dim), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
"""Llama 3.1's rope scaling with a small original context, so prompts cross it; on the tiny Llama's head dim 16 it
leaves frequency 0 as is, smooths frequency 1 and divides the other 6 by 8."""
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def with_rope_parameters(folder: str, rope: dict, dest: str) -> str:
    """A copy of the checkpoint in ``folder`` at ``dest`` with ``rope`` as its config's ``rope_parameters`` (the
    weights do not depend on them): the original model a scaled GGUF file is converted from."""
    shutil.copytree(folder, dest)
    cfg = _config(dest)
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = dict(rope)
    with open(os.path.join(dest, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return dest


def hf_gguf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """transformers' float32 model loaded from the GGUF file (its own dequantization and un-permutation)."""
    from hf_reference import _hf_model

    return dict(_hf_model(path).state_dict())
