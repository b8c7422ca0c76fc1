"""InternVL 3 / 3.5 in transformers' layout (``InternVLForConditionalGeneration``: the ``-hf`` checkpoints): the
InternViT tower, pixel shuffle and an MLP projector before a Qwen2 / Qwen3 / Llama decoder.

The checkpoint's image processor (``GotOcr2ImageProcessor``) cuts an image into up to ``max_patches`` tiles of
448 x 448 pixels (plus a thumbnail); each tile becomes ``image_seq_length`` (256) ``<IMG_CONTEXT>`` tokens, and
the image's tokens are wrapped in ``<img>`` ... ``</img>``, as transformers' ``InternVLProcessor`` writes them.
The whole wrapped run is one item of shape ``(tiles, 3, 448, 448)``; the wrapper tokens keep their own
embeddings (`mm_text_rows`, as Mistral 3's row breaks).

The tower (plain torch, whole on every rank): a patch convolution, a CLS token and position embeddings, then
pre-norm layers (LayerNorm or RMSNorm) with layer scale (``lambda_1``, ``lambda_2``), optional q/k RMSNorm over
the whole projection, a GELU MLP; the CLS row dropped (``vision_feature_select_strategy`` "default"), each 2 x 2
patches shuffled into one (``downsample_ratio`` 0.5), then LayerNorm, linear, GELU, linear to the decoder's width.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.models.clip import activation
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.qwen2 import Qwen2ForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.pixtral import VisionRMSNorm
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["InternVLForConditionalGeneration", "InternVisionTower"]

_DECODERS: dict[str, type[LlamaForCausalLM]] = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                                               "llama": LlamaForCausalLM}


def _norm(config: Any, width: int, dtype: torch.dtype) -> nn.Module:
    if config.norm_type == "rms_norm":
        return VisionRMSNorm(width, config.layer_norm_eps, dtype)
    if config.norm_type != "layer_norm":
        raise NotBuiltError("vision_config.norm_type", config.norm_type, "layer_norm or rms_norm")
    return nn.LayerNorm(width, eps=config.layer_norm_eps, dtype=dtype)


class _Attention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width, bias = config.hidden_size, bool(config.attention_bias)
        self.heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width, bias=bias, dtype=dtype) for _ in range(3))
        self.projection_layer = nn.Linear(width, width, dtype=dtype)
        self.qk_norm = bool(config.use_qk_norm)
        if self.qk_norm:
            self.q_norm, self.k_norm = VisionRMSNorm(width, 1e-6, dtype), VisionRMSNorm(width, 1e-6, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        return self.projection_layer(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class _MLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.act = activation(config.hidden_act, "vision_config.hidden_act")
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = _Attention(config, dtype)
        self.mlp = _MLP(config, dtype)
        self.layernorm_before = _norm(config, config.hidden_size, dtype)
        self.layernorm_after = _norm(config, config.hidden_size, dtype)
        self.lambda_1 = nn.Parameter(torch.ones(config.hidden_size, dtype=dtype))
        self.lambda_2 = nn.Parameter(torch.ones(config.hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lambda_1 * self.attention(self.layernorm_before(x)) + x
        return self.lambda_2 * self.mlp(self.layernorm_after(x)) + x


class _PatchEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.projection = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size,
                                    dtype=dtype)


class _Embeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        size, patch = (config.image_size, config.patch_size)
        size = size if isinstance(size, (list, tuple)) else (size, size)
        patch = patch if isinstance(patch, (list, tuple)) else (patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size, dtype=dtype))
        self.patch_embeddings = _PatchEmbeddings(config, dtype)
        patches = (size[0] // patch[0]) * (size[1] // patch[1])
        self.position_embeddings = nn.Parameter(torch.zeros(1, patches + 1, config.hidden_size, dtype=dtype))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        conv = self.patch_embeddings.projection
        patches = conv(pixels.to(conv.weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] + 1 != self.position_embeddings.shape[1]:
            raise ValueError(f"{patches.shape[1]} patches a tile, the position embeddings hold "
                             f"{self.position_embeddings.shape[1] - 1}: tiles of the config's image_size only")
        return torch.cat([self.cls_token.expand(len(patches), -1, -1), patches], 1) + self.position_embeddings


class _Encoder(nn.Module):
    def __init__(self, config: Any, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config, dtype) for _ in range(num_layers))


class InternVisionTower(nn.Module):
    """``[B, 3, H, W]`` tiles -> ``[B, 1 + patches, hidden]``: the output of ``vision_feature_layer`` (-1: the last
    layer's, through the final LayerNorm unless ``use_mean_pooling``)."""

    def __init__(self, config: Any, feature_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        if not isinstance(feature_layer, int):
            raise NotBuiltError("vision_feature_layer", feature_layer, "a single vision feature layer")
        total = config.num_hidden_layers
        layers = total if feature_layer == -1 else (feature_layer if feature_layer >= 0 else total + 1 + feature_layer)
        if not 0 <= layers <= total:
            raise NotBuiltError("vision_feature_layer", feature_layer, f"a layer of the {total}-layer tower")
        self.embeddings = _Embeddings(config, dtype)
        self.encoder = _Encoder(config, layers, dtype)
        self.layernorm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
                          if feature_layer == -1 and not config.use_mean_pooling else nn.Identity())

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)


def pixel_shuffle(features: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' InternVL pixel shuffle: ``[B, W, H, C]`` -> ``[B, W * scale, H * scale, C / scale**2]``."""
    b, w, h, c = features.shape
    x = features.view(b, w, int(h * scale), int(c / scale)).permute(0, 2, 1, 3).contiguous()
    x = x.view(b, int(h * scale), int(w * scale), int(c / scale**2))
    return x.permute(0, 2, 1, 3).contiguous()


class InternVLProjector(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width = hf_config.vision_config.hidden_size * int(1 / hf_config.downsample_ratio) ** 2
        text = hf_config.text_config.hidden_size
        self.layer_norm = nn.LayerNorm(width, dtype=dtype)
        self.linear_1 = nn.Linear(width, text, dtype=dtype)
        self.act = activation(hf_config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(text, text, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features replace the ``<IMG_CONTEXT>`` embeddings; ``<img>`` / ``</img>`` keep theirs."""

    mm_string_placeholder = False
    """A "string" chat's media parts are refused: vLLM's placeholder text differs from the marker token
    (`MultiModalProcessor.placeholder_text`)."""

    supports_encoder_data_parallel = True

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        if hf_config.vision_feature_select_strategy != "default":
            raise NotBuiltError("vision_feature_select_strategy", hf_config.vision_feature_select_strategy, "default")
        self.language_model = build_decoder(hf_config, _DECODERS, "InternVL", mm_encoder_tp_mode, dtype=dtype, tp=tp,
                                            attn_backend=attn_backend, max_position=max_position, **decoder_options)
        self.hf_config = hf_config
        self.vision_tower = InternVisionTower(hf_config.vision_config, hf_config.vision_feature_layer, dtype)
        self.multi_modal_projector = InternVLProjector(hf_config, dtype)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image (``<IMG_CONTEXT>``)."""
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's processor output -> its ``(tiles, 3, H, W)`` float32 tiles."""
        return processed["pixel_values"].astype("float32", copy=False)

    @staticmethod
    def _tokens_per_tile(hf_config: Any) -> int:
        vision = hf_config.vision_config
        size = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
        patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
        return int((size // patch) ** 2 * hf_config.downsample_ratio ** 2)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        return pixel_shape[0] * InternVLForConditionalGeneration._tokens_per_tile(hf_config) + 2

    @staticmethod
    def mm_placeholder_ids(hf_config: Any, tokenizer: Any, pixel_shape: tuple[int, ...]) -> list[int]:
        """``<img>``, one ``<IMG_CONTEXT>`` per feature row, ``</img>``."""
        start, end = (int(tokenizer.convert_tokens_to_ids(getattr(tokenizer, attr, default)))
                      for attr, default in (("start_image_token", "<img>"), ("end_image_token", "</img>")))
        count = InternVLForConditionalGeneration.mm_placeholder_length(hf_config, pixel_shape) - 2
        return [start] + [int(hf_config.image_token_id)] * count + [end]

    def mm_text_rows(self, pixel_shape: tuple[int, ...]) -> np.ndarray:
        """The wrapper tokens' rows (first and last)."""
        return np.array([0, self.mm_placeholder_length(self.hf_config, pixel_shape) - 1])

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, tiles, 3, H, W]`` -> ``[N, tiles * tokens + 2, text hidden]`` (zero rows for ``<img>``, ``</img>``)."""
        n, tiles = pixel_values.shape[:2]
        features = self.vision_tower(pixel_values.flatten(0, 1))[:, 1:]  # the CLS row dropped
        side = int(features.shape[1] ** 0.5)
        shuffled = pixel_shuffle(features.reshape(len(features), side, side, -1), self.hf_config.downsample_ratio)
        rows = self.multi_modal_projector(shuffled.reshape(len(features), -1, shuffled.shape[-1]))
        rows = rows.reshape(n, -1, rows.shape[-1])
        pad = rows.new_zeros(n, 1, rows.shape[-1])
        return torch.cat([pad, rows, pad], dim=1)

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers' layout (``model.vision_tower.*``, ``model.multi_modal_projector.*``,
        ``model.language_model.*``, ``lm_head``), as LLaVA's."""
        from asyncllm.models.llava import normalize_llava_name

        return load_vision_language_weights(self, weights, normalize_llava_name, "InternVL")
