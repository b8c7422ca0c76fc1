"""Zhipu GLM-4.1V (GLM-4.1V-9B-Thinking, ``Glm4vForConditionalGeneration``): a native-resolution vision tower
before GLM-4-0414's decoder with M-RoPE.

It runs on Qwen2-VL's path (asyncllm/models/qwen2_vl.py): the image processor (``Glm4vImageProcessor``; its PIL
twin where torchvision is missing, which ``AutoImageProcessor`` then picks) resizes an image to a multiple of 28
pixels and cuts it into 14 x 14 patches in Qwen's order, so an item is ``(t, h, w, patch_features)`` and each
``<|image|>`` becomes one placeholder per 2 x 2 merged patches (transformers' ``Glm4vProcessor`` repeats the
``<|image|>`` between the chat template's ``<|begin_of_image|>`` and ``<|end_of_image|>``).

- **The tower**: asyncllm/models/glm4v_vision.py.
- **The decoder**: GLM-4-0414's layers (asyncllm/models/glm4.py: post-sublayer norms, biased q/k/v, fused
  gate_up, interleaved partial rotary turned half-split by reordering q/k rows at load) whose rotary is M-RoPE's:
  ``mrope_section`` bands (8 / 12 / 12 by default) of the rotated frequencies turn with time, height, width.
  The reordering keeps each frequency's pair, so the bands are those of asyncllm/models/mrope.py.
- **Positions**: transformers' ``Glm4vModel.get_rope_index`` puts an image's tokens at the text position before
  it plus (0, row, col) and resumes the text ``max(rows, cols)`` later, which is the Qwen rule's largest position
  + 1 for an image (one temporal patch): mrope.py's `mrope_positions` as it is.

GLM-4.5V (``Glm4vMoeForConditionalGeneration``) is the same tower and positions over GLM-4.5's layers
(asyncllm/models/glm4_moe.py: biased q/k/v, half-split partial rotary, no q/k norms here, DeepSeek-V3's experts
after the dense first layers; per-expert checkpoint names) with M-RoPE's bands.

Videos (GLM's per-frame runs with timestamps) are not built: the model has no video token (a prompt's videos are
refused, ``limit_mm_per_prompt["video"]`` is a `NotBuiltError`). Checkpoints are in transformers 5's layout
(``model.visual.*``, ``model.language_model.*``, ``lm_head``).
"""

from __future__ import annotations

from typing import Any

from asyncllm.models.glm4 import Glm4DecoderLayer, Glm4ForCausalLM
from asyncllm.models.glm4_moe import Glm4MoeForCausalLM
from asyncllm.models.glm4v_vision import Glm4vVisionTower
from asyncllm.models.llama import DecoderFlags
from asyncllm.models.qwen2_vl import (
    Qwen2VLForConditionalGeneration,
    Qwen2VLTextModel,
    Qwen3VLForConditionalGeneration,
    _MRopeBuild,
)

__all__ = ["Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration"]


class Glm4vTextModel(Qwen2VLTextModel):
    """GLM-4-0414's layers; ``[3, T]`` positions rotate by the step's M-RoPE table."""

    layer_cls = Glm4DecoderLayer


class Glm4vLanguageModel(_MRopeBuild, Glm4ForCausalLM):
    model_cls = Glm4vTextModel
    default_mrope_section = (8, 12, 12)
    default_partial_rotary = 1.0
    """transformers' GLM-4.1V rotates whole heads unless ``partial_rotary_factor`` says otherwise (the checkpoints
    say 0.5)."""


class Glm4vForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Image features replace the ``<|image|>`` placeholder embeddings; positions are M-RoPE's."""

    tower_cls = Glm4vVisionTower
    language_model_cls = Glm4vLanguageModel
    packed_modules = Glm4vLanguageModel.packed_modules
    checkpoint_module_name = staticmethod(Qwen3VLForConditionalGeneration.checkpoint_module_name)

    mm_video_token_id = None
    """Videos are not built (asyncllm/mm/processor.py reads None as "takes no videos")."""
    video_settings = None
    mm_kinds_not_built = ("video",)
    """Inputs the family has and asyncllm does not build: ``limit_mm_per_prompt`` for them is a `NotBuiltError`."""

    @property
    def fused_parts(self) -> dict[str, list[tuple[object, int]]]:
        """The decoder's fused gate-up rows, which LoRA adapters of it hold fused too (asyncllm/models/lora.py)."""
        return getattr(self.language_model, "fused_parts", {})

    def lora_b_rows(self, name: str, weight: Any) -> Any:
        """An adapter's q / k B rows reordered as the decoder's rotary rows are (GLM's interleaved pairs)."""
        reorder = getattr(self.language_model, "lora_b_rows", None)  # GLM-4.5's half-split rotary: no reorder
        return weight if reorder is None else reorder(name, weight)


class Glm4vMoeLanguageModel(_MRopeBuild, Glm4MoeForCausalLM):
    model_cls = Qwen2VLTextModel
    default_mrope_section = (8, 12, 12)

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        """GLM-4.5V's attention has q/k/v biases and no per-head q/k norms (its config has no ``use_qk_norm``)."""
        return DecoderFlags(qkv_bias=bool(hf_config.attention_bias), qk_norm=bool(getattr(hf_config, "use_qk_norm",
                                                                                           False)))


class Glm4vMoeForConditionalGeneration(Glm4vForConditionalGeneration):
    """GLM-4.5V: GLM-4.1V's tower and positions over GLM-4.5's mixture-of-experts layers."""

    is_moe = True
    language_model_cls = Glm4vMoeLanguageModel
    packed_modules = Glm4vMoeLanguageModel.packed_modules
    lora_experts = True
    """Adapters on its experts too (asyncllm/models/lora_experts.py), as GLM-4.5's text model takes them."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> Any:
        """Layer ``layer_idx``'s MoE (``hf_config``: the text config, as the registry's checks pass it)."""
        return Glm4vMoeLanguageModel.moe_spec(hf_config, layer_idx)
