"""EAGLE heads for image-text targets: what a head reads from a Qwen2-VL / Qwen2.5-VL / Qwen3-VL, Llama 4,
LLaVA-style (LLaVA, LLaVA-NeXT, Mistral 3, Pixtral) or Gemma 3 target (docs/speculative.md).

A head is a Llama-style layer beside the target's decoder; for an image-text
target four things differ from a text one:

- **Where it reads.** The target's decoder stack (its embedding table, the
  layers whose inputs an EAGLE-3 head reads) is the language model's
  (`target_decoder`), not ``target.model``.
- **What it embeds at an image's rows.** The placeholder token's own embedding
  (``<|image_pad|>``, Llama 4's ``<|patch|>``, LLaVA's ``<image>``, Mistral's
  ``[IMG]``, Gemma 3's ``<image_soft_token>``), not the image's features:
  SpecForge trains Qwen2.5-VL heads on ``embed_input_ids(input_ids)`` of the
  token ids, and vLLM's Llama EAGLE / EAGLE-3 heads (the class these targets'
  published heads load as) ignore the multimodal rows it hands them. So the
  head embeds its input ids as for a text target.
- **Its positions.** A head whose config names ``mrope_section`` (SpecForge's
  ``rope_scaling: {"type": "mrope", ...}``; ``mrope_interleaved`` for
  Qwen3-VL) rotates by M-RoPE at the target's own positions: ``[3, T]`` in a
  step through an image's prompt, ``index + delta`` after it (drafts too), as
  it was trained and as vLLM runs it. A head with a plain 1-D rope gets the
  tokens' indices (the KV slots' positions): what it saw on text, with true
  token distances; Llama 4, the LLaVA family and Gemma 3 rotate at those
  too. Either way drafts are verified, so only acceptance depends on it.
- **Its attention is causal** over an image's rows too, as it was trained
  (Gemma 3's target sees each image both ways: the step's ``attend_limit``
  is the target's alone, `causal`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncllm.errors import NotBuiltError
from asyncllm.models.rotary import rope_parameters
from asyncllm.spec.config import SPEC_FIELD

__all__ = ["MROPE_EAGLE_ARCHITECTURES", "MULTIMODAL_EAGLE_ARCHITECTURES", "causal", "chain_offsets",
           "check_multimodal_target", "head_mrope", "language_model_class", "normalize_head_rope", "target_decoder"]

MROPE_EAGLE_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                             "Qwen3VLForConditionalGeneration")
"""Image-text targets that rotate by M-RoPE (their decoders keep an EAGLE-3 head's layers' inputs)."""
MULTIMODAL_EAGLE_ARCHITECTURES = (*MROPE_EAGLE_ARCHITECTURES, "Llama4ForConditionalGeneration",
                                  "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                  "Mistral3ForConditionalGeneration", "Gemma3ForConditionalGeneration")
"""Image-text targets an EAGLE / EAGLE-3 head drafts for (the others are a `NotBuiltError` naming them)."""


def check_multimodal_target(spec_dict: dict, method: str, target_config: Any, arch: str | None = None) -> None:
    """`NotBuiltError` unless ``method`` is an EAGLE head (before its checkpoint is read) and the target (``arch``,
    default ``target_config``'s) an image-text one it is built for."""
    from asyncllm.models.architectures import architecture_of

    if method not in ("eagle", "eagle3"):
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"a draft model for a multimodal target (method={method!r}; EAGLE "
                                                   f"heads draft for {', '.join(MULTIMODAL_EAGLE_ARCHITECTURES)})")
    arch = arch or architecture_of(target_config)
    if arch not in MULTIMODAL_EAGLE_ARCHITECTURES:
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"an {method} head for a multimodal {arch} target (built for "
                                                   f"{', '.join(MULTIMODAL_EAGLE_ARCHITECTURES)}; Qwen3-VL-MoE and other "
                                                   "image-text targets are not)")


def language_model_class(target_config: Any, arch: str) -> type | None:
    """The class of the causal LM whose decoder a head reads: an image-text target's language model's (its
    ``decoder_classes`` entry for the text config's ``model_type``), else the target's own."""
    from types import SimpleNamespace

    from asyncllm.models.registry import get_model_class

    if arch not in MULTIMODAL_EAGLE_ARCHITECTURES:
        return get_model_class(target_config)
    outer = get_model_class(SimpleNamespace(architectures=[arch]))
    return (getattr(outer, "decoder_classes", None) or {}).get(target_config.model_type)


def causal(metadata: Any) -> Any:
    """The step's attention metadata as a head reads it: causal (without the target's ``attend_limit``, Gemma 3's
    image rows seeing their whole image)."""
    return metadata if metadata.attend_limit is None else dataclasses.replace(metadata, attend_limit=None)


def target_decoder(target: Any) -> Any:
    """The decoder stack a head reads: ``target.model``, or an image-text target's language model's."""
    language_model = getattr(target, "language_model", None)
    return target.model if language_model is None else language_model.model


def normalize_head_rope(config: Any) -> Any:
    """A head config's ``rope_type: "mrope"`` (SpecForge's) read as the default rope with its ``mrope_section``."""
    params = rope_parameters(config)
    if params.get("rope_type") == "mrope":
        params.pop("type", None)
        config.rope_parameters = {**params, "rope_type": "default"}
    return config


def head_mrope(config: Any) -> tuple[bool, bool]:
    """(whether the head rotates by M-RoPE, whether its bands are interleaved as Qwen3-VL's)."""
    params = rope_parameters(config)
    return bool(params.get("mrope_section")), bool(params.get("mrope_interleaved", False))


def chain_offsets(mrope: Any, req_ids: list[str], device: torch.device) -> torch.Tensor | None:
    """Each request's M-RoPE ``delta`` (0 for one without images), added to its drafts' token indices; None when no
    request has one (``mrope``: the model runner's `MRopePositions`, or None)."""
    if mrope is None or not any(req_id in mrope.requests for req_id in req_ids):
        return None
    deltas = [mrope.requests[req_id][1] if req_id in mrope.requests else 0 for req_id in req_ids]
    return torch.tensor(deltas, dtype=torch.int64, device=device)
