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

Videos: the prompt's ``<|video|>`` becomes, per temporal patch (two frames), ``<|begin_of_image|>``, one ``<|image|>``
per 2 x 2 merged patches, ``<|end_of_image|>`` and the patch's first frame's whole seconds as text, as transformers'
``Glm4vProcessor`` writes it; each run is one item of shape ``(1, h, w, features)`` positioned as an image (pixels:
asyncllm/mm/glm4v_video.py). Checkpoints are in transformers 5's layout
(``model.visual.*``, ``model.language_model.*``, ``lm_head``).
"""

from __future__ import annotations

from typing import Any

from asyncllm.mm.glm4v_video import GLM4V_VIDEO_SETTINGS, frame_seconds
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.mm.videos import Video
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
    checkpoint_module_name = staticmethod(Qwen3VLForConditionalGeneration.checkpoint_module_name)

    video_settings = GLM4V_VIDEO_SETTINGS
    """``Glm4vVideoProcessor``'s defaults (asyncllm/mm/glm4v_video.py; the checkpoint's config overrides them)."""

    mm_placeholder_around = {"image": ("image_start_token_id", "image_end_token_id"),
                             "video": ("video_start_token_id", "video_end_token_id")}
    """``<|begin_of_image|><|image|><|end_of_image|>`` in a "string" chat (`MultiModalProcessor.placeholder_text`)."""

    @staticmethod
    def mm_video_token_id(hf_config: Any) -> int:
        """The prompt token that marks a video (``<|video|>``, between ``<|begin_of_video|>`` and
        ``<|end_of_video|>``)."""
        return int(hf_config.video_token_id)

    @staticmethod
    def mm_video_placeholder_id(hf_config: Any) -> int:
        """A video's frames are ``<|image|>`` runs, as transformers' processor writes them."""
        return int(hf_config.image_token_id)

    @classmethod
    def mm_video_pieces(cls, hf_config: Any, tokenizer: Any, video: Video, grid: tuple[int, int, int]) -> list[VideoPiece]:
        """One run per temporal patch: ``<|begin_of_image|>``, its placeholders, ``<|end_of_image|>``, its first
        frame's whole seconds as text; each positioned as an image of one frame (transformers' ``get_rope_index``
        splits a video's grid so)."""
        begin, end = int(hf_config.image_start_token_id), int(hf_config.image_end_token_id)
        seconds = frame_seconds(video, hf_config.vision_config.temporal_patch_size, grid[0])
        return [VideoPiece([begin], slice(i, i + 1), [end] + tokenizer.encode(str(second), add_special_tokens=False))
                for i, second in enumerate(seconds)]


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
    lora_experts = True
    """Adapters on its experts too (asyncllm/models/lora_experts.py), as GLM-4.5's text model takes them."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> Any:
        """Layer ``layer_idx``'s MoE (``hf_config``: the text config, as the registry's checks pass it)."""
        return Glm4vMoeLanguageModel.moe_spec(hf_config, layer_idx)
