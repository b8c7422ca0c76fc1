"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector, and the Llama decoder of llama.py.

The language model is `LlamaForCausalLM` itself (Llama, Mistral, Qwen2 or Qwen3
by ``text_config.model_type``), on the paged KV cache; this file adds only the
image encoder. The tower is picked by ``vision_config.model_type`` (`LLAVA_TOWERS`):
CLIP's (clip.py) or SigLIP's (siglip.py: no CLS feature, so ``"default"`` drops the
first patch's, as transformers does; the hidden states of ``vision_feature_layer``,
not normed). Pixtral-12B's checkpoints (a Pixtral tower) are another class,
`PixtralLlavaForConditionalGeneration` in mistral3.py, which the registry picks by
the tower's type. ``mm_encoder_tp_mode`` decides how the encoder (tower and projector)
spreads over the tensor-parallel ranks: "weights" shards it like the decoder
(clip.py; the projector's ``linear_1`` column-parallel, ``linear_2`` row-parallel),
"data" keeps a whole copy on every rank and splits the images instead
(workers/mm_encoder.py). The rest of the multimodal path is shared in asyncllm/mm/:
placeholder expansion on the host, and in the worker the encoder-output cache
and the scatter into the input embeddings, which call `embed_multimodal` here.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
import torch
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.clip import CLIPVisionTower, activation, check_encoder_split
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.qwen2 import Qwen2ForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.siglip import SiglipVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, load_vision_language_weights

__all__ = ["LLAVA_TOWERS", "LlavaForConditionalGeneration", "check_encoder_tensor_parallel", "normalize_llava_name",
           "siglip_feature_tower"]

_LANGUAGE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
}


def siglip_feature_tower(hf_config: Any, tp: TensorParallel, dtype: torch.dtype) -> SiglipVisionTower:
    """The SigLIP tower up to ``vision_feature_layer`` (transformers' ``hidden_states`` index, not normed)."""
    vision, layer = hf_config.vision_config, hf_config.vision_feature_layer
    if not isinstance(layer, int) or not -vision.num_hidden_layers - 1 <= layer <= vision.num_hidden_layers:
        raise NotBuiltError("vision_feature_layer", layer, "a single layer index of the SigLIP tower")
    return SiglipVisionTower(vision, tp, dtype, feature_layer=layer)


class LlavaTower(NamedTuple):
    build: Callable[[Any, TensorParallel, torch.dtype], nn.Module]
    """(hf_config, the encoder's ranks, dtype) -> the tower: pixels -> ``vision_feature_layer``'s hidden states."""
    class_rows: int
    """Feature rows before the patches' (CLIP's CLS: 1; SigLIP: 0), which ``"default"`` drops one of."""


LLAVA_TOWERS: dict[str, LlavaTower] = {
    "clip_vision_model": LlavaTower(lambda hf_config, tp, dtype: CLIPVisionTower(
        hf_config.vision_config, hf_config.vision_feature_layer, tp, dtype), 1),
    "siglip_vision_model": LlavaTower(siglip_feature_tower, 0),
}
"""LLaVA's towers by ``vision_config.model_type`` (Pixtral's: `PixtralLlavaForConditionalGeneration`, mistral3.py)."""


def normalize_llava_name(name: str) -> str:
    """Map the layouts LLaVA checkpoints were saved in (original and transformers 4.52+) to ours."""
    name = name.removeprefix("model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name.removeprefix("vision_tower.vision_model.")
    if name.startswith("language_model.") and not name.startswith(("language_model.model.", "language_model.lm_head.")):
        return "language_model.model." + name.removeprefix("language_model.")
    return name


def check_encoder_tensor_parallel(hf_config: Any, tp_size: int) -> None:
    """`ConfigError` unless the vision tower and the projector shard evenly over ``tp_size`` ranks
    (``mm_encoder_tp_mode="weights"``)."""
    vision = hf_config.vision_config
    check_encoder_split(tp_size, {
        "vision_config.num_attention_heads": vision.num_attention_heads,
        "vision_config.intermediate_size": vision.intermediate_size,
        "text_config.hidden_size": hf_config.text_config.hidden_size,  # the projector's width
    })


class LlavaMultiModalProjector(nn.Module):
    """vision hidden -> text hidden: ``linear_1`` column-parallel, ``linear_2`` row-parallel (one all-reduce)."""

    def __init__(self, hf_config: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "multimodal_projector_bias", True))
        vision, text = hf_config.vision_config.hidden_size, hf_config.text_config.hidden_size
        self.linear_1 = ColumnParallelLinear(vision, text, bias, tp, dtype)
        self.act = activation(hf_config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = RowParallelLinear(text, text, bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features replace the ``<image>`` placeholder embeddings; the rest is the decoder."""

    supports_encoder_data_parallel = True
    """Built with ``mm_encoder_tp_mode="data"`` (the loader passes the mode to a class that says
    this), the vision tower and projector are whole on every rank, so a step's images may be
    split across the ranks (workers/mm_encoder.py)."""
    decoder_classes = _LANGUAGE_MODELS
    """By ``text_config.model_type`` (the decoder an EAGLE head reads: asyncllm/models/eagle_targets.py)."""

    def __init__(
        self,
        hf_config: Any,
        *,
        dtype: torch.dtype,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        max_position: int,
        mm_encoder_tp_mode: str = "weights",
        **decoder_options: Any,
    ) -> None:
        super().__init__()
        text_config = hf_config.text_config
        if text_config.model_type not in _LANGUAGE_MODELS:
            raise NotBuiltError("model", text_config.model_type, f"a LLaVA language model of type {', '.join(_LANGUAGE_MODELS)}")
        strategy = hf_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise NotBuiltError("vision_feature_select_strategy", strategy, "'default' or 'full'")
        self.drop_cls = strategy == "default"
        """Drop the first feature row (CLIP's CLS; with SigLIP the first patch's, as transformers does)."""
        self.encoder_tp = self._encoder_tp(hf_config, tp, mm_encoder_tp_mode)
        """The vision encoder's ranks: ``tp`` ("weights"), or this rank alone (whole encoder, "data")."""
        self.vision_tower = self.make_vision_tower(hf_config, self.encoder_tp, dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config, self.encoder_tp, dtype)
        self.language_model = _LANGUAGE_MODELS[text_config.model_type](
            text_config, dtype=dtype, tp=tp, attn_backend=attn_backend, max_position=max_position, **decoder_options
        )

    vision_towers: tuple[str, ...] = tuple(LLAVA_TOWERS)
    """The ``vision_config.model_type``s this class builds (LLaVA-NeXT: CLIP's alone)."""

    @classmethod
    def tower_of(cls, hf_config: Any) -> LlavaTower:
        """The `LLAVA_TOWERS` entry of ``vision_config.model_type``; `NotBuiltError` naming the built ones."""
        vision_type = hf_config.vision_config.model_type
        if vision_type not in cls.vision_towers:
            pixtral = (" (pixtral: Pixtral-12B's checkpoints, which the registry gives to "
                       "PixtralLlavaForConditionalGeneration)" if cls is LlavaForConditionalGeneration else "")
            raise NotBuiltError("vision_config.model_type", vision_type,
                                f"a {cls.__name__} vision tower of type {', '.join(cls.vision_towers)}{pixtral}")
        return LLAVA_TOWERS[vision_type]

    @classmethod
    def make_vision_tower(cls, hf_config: Any, tp: TensorParallel, dtype: torch.dtype) -> nn.Module:
        """The tower (`tower_of`), its hidden states at ``vision_feature_layer``."""
        return cls.tower_of(hf_config).build(hf_config, tp, dtype)

    @staticmethod
    def _encoder_tp(hf_config: Any, tp: TensorParallel, mode: str) -> TensorParallel:
        if mode == "data":
            return TensorParallel()
        if mode != "weights":
            raise ConfigError("mm_encoder_tp_mode", mode, "'weights' or 'data'")
        check_encoder_tensor_parallel(hf_config, tp.size)
        return tp

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image (``<image>``)."""
        token_id = getattr(hf_config, "image_token_id", None)
        return int(token_id if token_id is not None else hf_config.image_token_index)

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's processor output -> its ``[C, H, W]`` float32 pixels."""
        return processed["pixel_values"][0].astype("float32", copy=False)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """Feature rows (= placeholder tokens) of an image of ``[C, H, W]`` pixels: one per patch, plus CLIP's CLS,
        less one row for 'default' (CLIP's CLS; SigLIP's first patch, as transformers drops it)."""
        patch = hf_config.vision_config.patch_size
        patches = (pixel_shape[-2] // patch) * (pixel_shape[-1] // patch)
        class_rows = LlavaForConditionalGeneration.tower_of(hf_config).class_rows
        return patches + class_rows - (hf_config.vision_feature_select_strategy == "default")

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` images -> ``[N, tokens per image, text hidden]``: one row per placeholder."""
        features = self.vision_tower(pixel_values)
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Route ``language_model.*`` to the decoder's loader; the encoder's parameters keep their shard. A SigLIP
        tower's pooling head (``vision_use_head``), which LLaVA never runs, is left unread."""
        weights = ((name, w) for name, w in weights if not normalize_llava_name(name).startswith("vision_tower.head."))
        return load_vision_language_weights(self, weights, normalize_llava_name, "LLaVA", ("position_ids",))
