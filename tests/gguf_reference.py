"""Writing a tiny safetensors checkpoint as a GGUF file, as llama.cpp's converter does, for the GGUF tests.

Written from the format (llama.cpp's ``convert_hf_to_gguf.py``), not from asyncllm's loader: the tensors are
renamed with gguf's own name table, a llama file's q and k rows are permuted as ``LlamaModel.permute`` does, 2-D
weights are stored in ``qtype`` (quantized by ``gguf.quants.quantize``, numpy) and 1-D ones (norms, biases) in F32,
and the metadata is what transformers reads back (config keys under the architecture's prefix, token ids).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import quantize
from safetensors.torch import load_file

_PERMUTED = ("llama",)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from two rotary halves to interleaved pairs."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _metadata(writer: GGUFWriter, cfg: dict, name: str, head_dim: int) -> None:
    writer.add_name(name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])


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
    if data.ndim == 1 or qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32), GGMLQuantizationType.F32
    return quantize(np.ascontiguousarray(data, dtype=np.float32), qtype), qtype


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
    _tokenizer(writer, folder)
    for hf_name, weight in sorted(load_file(os.path.join(folder, "model.safetensors")).items()):
        stem, _, suffix = hf_name.rpartition(".")
        name = f"{table.get_name(stem)}.{suffix}"
        data, stored = _gguf_tensor(name, weight, cfg, arch, qtype)
        writer.add_tensor(name, data, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_gguf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """transformers' float32 model loaded from the GGUF file (its own dequantization and un-permutation)."""
    from hf_reference import _hf_model

    return dict(_hf_model(path).state_dict())
