"""Calibrated fp8 KV-cache scales: the ``k_scale`` / ``v_scale`` (or one ``kv_scale``) tensors of fp8 checkpoints
(llm-compressor's ``self_attn.k_scale``, ModelOpt's ``self_attn.k_proj.k_scale``, a fused projection's
``self_attn.qkv_proj.k_scale``, older llm-compressor's and AutoFP8's ``self_attn.k_proj.output_scale``;
docs/fp8-kv-cache.md), and the query's ``q_scale``.

With an fp8 ``kv_cache_dtype`` each layer's scales go to its `Attention` (``k_scale``, ``v_scale``): the cache then
holds ``k / k_scale`` and ``v / v_scale`` in fp8, as vLLM's does. A layer given one of the two uses it for both (vLLM's
``BaseKVCacheMethod.process_weights_after_loading``). A layer that reads another layer's cache (Gemma 4 / 3n's KV
sharing: a model module's ``kv_sharing_pairs``) reads it with the scales of the layer that wrote it; scales of its own
that differ from those are a `ConfigError`. The query stays in the model dtype, so a ``q_scale`` (fp8 attention's
query scale) changes nothing and is dropped, as vLLM's backends that keep the query unquantized drop it (and so is
fp8 attention's ``prob_scale`` / ``prob_output_scale``). With a cache of the model dtype the scales describe nothing
asyncllm stores, and are dropped (vLLM ignores them there too). `take_kv_scales` does both while the weights stream
to the model's loader (the layers' scales set once the stream ends). The scales are Python floats, which a captured
CUDA graph holds as constants: a weight update that changes them has the graphs captured again
(workers/cuda_graphs.py `recapture_if_changed`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.layers import Attention, LoadedWeight, weight_shape

__all__ = ["KV_CACHE_SCALE_SUFFIXES", "take_kv_scales"]

KV_CACHE_SCALE_SUFFIXES = ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale",
                           "k_proj.output_scale", "v_proj.output_scale", "q_proj.output_scale", "prob_output_scale")
"""Endings of the calibrated KV-cache (and query, and fp8 attention's probabilities') scale tensors of fp8
checkpoints."""

_DROPPED = ("q_scale", "prob_scale", "prob_output_scale")
"""fp8 attention's scales of the query and of the probabilities (vLLM's ``attn.prob_scale``, a checkpoint's
``self_attn.prob_output_scale``): asyncllm keeps both in the model dtype, so they describe nothing it stores."""

_OUTPUT_SCALES = {"k_proj.output_scale": "k_scale", "v_proj.output_scale": "v_scale", "q_proj.output_scale": "q_scale"}
"""A projection's output scale is the scale of what it computes (vLLM's ``get_cache_scale`` of its fp8 and
compressed-tensors configs)."""

_ATTENTION_CHILDREN = (".q_proj", ".k_proj", ".v_proj", ".qkv_proj", ".attn")
"""Where a checkpoint puts the scales under the attention module (ModelOpt, fused projections, vLLM's own name)."""


def take_kv_scales(weights: Iterable[tuple[str, LoadedWeight]], model: Any,
                   kv_cache_dtype: str) -> Iterator[tuple[str, LoadedWeight]]:
    """``weights`` less the KV-cache scales: set on the layers' attention with an fp8 cache (once the weights are
    read), else dropped. The scales are the checkpoint's: 1.0 where it has none (a weight update from a calibrated
    checkpoint to one without, as a fresh load of it would give)."""
    fp8 = kv_cache_dtype.startswith("fp8")
    given: dict[Attention, tuple[str, dict[str, float]]] = {}
    """Each layer's attention -> its scales' stem in the checkpoint and the scales given there (``k``, ``v``)."""
    for name, weight in weights:
        if not name.endswith(KV_CACHE_SCALE_SUFFIXES):
            yield name, weight
        elif fp8:
            _take_scale(model, _scale_name(name), weight, kv_cache_dtype, given)
    for attention in (m for m in model.modules() if isinstance(m, Attention)):
        attention.k_scale = attention.v_scale = 1.0
    for attention, (_, scales) in given.items():
        both = max(scales.values())  # one of the two given: it serves both (vLLM's max(k_scale, v_scale), one unset)
        attention.k_scale, attention.v_scale = scales.get("k", both), scales.get("v", both)
    for reader, writer in _kv_sharing_pairs(model):
        _share_scales(model, reader, writer, given)


def _kv_sharing_pairs(model: Any) -> Iterator[tuple[Attention, Attention]]:
    """(the attention of a layer that reads another layer's KV cache, the attention of the layer that writes it)."""
    for module in model.modules():
        if hasattr(type(module), "kv_sharing_pairs"):
            yield from module.kv_sharing_pairs()


def _share_scales(model: Any, reader: Attention, writer: Attention,
                  given: dict[Attention, tuple[str, dict[str, float]]]) -> None:
    """The reader takes the writer's scales (the cache holds the writer's ``k / k_scale``); `ConfigError` where the
    checkpoint gives the reader a scale of its own (as given: ``k``, ``v`` or both) that differs from the writer's."""
    stem, own = given.get(reader, ("", {}))
    for part, mine in own.items():
        theirs = writer.k_scale if part == "k" else writer.v_scale
        if mine != theirs:
            source = given[writer][0] if writer in given else next(n for n, m in model.named_modules() if m is writer)
            raise ConfigError("model", stem, f"{part}_scale {mine} differs from the {part}_scale {theirs} "
                                             f"of {source}, whose KV cache it reads: a KV-sharing layer reads with "
                                             "that layer's scales (give it none, or the same)")
    reader.k_scale, reader.v_scale = writer.k_scale, writer.v_scale


def _scale_name(name: str) -> str:
    """``name`` with a projection's ``output_scale`` renamed to the scale it is (``...k_proj.k_scale``)."""
    for suffix, leaf in _OUTPUT_SCALES.items():
        if name.endswith(suffix):
            return name.removesuffix("output_scale") + leaf
    return name


def _take_scale(model: Any, name: str, weight: LoadedWeight, kv_cache_dtype: str,
                given: dict[Attention, tuple[str, dict[str, float]]]) -> None:
    """Record the scale ``name`` for its layer's attention in ``given`` (a query or probabilities' scale is dropped
    unread: `_DROPPED`)."""
    stem, _, leaf = name.rpartition(".")
    if leaf in _DROPPED:
        return
    if getattr(model, "kv_cache_parts", 2) == 1:
        raise NotBuiltError("kv_cache_dtype", kv_cache_dtype, f"calibrated KV-cache scales ({name}) over a one-part "
                                                              f"cache whose keys are its values ({type(model).__name__})")
    if weight_shape(weight) not in ((), (1,)):
        raise NotBuiltError("kv_cache_dtype", kv_cache_dtype, f"KV-cache scales per head or channel ({name} has shape "
                                                              f"{list(weight_shape(weight))}; one per layer is built)")
    for child in _ATTENTION_CHILDREN:
        stem = stem.removesuffix(child)
    attention = _attention_at(model, stem)
    if attention is None:
        return  # a layer another pipeline stage holds
    value = float(torch.as_tensor(weight if isinstance(weight, torch.Tensor) else weight[...]).float().reshape(()))
    if not 0 < value < float("inf"):  # inf: the cache holds zeros and every score is 0 * inf = NaN
        raise ConfigError("model", name, f"a positive finite KV-cache scale (it is {value})")
    scales = given.setdefault(attention, (stem, {}))[1]
    for part in ("k", "v") if leaf == "kv_scale" else (leaf[0],):
        scales[part] = value


def _attention_at(model: Any, stem: str) -> Attention | None:
    """The `Attention` under the checkpoint's attention module ``stem`` (``model.layers.3.self_attn``; a multimodal
    model's ``model.language_model.layers.3.self_attn`` or ``language_model.model.layers.3.self_attn`` is its decoder's
    ``language_model.model.layers.3.self_attn``, or ``model.layers.3.self_attn`` where the decoder is served alone:
    ``limit_mm_per_prompt`` of 0); None for a layer another pipeline stage holds."""
    from asyncllm.models.pipeline import PPMissingLayer
    from asyncllm.models.vision_language import decoder_weight_name

    paths = [stem, "language_model." + stem]
    if stem.startswith("model.language_model."):  # transformers' newer multimodal layout (Qwen3-VL, Gemma 3, ...)
        paths.append("language_model.model." + stem.removeprefix("model.language_model."))
    if stem.startswith(("model.language_model.", "language_model.model.")):  # the decoder alone (Gemma4TextOnly, ...)
        paths.append(str(decoder_weight_name(stem, ())))
    for path in paths:
        module = model
        for part in path.split("."):
            if isinstance(module, PPMissingLayer):
                return None
            module = getattr(module, part, None)
            if module is None:
                break
        else:
            if isinstance(module, PPMissingLayer):
                return None
            found = [m for m in module.modules() if isinstance(m, Attention)]
            if len(found) == 1:
                return found[0]
    raise ConfigError("model", stem, "a KV-cache scale of an attention layer the model has")
