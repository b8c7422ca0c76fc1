"""The image half of Mistral's own checkpoint format (asyncllm/models/mistral_format.py reads the rest): params.json's
``vision_encoder`` section, the Pixtral tower's and adapter's weight names, and the image processor a folder without
a ``preprocessor_config.json`` gets.

A section with ``spatial_merge_size`` above 1 (``mm_projector_id: "patch_merge"``: Mistral Small 3.1 / 3.2,
Magistral Small, Devstral Small) becomes transformers' `Mistral3Config`; one without (Pixtral-12B-2409) a
`LlavaConfig` with a Pixtral tower, as transformers' conversion scripts make them. The tower's feed-forward is
SiLU-gated (Mistral's ``w1``/``w3``), its query and key rows are permuted to transformers' rotary halves as the
decoder's are.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["VISION", "vision_config", "vision_name", "image_processor"]

VISION = "vision_encoder"
"""params.json's section for the image tower."""

_TOWER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
               "image_size", "patch_size", "rope_theta")
"""Keys of the section that are `PixtralVisionConfig`'s, under the same names."""

_OWN_KEYS = ("max_image_size", "adapter_bias", "mm_projector_id", "spatial_merge_size",
             "add_pre_mm_projector_layer_norm", "image_token_id", "image_break_token_id", "image_end_token_id")
"""Keys of the section read here (the processor's size, the projector, the image tokens)."""

_MARKERS = {"image_break_token_id": 12, "image_end_token_id": 13}
"""The ``[IMG_BREAK]`` / ``[IMG_END]`` ids of every Mistral vocabulary (the model looks them up by name)."""

_NAMES = [(re.compile(p), r) for p, r in (
    (r"vision_encoder\.transformer\.layers\.(\d+)\.attention\.w([qkvo])\.weight",
     r"vision_tower.transformer.layers.\1.attention.\2_proj.weight"),
    (r"vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w1\.weight",
     r"vision_tower.transformer.layers.\1.feed_forward.gate_proj.weight"),
    (r"vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w2\.weight",
     r"vision_tower.transformer.layers.\1.feed_forward.down_proj.weight"),
    (r"vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w3\.weight",
     r"vision_tower.transformer.layers.\1.feed_forward.up_proj.weight"),
    (r"vision_encoder\.(.*)", r"vision_tower.\1"),  # ln_pre, patch_conv, the layers' attention_norm / ffn_norm
    (r"vision_language_adapter\.w_in\.(weight|bias)", r"multi_modal_projector.linear_1.\1"),
    (r"vision_language_adapter\.w_out\.(weight|bias)", r"multi_modal_projector.linear_2.\1"),
    (r"patch_merger\.merging_layer\.weight", "multi_modal_projector.patch_merger.merging_layer.weight"),
    (r"pre_mm_projector_norm\.weight", "multi_modal_projector.norm.weight"),
)]
"""Mistral's names of the tower and adapter -> transformers'."""


def vision_config(section: Any, text_config: Any) -> Any:
    """params.json's ``vision_encoder`` section over ``text_config`` (a `MistralConfig`) as transformers'
    `Mistral3Config` (patches merged) or `LlavaConfig` (Pixtral-12B); a key or value not built a `NotBuiltError`."""
    from transformers import LlavaConfig, Mistral3Config, PixtralVisionConfig

    if not isinstance(section, dict):
        raise NotBuiltError("config_format", "mistral", f"params.json's {VISION} as an object, got {section!r}")
    unknown = sorted(k for k in section if k not in (*_TOWER_KEYS, *_OWN_KEYS) and section[k] is not None)
    if unknown:
        raise NotBuiltError("config_format", "mistral", f"params.json's {VISION} with {', '.join(unknown)} (built: "
                                                        f"{sorted((*_TOWER_KEYS, *_OWN_KEYS))})")
    for key, built in _MARKERS.items():
        if section.get(key, built) != built:
            raise NotBuiltError("config_format", "mistral", f"params.json's {VISION}.{key}={section[key]!r} "
                                                            f"(built: {built}, Mistral's vocabularies')")
    merge = int(section.get("spatial_merge_size") or 1)
    _check_projector(section, merge)
    try:
        tower = PixtralVisionConfig(**{k: section[k] for k in _TOWER_KEYS if k in section}, hidden_act="silu")
    except (TypeError, ValueError) as exc:
        raise ConfigError("config_format", "mistral",
                          f"a {VISION} transformers' PixtralVisionConfig takes ({exc})") from exc
    image_token = int(section.get("image_token_id", 10))
    common = dict(vision_config=tower, text_config=text_config, vision_feature_layer=-1,
                  multimodal_projector_bias=bool(section.get("adapter_bias", True)))
    if merge > 1:
        return Mistral3Config(**common, image_token_id=image_token, spatial_merge_size=merge,
                              architectures=["Mistral3ForConditionalGeneration"])
    return LlavaConfig(**common, image_token_id=image_token, vision_feature_select_strategy="full",
                       image_seq_length=1, architectures=["LlavaForConditionalGeneration"])


def _check_projector(section: dict[str, Any], merge: int) -> None:
    """The projector a merge size implies: Mistral 3's (a norm, then the patch merger) or LLaVA's (neither)."""
    projector = section.get("mm_projector_id")
    if projector not in (None, "", "patch_merge"):
        raise NotBuiltError("config_format", "mistral", f"params.json's {VISION}.mm_projector_id={projector!r} "
                                                        "(built: 'patch_merge')")
    if (projector == "patch_merge") != (merge > 1):
        raise NotBuiltError("config_format", "mistral", f"params.json's {VISION} with mm_projector_id={projector!r} "
                                                        f"and spatial_merge_size={merge} (built: 'patch_merge' with "
                                                        "a merge above 1, or neither)")
    if bool(section.get("add_pre_mm_projector_layer_norm", merge > 1)) != (merge > 1):
        raise NotBuiltError("config_format", "mistral", f"params.json's {VISION}.add_pre_mm_projector_layer_norm="
                                                        f"{section['add_pre_mm_projector_layer_norm']!r} with "
                                                        f"spatial_merge_size={merge} (built: a norm exactly where "
                                                        "patches merge)")


def vision_name(name: str) -> str | None:
    """``name``'s transformers name when it is the tower's or the adapter's, else None."""
    for pattern, replacement in _NAMES:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    return None


def image_processor(params: dict[str, Any], **overrides: Any) -> Any:
    """transformers' Pixtral image processor for a checkpoint whose only image settings are params.json's: the
    longest edge ``max_image_size`` (else ``image_size``), patches of ``patch_size``, CLIP's mean and deviation
    (mistral_common's); torchvision's processor when it is installed, as ``AutoImageProcessor`` picks."""
    import transformers

    section = params[VISION]
    longest = int(section.get("max_image_size") or section.get("image_size") or 1024)
    cls = getattr(transformers, "PixtralImageProcessor" if importlib.util.find_spec("torchvision")
                  else "PixtralImageProcessorPil")
    settings = {"size": {"longest_edge": longest}, "patch_size": int(section.get("patch_size", 16))}
    return cls.from_dict(settings, **overrides)  # a key it does not read dropped, as from_pretrained drops it
