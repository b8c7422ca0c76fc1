"""Baidu PaddleOCR-VL (PaddleOCR-VL-0.9B; ``PaddleOCRVLForConditionalGeneration``): a NaViT-style SigLIP tower at
each image's own resolution, a projector merging 2 x 2 patches, and ERNIE 4.5's dense decoder (ERNIE-4.5-0.3B) with
Qwen2-VL's M-RoPE. It runs on Qwen2-VL's path (asyncllm/models/qwen2_vl.py); what differs, following transformers'
``modeling_paddleocr_vl``:

- **Patches**: the image processor (``PaddleOCRVLImageProcessor``, or its PIL twin) resizes an image to a multiple of
  28 pixels between its pixel bounds (``smart_resize``) and cuts it into 14 x 14 patches in raster order (no
  temporal patch, not Qwen's merge-unit order), so an item is ``(1, h, w, C * 14 * 14)``; the prompt's
  ``<|IMAGE_PLACEHOLDER|>`` (between ``<|IMAGE_START|>`` and ``<|IMAGE_END|>``) becomes one placeholder per 2 x 2
  patches.
- **Tower** (`PaddleOCRVisionModel`, names as the checkpoint's ``visual.vision_model.*``): SigLIP's biased patch
  convolution, its learned ``image_size / patch_size`` square table of positions resampled to the image's grid
  (bilinear, half-pixel centres: `interpolated_positions`), SigLIP's encoder layers (q / k / v / out projections
  with biases, LayerNorms, a ``gelu_pytorch_tanh`` MLP) whose attention stays within an image and rotates q and k
  by the patch's row and column (Qwen2-VL's 2-D rotary, ``vision_config.rope_parameters.rope_theta``), then
  ``post_layernorm``. Sharded over the tensor-parallel ranks as CLIP's (or whole: ``mm_encoder_tp_mode="data"``).
- **Projector** (``mlp_AR.*`` in the checkpoint, transformers' ``model.projector.*``): ``pre_norm`` (LayerNorm at
  1e-5) per patch, each 2 x 2 block's patches concatenated (row-major), ``linear_1``, exact GELU, ``linear_2`` to the
  decoder's width; whole on every rank.
- **Decoder**: Llama's layers with ERNIE's ``use_bias`` flag; its rotary is half-split here (transformers'
  ``rotate_half``: no interleaved reordering, unlike ``Ernie4_5ForCausalLM``), on Qwen2-VL's M-RoPE bands
  (``mrope_section``, 16 / 24 / 24 by default); positions are ``get_rope_index``'s: an image at the text position
  before it plus (0, row, column), the text resuming ``max(rows, columns)`` later (`mrope_positions`).

Images only: the config's ``video_token_id`` is not served (transformers' processor takes no videos). LoRA adapters
take the decoder's projections (`DecoderLoRA`); pipeline stages hold the tower and projector on the first stage.
Checkpoints in either layout load: the released one (``visual.*``, ``mlp_AR.*``, ``model.*``, ``lm_head``), which
transformers' ``save_pretrained`` writes back, and transformers 5's in memory (``model.visual.*``,
``model.projector.*``, ``model.language_model.*``); the tower's unused pooling ``head`` and
``packing_position_embedding`` are left unread, as transformers leaves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.clip import CLIPAttention, CLIPEncoderLayer, check_encoder_split
from asyncllm.models.ernie_seed_arcee import Ernie4_5ForCausalLM
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llama import DecoderFlags
from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration, Qwen2VLLanguageModel, normalize_qwen2_vl_name
from asyncllm.models.qwen_vision import Segments, patch_layout, rotate_vision, vision_rotary
from asyncllm.models.vision_language import load_vision_language_weights

__all__ = ["PaddleOCRVLForConditionalGeneration", "PaddleOCRVisionModel", "interpolated_positions",
           "normalize_paddleocr_vl_name"]

_UNREAD = ("packing_position_embedding", "vision_model.head.")
"""Checkpoint tensors transformers leaves unread (``_keys_to_ignore_on_load_unexpected``)."""


def _axis_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table rows each of ``size`` positions on an axis reads from a ``side``-long one, and their weights:
    ``F.interpolate``'s bilinear sampling (half-pixel centres, edges clamped), in transformers' float32 order."""
    src = (torch.arange(size, dtype=torch.float32, device=device) + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    offsets = torch.arange(2, device=device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def interpolated_positions(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A square ``[side * side, width]`` position table resampled to a ``rows x cols`` grid -> ``[rows * cols,
    width]`` in raster order (transformers' ``get_vision_interpolation_indices_and_weights``, bilinear)."""
    side = int(round(table.shape[0] ** 0.5))
    row_taps, row_weights = _axis_taps(rows, side, table.device)
    col_taps, col_weights = _axis_taps(cols, side, table.device)
    index = (row_taps[:, None, :, None] * side + col_taps[None, :, None, :]).reshape(rows * cols, 4)
    weight = (row_weights[:, None, :, None] * col_weights[None, :, None, :]).reshape(rows * cols, 4)
    return (table[index] * weight[:, :, None]).sum(1)


class PaddleOCRVisionEmbeddings(nn.Module):
    """Patches through SigLIP's biased convolution, plus the learned positions resampled to the image's grid."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size, dtype=dtype)
        self.patch = (cfg.num_channels, cfg.patch_size, cfg.patch_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.reshape(-1, *self.patch).to(weight.dtype)).flatten(1)
        table = self.position_embedding.weight
        positions = torch.cat([interpolated_positions(table, h, w).repeat(t, 1) for t, h, w in grid_thw])
        return patches + positions.to(patches.dtype)


class PaddleOCRVisionAttention(CLIPAttention):
    """SigLIP's attention over ``[patches, width]``: q and k rotated by the patches' (row, column), each image
    attending within itself (`Segments`)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        q, k, v = (proj(x).view(x.shape[0], self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = segments.attend(rotate_vision(q, cos, sin), rotate_vision(k, cos, sin), v)
        return self.out_proj(out.flatten(1))


class PaddleOCRVisionLayer(CLIPEncoderLayer):
    """SigLIP's pre-norm layer with the rotary attention."""

    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__(cfg, tp, dtype)
        self.self_attn = PaddleOCRVisionAttention(cfg, tp, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # type: ignore[override]
                segments: Segments) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, segments)
        return x + self.mlp(self.layer_norm2(x))


class PaddleOCRVisionTransformer(nn.Module):
    """Pixels ``[patches, C * patch * patch]`` (raster order) of images of ``(t, h, w)`` patches -> ``[patches,
    width]`` after ``post_layernorm``."""

    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise NotBuiltError("vision_config.rope_parameters", rope, "a vision rotary embedding other than 'axial'")
        check_encoder_split(tp.size, {"vision_config.num_attention_heads": cfg.num_attention_heads,
                                      "vision_config.intermediate_size": cfg.intermediate_size})
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.embeddings = PaddleOCRVisionEmbeddings(cfg, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(PaddleOCRVisionLayer(cfg, tp, dtype) for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        layout = patch_layout(grid_thw, 1, None, pixel_values.device)  # merge 1: (row, column) in raster order
        if pixel_values.shape[0] != layout.num_patches:
            raise ValueError(f"{pixel_values.shape[0]} patches of pixels for grids {list(grid_thw)}")
        hidden = self.embeddings(pixel_values, grid_thw)
        cos, sin = vision_rotary(layout.positions, self.head_dim, self.rope_theta)
        for layer in self.encoder.layers:
            hidden = layer(hidden, cos, sin, layout.frames)
        return self.post_layernorm(hidden)


class PaddleOCRVisionModel(nn.Module):
    """transformers' ``PaddleOCRVisionModel``: the transformer under ``vision_model`` (the checkpoint's names)."""

    def __init__(self, vision_config: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.vision_model = PaddleOCRVisionTransformer(vision_config, tp, dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        return self.vision_model(pixel_values, grid_thw)


class PaddleOCRProjector(nn.Module):
    """Each 2 x 2 block of patches (raster order within an image) -> one row of the decoder's width."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision = hf_config.vision_config
        self.merge, self.width = int(vision.spatial_merge_size), int(vision.hidden_size)
        unit = self.width * self.merge**2
        self.pre_norm = nn.LayerNorm(self.width, eps=1e-5, dtype=dtype)  # fixed in transformers
        self.linear_1 = nn.Linear(unit, unit, dtype=dtype)
        self.linear_2 = nn.Linear(unit, hf_config.text_config.hidden_size, dtype=dtype)

    def forward(self, hidden: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        m, blocks = self.merge, []
        for (t, h, w), patches in zip(grid_thw, self.pre_norm(hidden).split([t * h * w for t, h, w in grid_thw])):
            blocks.append(patches.view(t, h // m, m, w // m, m, self.width).transpose(2, 3).reshape(-1, m * m * self.width))
        return self.linear_2(F.gelu(self.linear_1(torch.cat(blocks))))


class PaddleOCRLanguageModel(Qwen2VLLanguageModel):
    """ERNIE 4.5's dense layers (Llama's, biased by ``use_bias``) with a half-split M-RoPE."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return Ernie4_5ForCausalLM.decoder_flags(hf_config)


def normalize_paddleocr_vl_name(name: str) -> str:
    """Either checkpoint layout -> ours: ``visual.*``, ``projector.*``, ``language_model.model.*``,
    ``language_model.lm_head.*``."""
    for theirs in ("mlp_AR.", "model.projector."):
        if name.startswith(theirs):
            return "projector." + name.removeprefix(theirs)
    return normalize_qwen2_vl_name(name)


class PaddleOCRVLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Image features (tower, then projector) replace the ``<|IMAGE_PLACEHOLDER|>`` embeddings; positions are
    M-RoPE's; images only."""

    tower_cls = PaddleOCRVisionModel
    language_model_cls = PaddleOCRLanguageModel
    normalize_name = staticmethod(normalize_paddleocr_vl_name)
    mm_placeholder_around = {"image": ("vision_start_token_id", "vision_end_token_id")}
    mm_video_token_id = None
    """No videos (transformers' ``PaddleOCRVLProcessor`` takes none)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(hf_config, dtype=dtype, **kwargs)
        self.projector = PaddleOCRProjector(hf_config, dtype)

    @staticmethod
    def mm_check_image_processor(hf_config: Any, image_processor: Any) -> None:
        """`ConfigError` unless the checkpoint's image processor is transformers' ``PaddleOCRVLImageProcessor`` (or
        its PIL twin) patching as the tower does: another one (a remote-code processor's name resolving to SigLIP's
        fixed-size one) would size the items wrongly without a word."""
        name = type(image_processor).__name__
        if name not in ("PaddleOCRVLImageProcessor", "PaddleOCRVLImageProcessorPil"):
            raise ConfigError("preprocessor_config.json", name, "PaddleOCRVLImageProcessor (image_processor_type)")
        vision = hf_config.vision_config
        want = {"patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size, "temporal_patch_size": 1}
        for key, value in want.items():
            if getattr(image_processor, key, None) != value:
                raise ConfigError(f"preprocessor_config.json {key}", getattr(image_processor, key, None),
                                  f"{value}, as the model's vision_config")

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, t, h, w, features]`` images of one grid -> ``[N, t * h * w / 4, text hidden]``."""
        n, t, h, w, features = pixel_values.shape
        grid = [(t, h, w)] * n
        out = self.projector(self.visual(pixel_values.reshape(n * t * h * w, features), grid), grid)
        return out.view(n, -1, out.shape[-1])

    @staticmethod
    def checkpoint_module_name(name: str) -> str:
        """Our module name -> the released checkpoint's (what a quantization_config names)."""
        if name.startswith("projector."):
            return "mlp_AR." + name.removeprefix("projector.")
        return name.removeprefix("language_model.")

    def unread_weight(self, name: str) -> bool:
        """Whether the loader leaves a checkpoint tensor unread: the tower's pooling head and packing table (as
        transformers; a pushed one is refused, workers/weight_update.py), or the decoder's own."""
        return any(part in name for part in _UNREAD) or super().unread_weight(name)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        read = ((name, weight) for name, weight in weights if not self.unread_weight(name))
        return load_vision_language_weights(self, read, normalize_paddleocr_vl_name, "PaddleOCR-VL")
