"""Phi-4-multimodal (``Phi4MultimodalForCausalLM``: microsoft/Phi-4-multimodal-instruct in transformers' layout):
images and audios in, text out, over the Phi-3 decoder (phi3.py: fused q/k/v and gate/up, partial rotary, LongRoPE).

Images (asyncllm/mm/phi4_mm_images.py makes an item of each: its global view and its 448-pixel HD crops with their
patch masks): siglip.py's SigLIP tower (CLIP's layers, clip.py, their attention masked to each crop's real patches;
positions bucketized over a view's real patches, as Idefics3's) read at ``vision_config.feature_layer`` (-2: the
last layer, the norm and the pooling head are not run, their weights not read), each view's patches averaged 2 x 2,
then transformers' layout: the crops' features stitched into one grid cut to its real rows and columns, each row
followed by ``sub_img_feature_extensor``, then ``global_img_feature_extensor``, then the global view's rows (each
followed by the same), through ``img_projection_up``, GELU, ``img_projection_down``. An image's ``<|image|>`` becomes
one placeholder per row (transformers' ``num_img_tokens``).

Audios: asyncllm/models/phi4_mm_audio.py (the conformer encoder and its two projections).

The checkpoint's modality LoRA adapters (``vision-lora/``, ``speech-lora/``) are not merged: the base model is
served as transformers runs it; pass an adapter as a `LoRARequest` of its folder, as vLLM serves them
(docs/multimodal.md#phi-4-multimodal).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError
from asyncllm.mm.phi4_mm_images import Phi4MultimodalImages, unpack_views
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.phi3 import Phi3ForCausalLM
from asyncllm.models.phi4_mm_audio import Phi4AudioEmbedding, audio_rows, audio_values
from asyncllm.models.siglip import MaskedSiglipVisionEmbeddings, SiglipVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, load_vision_language_weights

__all__ = ["Phi4MultimodalForCausalLM", "image_rows"]

_EXTEND = "model.embed_tokens_extend."


def _half(side: int) -> int:
    """Rows (or columns) of a view's features: its patches averaged 2 x 2, an odd side padded by reflection."""
    return (side + 1) // 2


def _kept_counts(masks: Any, cols: int) -> tuple[Any, Any]:
    """`image_rows`' two counts as sums of ``masks``' own kind (a device tensor's stay there: no read per image)."""
    crops = masks[1:, ::2, ::2]
    rows, side = crops.shape[0] // cols, crops.shape[-1]
    grid = crops.reshape(rows, cols, side, side).swapaxes(1, 2).reshape(rows * side, cols * side)
    return grid[:, 0].sum(), grid[0, :].sum()


def image_rows(masks: np.ndarray | torch.Tensor, cols: int) -> tuple[int, int]:
    """(feature rows, feature columns) of an image's crops kept (``masks``: its ``[1 + crops, P, P]`` patch masks,
    every other patch of the crops' stitched grid counted, as transformers does)."""
    rows, columns = _kept_counts(masks, cols)
    return int(rows), int(columns)


class Phi4ImageEmbedding(nn.Module):
    """transformers' ``Phi4MultimodalImageEmbedding``: the tower, 2 x 2 pooling, the HD layout, the projection."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision, hidden = hf_config.vision_config, hf_config.hidden_size
        width = vision.hidden_size
        self.size, self.patches = int(vision.crop_size), vision.image_size // vision.patch_size
        self.img_processor = SiglipVisionTower(vision, TensorParallel(), dtype, feature_layer=int(vision.feature_layer),
                                               embeddings=MaskedSiglipVisionEmbeddings(vision), build_unused=False)
        self.img_projection_up = nn.Linear(width, hidden, dtype=dtype)
        self.img_projection_down = nn.Linear(hidden, hidden, dtype=dtype)
        self.global_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, width, dtype=dtype))
        self.sub_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, 1, width, dtype=dtype))

    def view_features(self, views: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """``[V, 3, S, S]`` views -> ``[V, h, h, width]`` features (patches averaged 2 x 2)."""
        hidden = self.img_processor(views, masks)
        grid = hidden.view(hidden.shape[0], self.patches, self.patches, -1).permute(0, 3, 1, 2)
        if self.patches % 2:
            grid = F.pad(grid, (0, 1, 0, 1), mode="reflect")
        return F.avg_pool2d(grid, 2, 2).permute(0, 2, 3, 1)

    def image(self, features: torch.Tensor, cols: int, rows: int, columns: int) -> torch.Tensor:
        """One image's ``[V, h, h, width]`` view features (its crops' ``cols``, and the feature ``rows`` and
        ``columns`` they keep: `image_rows`) -> its ``[rows, text hidden]`` input rows."""
        h, width = features.shape[1], features.shape[-1]
        crops_rows = (features.shape[0] - 1) // cols
        whole = torch.cat([features[0], self.sub_img_feature_extensor[0].expand(h, 1, width)], dim=1)
        grid = features[1:].reshape(crops_rows, cols, h, h, width).transpose(1, 2)
        grid = grid.reshape(crops_rows * h, cols * h, width)
        grid = torch.cat([grid[:rows, :columns], self.sub_img_feature_extensor[0].expand(rows, 1, width)], dim=1)
        merged = torch.cat([grid.reshape(-1, width), self.global_img_feature_extensor[0], whole.reshape(-1, width)])
        return self.img_projection_down(F.gelu(self.img_projection_up(merged)))

    def forward(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``[N, V, packed]`` images of one view count -> each image's input rows."""
        views, masks, cols = unpack_views(values, self.size, self.patches)
        masks = masks > 0.5
        features = self.view_features(views.flatten(0, 1), masks.flatten(0, 1)).unflatten(0, views.shape[:2])
        cols_of = cols[:, 0].long().tolist()  # one read of the batch's grids, not one per image
        kept = torch.stack([torch.stack(_kept_counts(masks[i], c)) for i, c in enumerate(cols_of)]).tolist()
        return [self.image(features[i], c, *kept[i]) for i, c in enumerate(cols_of)]


def _decoder_config(hf_config: Any) -> Any:
    """The decoder's config: the checkpoint's own (Phi-4-multimodal keeps no ``text_config``), towers set aside."""
    text = copy.copy(hf_config)
    text.vision_config = text.audio_config = None
    return text


class Phi4MultimodalForCausalLM(DecoderLoRA, VisionLanguageModel):
    """Image rows (and audio rows: phi4_mm_audio.py) replace their placeholders' embeddings; the rest is Phi-3's
    decoder (which takes LoRA adapters: `DecoderLoRA`)."""

    supports_encoder_data_parallel = True
    """The towers are whole on every rank in either mode, so "data" splits a step's images."""
    takes_max_model_len = True
    """The loader passes ``max_model_len``: it chooses LongRoPE's factors (phi3.py)."""
    mm_image_processor_class = Phi4MultimodalImages
    """transformers' ``Phi4MultimodalImageProcessor`` needs torchvision: this stands in for it (asyncllm/mm/)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        if mm_encoder_tp_mode not in ("weights", "data"):
            raise ConfigError("mm_encoder_tp_mode", mm_encoder_tp_mode, "'weights' or 'data'")
        self.language_model = Phi3ForCausalLM(_decoder_config(hf_config), dtype=dtype, tp=tp,
                                              attn_backend=attn_backend, max_position=max_position, **decoder_options)
        self.image_embed = Phi4ImageEmbedding(hf_config, dtype)
        self.audio_embed = Phi4AudioEmbedding(hf_config, dtype)
        self.hf_config = hf_config
        self.vision_layers_run = self.image_embed.img_processor.num_layers_run
        """The tower's layers up to ``feature_layer``; the checkpoint's later ones are not read."""

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image (``<|image|>``)."""
        return int(hf_config.vision_config.image_token_id)

    @staticmethod
    def mm_audio_token_id(hf_config: Any) -> int:
        """The prompt token that marks an audio (``<|audio|>``)."""
        return int(hf_config.audio_config.audio_token_id)

    mm_audio_extractor_kwargs: dict[str, Any] = {}
    """``Phi4MultimodalFeatureExtractor``'s defaults: one audio, unpadded."""
    mm_audio_values = staticmethod(audio_values)

    @staticmethod
    def mm_audio_windows(waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        return [waveform]

    @staticmethod
    def mm_audio_with_images(values: np.ndarray, with_images: bool) -> np.ndarray:
        """An audio's values with its projection marked: 1.0 when its prompt holds images (phi4_mm_audio.py)."""
        values[..., -1] = 1.0 if with_images else 0.0
        return values

    @staticmethod
    def mm_pixel_values(processed: np.ndarray) -> np.ndarray:
        """One image's packed views (asyncllm/mm/phi4_mm_images.py)."""
        return processed

    @staticmethod
    def mm_placeholder_length_of(hf_config: Any, values: np.ndarray) -> int:
        """An audio's ``[1, frames, bins + 1]`` -> its encoder rows; an image's rows: its crops' kept grid, each row
        and the global view's one longer, and one between."""
        if values.ndim == 3:
            return audio_rows(hf_config.audio_config, values.shape[1])
        vision = hf_config.vision_config
        patches = vision.image_size // vision.patch_size
        _, masks, cols = unpack_views(values[None], int(vision.crop_size), patches)
        rows, columns = image_rows(masks[0], int(cols[0, 0]))
        side = _half(patches)
        return rows * (columns + 1) + 1 + side * (side + 1)

    def embed_multimodal(self, values: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """``[N, V, packed]`` images of one view count -> each one's ``[rows, hidden]``; ``[N, 1, frames, bins + 1]``
        audios -> ``[N, rows, hidden]``."""
        return self.audio_embed(values) if values.ndim == 4 else self.image_embed(values)

    # ---- weights
    @staticmethod
    def _normalize(name: str) -> str:
        if name.startswith(_EXTEND):
            return name.removeprefix(_EXTEND)
        return "language_model." + name

    def _unread(self, name: str) -> bool:
        """The tower's parts transformers computes but does not use (its pooling head, its last norm, the layers
        past ``feature_layer``)."""
        tower = "image_embed.img_processor."
        if name.startswith((tower + "head.", tower + "post_layernorm.")):
            return True
        layers = tower + "encoder.layers."
        return name.startswith(layers) and int(name[len(layers):].split(".")[0]) >= self.vision_layers_run

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers' names: ``model.*`` and ``lm_head`` the decoder's, ``model.embed_tokens_extend.*`` the
        towers'."""
        kept = ((name, w) for name, w in weights if not self._unread(self._normalize(name)))
        return load_vision_language_weights(self, kept, self._normalize, "Phi-4-multimodal")
