"""A GGUF checkpoint's weights, dequantized to the model dtype at load, on each rank.

Each tensor of the file is dequantized alone with ``gguf.quants.dequantize`` (numpy, float32), renamed from GGUF's
names (``blk.0.attn_q.weight``) to the checkpoint names the model loads (``model.layers.0.self_attn.
q_proj.weight``, through gguf's own name table), and handed to the model's ``load_weights``: fused q/k/v and gate/up
shards and tensor-parallel slices are then taken as from safetensors (Phi-3's fused ``attn_qkv`` and ``ffn_up`` as
its checkpoint's ``qkv_proj`` and ``gate_up_proj``). A llama-family file's q and k rows are un-permuted first
(llama.cpp's converter interleaves each head's rotary halves; transformers undoes it the same way), and a Gemma
file's norm weights have the 1 llama.cpp added subtracted again. ``rope_freqs.weight`` (llama3's rope scaling) is no
parameter: the config carries it (gguf_config.py) and it is only checked here. A pipeline stage's model
(asyncllm/models/pipeline.py) skips the tensors of the parts other stages hold before dequantizing them
(`other_stages_names`). There is no quantized GEMM: the model holds the weights in its dtype (docs/quantization.md).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import numpy as np
import torch

from asyncllm.errors import ConfigError
from asyncllm.models.gguf_config import ROPE_FREQS_TENSOR, gguf_architecture, undequantizable
from asyncllm.models.registry import CausalLM, text_config_of

__all__ = ["NORM_OFFSET_ARCHITECTURES", "PERMUTED_QK_ARCHITECTURES", "gguf_weight_names", "iterate_gguf",
           "load_gguf_weights", "other_stages_names", "unpermute_qk"]

PERMUTED_QK_ARCHITECTURES = ("llama",)
"""GGUF architectures whose ``attn_q`` / ``attn_k`` rows llama.cpp's converter permuted (Qwen's are not)."""
NORM_OFFSET_ARCHITECTURES = ("gemma2", "gemma3")
"""GGUF architectures whose norm weights llama.cpp's converter stores plus one (Gemma's RMSNorm scales by
``1 + w``, llama.cpp's by ``w``): 1 is subtracted again, as transformers' ``Gemma2TensorProcessor`` does."""


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
"""A per-expert checkpoint name: GGUF stacks every expert's matrix in one tensor (``blk.N.ffn_gate_exps``)."""


def gguf_weight_names(model: CausalLM, arch: str, num_layers: int) -> dict[str, str | list[str]]:
    """GGUF tensor name -> the checkpoint name ``model`` loads (a list, by expert, for a stacked experts tensor),
    for every weight the model needs (and, on a pipeline stage, every weight of the other stages:
    `other_stages_names`)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    gguf_arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)
    table = get_tensor_name_map(gguf_arch, num_layers)
    names: dict[str, str | list[str]] = {}
    experts: dict[str, dict[int, str]] = {}
    for ckpt_name in model.checkpoint_weight_names() | other_stages_names(model, num_layers):
        expert = _EXPERT.match(ckpt_name)
        if expert is not None:  # stacked in the file, under the experts' own stem
            gguf_stem = table.get_name(f"{expert[1]}.{expert[3]}")
            if gguf_stem is not None:
                experts.setdefault(f"{gguf_stem}.weight", {})[int(expert[2])] = ckpt_name
            continue
        stem, _, suffix = ckpt_name.rpartition(".")
        gguf_stem = table.get_name(stem)
        if gguf_stem is not None:
            names[f"{gguf_stem}.{suffix}"] = ckpt_name
    for gguf_name, by_expert in experts.items():
        names[gguf_name] = [by_expert[e] for e in sorted(by_expert)]
    return names


def other_stages_names(model: CausalLM, num_layers: int) -> set[str]:
    """On a pipeline stage, the checkpoint names of the parts other stages hold (`PPMissingLayer` placeholders):
    every layer's names as this stage's layers have them, the embeddings, final norm and LM head; empty without
    stages. Their GGUF tensors are skipped undequantized."""
    if getattr(model, "pipeline", None) is None:
        return set()
    layer_names = {re.sub(r"^model\.layers\.\d+\.", "", name) for name in model.checkpoint_weight_names()
                   if name.startswith("model.layers.")}
    candidates = {f"model.layers.{i}.{rest}" for i in range(num_layers) for rest in layer_names}
    candidates |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    return {name for name in candidates if not model.holds_weight(name)}  # type: ignore[attr-defined]


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a q or k projection (rows ``[heads * head_dim, ...]``): its converter
    reorders each head's rows from the two rotary halves to interleaved pairs; this puts them back (transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantized(tensor: Any, path: str) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:  # the host's load_gguf_config refuses these first
        raise undequantizable(path, tensor.name, tensor.tensor_type.name, str(exc)) from exc


def _check_rope_freqs(tensor: Any, text_config: Any, path: str) -> None:
    """`ConfigError` unless the config's ``rope_freq_factors`` are the file's ``rope_freqs.weight``."""
    factors = getattr(text_config, "rope_freq_factors", None)
    if factors is None or not np.array_equal(np.asarray(factors, dtype=np.float32),
                                             _dequantized(tensor, path).reshape(-1)):
        raise ConfigError("model", path, f"a config whose rope_freq_factors are the file's {ROPE_FREQS_TENSOR} (read "
                                         "the config with asyncllm.models.gguf_config.load_gguf_config)")


def iterate_gguf(path: str, names: dict[str, str | list[str]], hf_config: Any,
                 skipped: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, float32 tensor) for every tensor of the file, dequantized one at a time (a stacked
    experts tensor: each expert's); those named in ``skipped`` (another pipeline stage's) are left unread."""
    from gguf import GGUFReader

    arch = gguf_architecture(path)
    text_config = text_config_of(hf_config)
    heads = {"attn_q": text_config.num_attention_heads, "attn_k": text_config.num_key_value_heads}
    unknown = []
    for tensor in GGUFReader(path).tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            _check_rope_freqs(tensor, text_config, path)
            continue
        if tensor.name not in names:
            unknown.append(tensor.name)
            continue
        target = names[tensor.name]
        if all(name in skipped for name in ([target] if isinstance(target, str) else target)):
            continue
        weight = _dequantized(tensor, path)
        kind = tensor.name.split(".")[-2]
        if arch in PERMUTED_QK_ARCHITECTURES and kind in heads:
            weight = unpermute_qk(weight, heads[kind])
        if arch in NORM_OFFSET_ARCHITECTURES and "norm.weight" in tensor.name:
            weight = weight - 1
        if isinstance(target, str):
            yield target, _tensor(weight)
            continue
        if weight.shape[0] != len(target):
            raise ConfigError("model", path, f"a GGUF {tensor.name} of {len(target)} experts (it has {weight.shape[0]})")
        for name, one in zip(target, weight):
            yield name, _tensor(one)
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise ConfigError("model", path, f"a GGUF file of the {arch} architecture; tensors asyncllm's model has no "
                                         f"parameter for: {shown}")


def _tensor(weight: np.ndarray) -> torch.Tensor:
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    return torch.from_numpy(weight if weight.flags.writeable else weight.copy())


def load_gguf_weights(model: CausalLM, path: str, hf_config: Any) -> None:
    """Fill every parameter of ``model`` from the GGUF file; `ConfigError` naming missing or unknown tensors."""
    text_config = text_config_of(hf_config)
    names = gguf_weight_names(model, gguf_architecture(path), text_config.num_hidden_layers)
    skipped = frozenset(other_stages_names(model, text_config.num_hidden_layers))
    with torch.no_grad():
        loaded = model.load_weights(iterate_gguf(path, names, hf_config, skipped))
    missing = sorted(model.checkpoint_weight_names() - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConfigError("model", path, f"a GGUF file with every weight of its architecture; missing: {shown}")
