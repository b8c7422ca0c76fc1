"""GGUF checkpoints (llama.cpp's single-file format) on the host, without torch.

A model given as a local ``.gguf`` file (vLLM's ``vllm serve ./model.Q4_K_M.gguf``) is a GGUF checkpoint:
`load_gguf_config` reads its transformers config from the file's metadata (transformers' own GGUF reader) after
refusing a part of a split file, an architecture asyncllm does not load from GGUF and a tensor type gguf does not
dequantize, and `gguf_checkpoint_config` checks ``quantization`` against it. Rope scaling, which that reader drops,
is added from the file as llama.cpp reads it (`_rope_scaling`): a linear ``rope.scaling.factor`` as rope_type
"linear" (none for type "none"), Llama 3.1's ``rope_freqs.weight`` divisors as the config's
``rope_freq_factors`` (asyncllm/models/rotary.py); any other scaling is a `NotBuiltError` (LongRoPE's
``rope_factors_long`` / ``_short`` tensors too). The other keys that reader drops and llama.cpp reads are added the
same way: Gemma 2's logit softcapping, a 27B Gemma's query scale, Phi-3's partial rotary and sliding window. Gemma 3
is transformers' ``gemma3_text`` (the text model). The weights are read
and dequantized on each rank by asyncllm/models/gguf_loader.py; the format and what is built are in
docs/quantization.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["GGUF_QUANTIZATION", "GGUF_ARCHITECTURES", "ROPE_FREQS_TENSOR", "GgufCheckpointConfig", "is_gguf_file",
           "gguf_architecture", "undequantizable", "load_gguf_config", "gguf_checkpoint_config"]

GGUF_QUANTIZATION = "gguf"
"""The `quantization` value naming a GGUF checkpoint (vLLM's ``--quantization gguf``); None serves it too."""
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3")
"""The GGUF ``general.architecture`` values asyncllm loads (a ``llama`` file whose ``general.name`` is "mistral" is
read by transformers as model_type mistral: MistralForCausalLM; other Mistral files as Llama, the same function
without a sliding window)."""
_MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                             "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                             "phi3": "Phi3ForCausalLM"}
"""transformers' model_type of a GGUF config -> its architecture (the config read from a GGUF names none)."""
_EXPERT_KEYS = {"expert_feed_forward_length": "moe_intermediate_size",
                "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
"""GGUF keys of a mixture of experts that transformers' GGUF config reader drops -> their config fields."""
_NORMALIZED_TOP_K = {"qwen2moe": False, "qwen3moe": True}
"""Whether llama.cpp renormalizes the chosen experts' weights (``expert_weights_norm`` unless the file says)."""
_SOFTCAPPING_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")
"""Gemma 2's GGUF keys (llama.cpp reads them) that transformers' GGUF config reader drops (keeping its defaults)."""
_LLAMA_CPP_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The layer count by which llama.cpp tells a 27B Gemma, whose queries it scales by ``1 / sqrt(hidden / heads)``
(144, 168); every other Gemma 2 / 3 by ``1 / sqrt(head_dim)`` = ``1 / sqrt(256)``, transformers' default."""
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""How llama.cpp's converter stores LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini); asyncllm does not read them."""


@dataclass(frozen=True)
class GgufCheckpointConfig:
    """A GGUF checkpoint: its weights are dequantized to the model dtype at load (asyncllm/models/gguf_loader.py)."""

    path: str
    """The ``.gguf`` file."""


def is_gguf_file(model: str) -> bool:
    """Whether ``model`` names a GGUF file (by its extension, as vLLM does; it need not exist)."""
    return isinstance(model, str) and model.lower().endswith(".gguf") and not os.path.isdir(model)


def _reader(path: str) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (OSError, ValueError, IndexError) as exc:  # IndexError: a truncated or header-only file
        raise ConfigError("model", path, f"a GGUF file gguf can read ({type(exc).__name__}: {exc})") from exc


def _string(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None or not field.data else bytes(field.parts[field.data[0]]).decode("utf-8")


def gguf_architecture(path: str, reader: Any = None) -> str:
    """The file's ``general.architecture``; `ConfigError` when it is not a GGUF file gguf can read."""
    arch = _string(reader if reader is not None else _reader(path), "general.architecture")
    if arch is None:
        raise ConfigError("model", path, "a GGUF file with a general.architecture")
    return arch


def _check_not_split(reader: Any, path: str) -> None:
    """`ConfigError` for one file of a split GGUF (``split.count`` above 1): vLLM, too, loads single files only."""
    count = _scalar(reader, "split.count")
    if count is not None and count > 1:
        number = _scalar(reader, "split.no")
        part = f"part {int(number) + 1} of {int(count)}" if number is not None else f"one of {int(count)} parts"
        raise ConfigError("model", path, f"a single-file GGUF (this is {part} of a split GGUF: merge the parts "
                                         "into one file with llama.cpp's `llama-gguf-split --merge FIRST-PART OUT`)")


def undequantizable(path: str, tensor_name: str, type_name: str, detail: str) -> NotBuiltError:
    """The `NotBuiltError` for a GGUF tensor whose type gguf cannot dequantize (Q8_1, Q8_K, I8, ...)."""
    return NotBuiltError("model", path, f"dequantizing GGUF {type_name} tensors ({tensor_name}: gguf {detail})")


def _check_tensor_types(reader: Any, path: str) -> None:
    """`undequantizable` for the first tensor of a type gguf cannot dequantize, each type tried on one zero block
    (the header's tensor infos only: no weight is read)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    tried: dict[Any, str] = {}
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if qtype not in tried:
            try:
                dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
                tried[qtype] = ""
            except NotImplementedError as exc:
                tried[qtype] = str(exc)
        if tried[qtype]:
            raise undequantizable(path, tensor.name, qtype.name, tried[qtype])


ROPE_FREQS_TENSOR = "rope_freqs.weight"
"""llama.cpp's per-frequency rotary divisors (its converter writes Llama 3.1 / 3.2's llama3 rope scaling so); the
config carries them as ``rope_freq_factors`` (asyncllm/models/rotary.py divides the inverse frequencies by them)."""
_LINEAR_SCALING_TYPES = ("none", "linear")
"""``rope.scaling.type`` values asyncllm reads: "linear" (an absent type reads so in llama.cpp) scales by the
factor; "none" never scales, whatever the factor (llama.cpp's context sets its frequency scale to 1)."""
_INFORMATIONAL_ROPE_KEYS = ("type", "factor", "original_context_length", "finetuned")
"""``rope.scaling.*`` keys of a linear scaling; llama.cpp reads original_context_length for YaRN only."""


def _scalar(reader: Any, key: str) -> float | None:
    field = reader.fields.get(key)
    return None if field is None or not field.data else float(field.parts[field.data[0]][0])


def _linear_rope_factor(reader: Any, arch: str, path: str) -> float:
    """The linear rope scaling factor llama.cpp applies to the file (1.0: none, always for type "none");
    `NotBuiltError` for another scaling type (YaRN, LongRoPE, ...) or a ``rope.scaling`` key asyncllm does not read."""
    scaling = _string(reader, f"{arch}.rope.scaling.type") or "linear"
    if scaling not in _LINEAR_SCALING_TYPES:
        raise NotBuiltError("model", path, f"GGUF rope scaling {arch}.rope.scaling.type {scaling!r} (GGUF reads "
                                           "'none' and 'linear', and llama3's rope_freqs.weight)")
    if scaling == "none":
        return 1.0
    prefix = f"{arch}.rope.scaling."
    unread = sorted(key for key in reader.fields if key.startswith(prefix)
                    and key[len(prefix):] not in _INFORMATIONAL_ROPE_KEYS)
    if unread:
        raise NotBuiltError("model", path, f"GGUF rope scaling keys {', '.join(unread)}")
    factor = _scalar(reader, f"{prefix}factor")
    if factor is None:
        factor = _scalar(reader, f"{arch}.rope.scale_linear")
    if factor is not None and (not math.isfinite(factor) or factor < 0):
        raise ConfigError("model", path, f"a GGUF file with a finite positive {prefix}factor (not {factor})")
    return 1.0 if not factor else factor  # llama.cpp: 0 or absent is no scaling


def _rope_freqs(reader: Any, arch: str, path: str) -> list[float] | None:
    """The ``rope_freqs.weight`` divisors, None without one; `NotBuiltError` outside the llama architecture."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if tensor is None:
        return None
    if arch != "llama":
        raise NotBuiltError("model", path, f"GGUF {ROPE_FREQS_TENSOR} in a {arch!r} file (read for 'llama' only)")
    from gguf.quants import dequantize

    factors = [float(x) for x in dequantize(tensor.data, tensor.tensor_type).reshape(-1)]
    if not all(math.isfinite(x) and x > 0 for x in factors):
        raise ConfigError("model", path, f"a GGUF file whose {ROPE_FREQS_TENSOR} is finite and positive")
    return factors


def _rope_scaling(reader: Any, arch: str, path: str) -> tuple[float, list[float] | None]:
    """(linear factor, rope_freqs divisors or None) of the file; `NotBuiltError` for what asyncllm does not read."""
    factor, freqs = _linear_rope_factor(reader, arch, path), _rope_freqs(reader, arch, path)
    if freqs is not None and factor != 1.0:
        raise NotBuiltError("model", path, f"GGUF {ROPE_FREQS_TENSOR} together with a linear rope scaling factor")
    return factor, freqs


def _apply_rope_scaling(hf_config: Any, factor: float, freqs: list[float] | None, path: str) -> None:
    """Put the file's rope scaling, which transformers' GGUF config reader drops, into ``hf_config``: a linear
    factor as transformers' ``rope_type`` "linear" (Gemma 3: on its global layers' rope only, as llama.cpp scales
    them and not the sliding ones), llama3's rope_freqs as ``rope_freq_factors``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "full_attention" in params:  # rope parameters per layer type (Gemma 3)
        params["full_attention"] = _linear_rope(dict(params["full_attention"]), factor, hf_config, path)
        hf_config.rope_parameters = params
    else:
        hf_config.rope_parameters = _linear_rope(params, factor, hf_config, path)
    if freqs is not None:
        hf_config.rope_freq_factors = freqs


def _linear_rope(params: dict, factor: float, hf_config: Any, path: str) -> dict:
    """``params`` (transformers' unscaled rope parameters) with a linear ``factor`` (1.0: as they are)."""
    if params.get("rope_type", "default") != "default":  # transformers read a scaling itself: not expected
        raise NotBuiltError("model", path, f"a GGUF config transformers reads with rope_type {params['rope_type']!r}")
    if factor == 1.0:
        return params
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return {**params, "rope_type": "linear", "factor": factor}


def load_gguf_config(path: str) -> Any:
    """The transformers config of a GGUF file (its metadata), with ``architectures`` set to what asyncllm builds;
    `NotBuiltError` naming the GGUF architecture when asyncllm does not load it."""
    from transformers import AutoConfig

    reader = _reader(path)
    _check_not_split(reader, path)
    arch = gguf_architecture(path, reader)
    if arch not in GGUF_ARCHITECTURES:
        raise NotBuiltError("model", path, f"GGUF checkpoints of the {arch!r} architecture (GGUF loads "
                                           f"{', '.join(map(repr, GGUF_ARCHITECTURES))})")
    longrope = [t.name for t in reader.tensors if t.name in _LONGROPE_TENSORS]
    if longrope:
        raise NotBuiltError("model", path, f"GGUF LongRoPE scaling ({', '.join(longrope)}: Phi-3-128k, Phi-3.5, "
                                           "Phi-4-mini; transformers' GGUF reader drops it too)")
    _check_tensor_types(reader, path)
    factor, freqs = _rope_scaling(reader, arch, path)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("model", path, f"a GGUF file whose metadata transformers can read ({exc})") from exc
    if hf_config.model_type not in _MODEL_TYPE_ARCHITECTURES:
        raise NotBuiltError("model", path, f"a GGUF {arch!r} file transformers reads as model_type "
                                           f"{hf_config.model_type!r}")
    hf_config.architectures = [_MODEL_TYPE_ARCHITECTURES[hf_config.model_type]]
    _apply_rope_scaling(hf_config, factor, freqs, path)
    if arch in _NORMALIZED_TOP_K:
        _apply_experts(reader, arch, hf_config)
    if arch in _LLAMA_CPP_27B_LAYERS:
        _apply_gemma(reader, arch, hf_config)
    if arch == "phi3":
        _apply_phi3(reader, arch, hf_config)
    return hf_config


def _apply_gemma(reader: Any, arch: str, hf_config: Any) -> None:
    """Gemma 2's logit softcapping and a 27B Gemma's query scale, which transformers' GGUF config reader leaves at
    its defaults, as llama.cpp reads them."""
    for key in _SOFTCAPPING_KEYS:
        value = _scalar(reader, f"{arch}.{key}")
        if value is not None:
            setattr(hf_config, key, value)
    if hf_config.num_hidden_layers == _LLAMA_CPP_27B_LAYERS[arch]:
        hf_config.query_pre_attn_scalar = hf_config.hidden_size // hf_config.num_attention_heads


def _apply_phi3(reader: Any, arch: str, hf_config: Any) -> None:
    """Phi-3's partial rotary (``rope.dimension_count`` below the head dim) and sliding window (some Phi-3-mini-4k),
    which transformers' GGUF config reader drops, as llama.cpp reads them."""
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    rotary = _scalar(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        hf_config.rope_parameters = {**hf_config.rope_parameters, "partial_rotary_factor": int(rotary) / head_dim}
    window = _scalar(reader, f"{arch}.attention.sliding_window")
    if window:  # llama.cpp: 0 or absent is none
        hf_config.sliding_window = int(window)


def _apply_experts(reader: Any, arch: str, hf_config: Any) -> None:
    """The expert sizes and the top-k renormalization, which transformers' GGUF config reader drops (its defaults
    are Qwen's largest models' sizes), as llama.cpp reads them."""
    for key, field in _EXPERT_KEYS.items():
        value = _scalar(reader, f"{arch}.{key}")
        if value is not None:
            setattr(hf_config, field, int(value))
    norm = reader.fields.get(f"{arch}.expert_weights_norm")
    hf_config.norm_topk_prob = bool(norm.parts[norm.data[0]][0]) if norm is not None else _NORMALIZED_TOP_K[arch]


def gguf_checkpoint_config(model: str, quantization: str | None) -> GgufCheckpointConfig | None:
    """A GGUF model's `GgufCheckpointConfig` (``quantization`` None or "gguf"), None for another model;
    `ConfigError` for "gguf" with a model that is not a GGUF file, or another method with one."""
    if not is_gguf_file(model):
        if quantization == GGUF_QUANTIZATION:
            raise ConfigError("quantization", quantization, "a value other than 'gguf' for a model that is not a "
                              f"GGUF file ({model!r}: 'gguf' serves a local .gguf file given as the model)")
        return None
    if quantization not in (None, GGUF_QUANTIZATION):
        raise ConfigError("quantization", quantization, f"None or 'gguf' for a GGUF model ({model!r}: its weights "
                          "are GGUF's own quantization, dequantized at load)")
    return GgufCheckpointConfig(model)
