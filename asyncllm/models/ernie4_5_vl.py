"""Baidu ERNIE 4.5 VL (ERNIE-4.5-VL-28B-A3B, 424B-A47B; ``Ernie4_5_VLMoeForConditionalGeneration``): a
Qwen2-VL-style vision tower and resampler (asyncllm/models/ernie4_5_vl_vision.py) before ERNIE 4.5's
mixture-of-experts decoder, whose experts are split by modality.

It runs on Qwen2-VL's path (asyncllm/models/qwen2_vl.py): the image processor (``Ernie4_5_VLMoeImageProcessor``,
or its PIL twin) resizes an image to a multiple of 28 pixels and cuts it into 14 x 14 patches in Qwen's merge-unit
order (no temporal patch), so an item is ``(1, h, w, patch_features)`` and the prompt's ``<|IMAGE_PLACEHOLDER|>``
(between the chat template's ``<|IMAGE_START|>`` and ``<|IMAGE_END|>``) becomes one placeholder per 2 x 2 patches.

- **Positions** (transformers' ``get_rope_index``): an image's tokens at the text position before it plus
  (0, row, col), the text resuming ``max(rows, cols)`` later (Qwen's rule for images; a video's differs below).
- **Rotary**: ERNIE's interleaved pairs, turned half-split by reordering q/k rows at load (as the text model's);
  of the ``mrope_section = [h, w, t]`` bands (22 / 22 / 20 by default), the first ``2h`` frequencies alternate
  height (even) and width (odd), the last ``t`` turn with time (`ErnieMRotaryEmbedding`).
- **Experts by modality** (`ErnieVLMoE`): each MoE layer has a text router and experts, a vision router and
  experts (their own ``moe_intermediate_size``), and shared experts every token runs. A token is a vision
  token when its id is an image's or a video's placeholder, start or end marker (transformers' processor's
  ``moe_mm_token_type_ids``) in the prompt of a request with images or videos; generated tokens are text
  (`ModalityRows`, docs/moe.md).
- **Checkpoints**: Baidu's layout, which transformers' ``save_pretrained`` writes back: ``model.vision_model.*``,
  ``model.resampler_model.*``, ``model.layers.*`` with routers stored ``[hidden, E]`` (``mlp.gate.weight`` text,
  ``mlp.gate.weight_1`` vision), one ``moe_statics.e_score_correction_bias`` ``[2, E]`` (text row, vision row)
  and ``mlp.experts.{0 .. 2E-1}`` (text experts, then vision experts).

LoRA adapters take the decoder's attention and dense MLPs (their q / k B rows reordered as the rotary's: `lora_b_rows`);
the experts take none. Pipeline stages route their own layers' rows (`step_scope`, which asyncllm/models/pipeline.py
enters).

**Videos** (transformers' ``Ernie4_5_VLMoeVideoProcessor``, asyncllm/mm/ernie_video.py): each frame stamped with
its time and cut into 14 x 14 patches, an even number of frames; a video is one item of ``(frames, h, w, 588)``,
its ``<|VIDEO_PLACEHOLDER|>`` (between ``<|VIDEO_START|>`` and ``<|VIDEO_END|>``) one placeholder per 2 x 2 patches
of a frame pair (the resampler's temporal merge pairs frames 0 and 1, 2 and 3, ...). Its positions are frame pair,
row and column past the text before it, the text resuming ``max(rows, cols)`` later (`ernie_mrope_positions`:
transformers' rule, not Qwen's); its placeholders and markers run the vision experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, ContextManager, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError
from asyncllm.mm.ernie_video import ErnieVideoProcessing
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.mm.videos import Video
from asyncllm.models.ernie4_5_vl_vision import ErnieResampler, ErnieVisionTower
from asyncllm.models.ernie_seed_arcee import Ernie4_5_MoeForCausalLM, ErnieMoE
from asyncllm.models.layers import LoadedWeight, TensorParallel, head_dim_of
from asyncllm.models.llama import DecoderBuild, LlamaMLP
from asyncllm.models.moe import MoESpec
from asyncllm.models.mrope import MRotaryEmbedding, mrope_section
from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration, Qwen2VLTextModel
from asyncllm.models.vision_language import load_vision_language_weights

__all__ = ["Ernie4_5_VLMoeForConditionalGeneration", "ErnieMRotaryEmbedding", "ErnieVLMoE", "ModalityRows",
           "ernie_mrope_positions"]

_DEFAULT_SECTION = (22, 22, 20)
_VISION_MARKERS = ("image_token_id", "image_start_token_id", "image_end_token_id", "video_token_id",
                   "video_start_token_id", "video_end_token_id")
"""The config's token ids whose rows run the vision experts (transformers' ``moe_mm_token_type_ids``)."""


class ErnieMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE whose frequency ``j`` turns with height (even ``j < 2h``), width (odd ``j < 2h``) or time (the rest)."""

    def __init__(self, hf_config: Any, head_dim: int, max_position: int) -> None:
        super().__init__(hf_config, head_dim, max_position, default_section=_DEFAULT_SECTION)
        h, w, t = mrope_section(hf_config, self.rotary_dim, _DEFAULT_SECTION)
        if h != w:
            raise ConfigError("rope_parameters.mrope_section", [h, w, t], "equal height and width bands")
        axis = torch.zeros(h + w + t, dtype=torch.int64)
        axis[: 2 * h] = 1 + torch.arange(2 * h) % 2
        self.column_axis = torch.cat([axis, axis]).to(self.column_axis.device)


class ModalityRows:
    """Which of a step's rows run the vision experts: set by the text model around its layers, read by each
    `ErnieVLMoE`. A row is a vision row when it is inside the prompt of a request with images or videos
    (`AttentionMetadata.mm_prompt_rows`, which the multimodal runner sets) and its token one of ``token_ids``: so
    generated tokens run the text experts, as transformers' ``generate`` routes them. None: every row is text."""

    def __init__(self) -> None:
        self.token_ids: torch.Tensor | None = None
        self.split: tuple[torch.Tensor, torch.Tensor] | None = None
        """The step's (text rows, vision rows) indices, found once a step (the layers read them without a sync);
        None: every row is text."""

    @contextlib.contextmanager
    def routing(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> Iterator[None]:
        prompt_rows = getattr(metadata, "mm_prompt_rows", None)
        self.split = None
        if prompt_rows is not None and self.token_ids is not None:
            if self.token_ids.device != input_ids.device:  # moved once, on the first step with images
                self.token_ids = self.token_ids.to(input_ids.device)
            vision = torch.isin(input_ids, self.token_ids) & prompt_rows[: input_ids.shape[0]]
            vision_rows = vision.nonzero().squeeze(1)
            if vision_rows.numel():
                self.split = ((~vision).nonzero().squeeze(1), vision_rows)
        try:
            yield
        finally:
            self.split = None


class ErnieVLMoE(nn.Module):
    """A layer's text experts (``text``), vision experts (``vision``; each ERNIE's router and score correction:
    `ErnieMoE`) and the shared experts every row adds."""

    def __init__(self, b: DecoderBuild, text: MoESpec, vision: MoESpec, shared_size: int) -> None:
        super().__init__()
        self.text = ErnieMoE(text, b)
        self.vision = ErnieMoE(vision, b)
        self.shared_experts = LlamaMLP(b, shared_size) if shared_size else None
        self.rows: ModalityRows | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = None if self.rows is None else self.rows.split
        if split is None:
            out = self.text(x)
        else:
            out = torch.empty_like(x)
            for experts, rows in zip((self.text, self.vision), split):
                if rows.numel():
                    out.index_copy_(0, rows, experts(x.index_select(0, rows)))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class ErnieVLTextModel(Qwen2VLTextModel):
    """The decoder stack; the step's vision rows route to the vision experts (`ModalityRows`)."""

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        self.rows = ModalityRows()
        for layer in self.layers:
            if isinstance(getattr(layer, "mlp", None), ErnieVLMoE):
                layer.mlp.rows = self.rows

    def step_scope(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> ContextManager[None]:
        """The step's vision rows set for the layers (a pipeline stage's too)."""
        return self.rows.routing(input_ids, metadata)


def _spec(hf_config: Any, modality: int) -> MoESpec:
    sizes = hf_config.moe_intermediate_size
    return MoESpec(int(hf_config.moe_num_experts), int(hf_config.moe_k), int(sizes[modality]), renormalize=True,
                   weights_in_model_dtype=True)


def _full(weight: LoadedWeight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight[:]


def modality_weights(weights: Iterable[tuple[str, LoadedWeight]], num_experts: int) -> Iterator[tuple[str, LoadedWeight]]:
    """The checkpoint's MoE tensors under our modules' names (``mlp.text.*``, ``mlp.vision.*``): routers transposed
    to ``[E, hidden]``, the score corrections' rows apart, experts ``E ..`` the vision ones; the rest as given."""
    routers = {"gate.weight": "text", "gate.weight_1": "vision"}
    for name, weight in weights:
        prefix, _, rest = name.partition(".mlp.")
        if rest in routers:
            yield f"{prefix}.mlp.{routers[rest]}.gate.weight", _full(weight).t()
        elif rest == "moe_statics.e_score_correction_bias":
            both = _full(weight)
            yield f"{prefix}.mlp.text.{rest}", both[0:1]
            yield f"{prefix}.mlp.vision.{rest}", both[1:2]
        elif rest.startswith("experts."):
            _, expert, part = rest.split(".", 2)
            kind = "text" if int(expert) < num_experts else "vision"
            yield f"{prefix}.mlp.{kind}.experts.{int(expert) % num_experts}.{part}", weight
        else:
            yield name, weight


class ErnieVLLanguageModel(Ernie4_5_MoeForCausalLM):
    """ERNIE 4.5's layers: dense or modality-split experts by ``mlp_layer_types``; ERNIE's M-RoPE."""

    model_cls = ErnieVLTextModel
    lora_experts = False

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        """The text experts of layer ``layer_idx`` (None: a dense layer); the vision experts are `_spec`'s."""
        return _spec(hf_config, 0) if hf_config.mlp_layer_types[layer_idx] == "sparse" else None

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        cfg = b.hf_config
        if cls.moe_spec(cfg, layer_idx) is None:
            return LlamaMLP(b)
        shared = int(cfg.moe_intermediate_size[0]) * int(cfg.moe_num_shared_experts or 0)
        return ErnieVLMoE(b, _spec(cfg, 0), _spec(cfg, 1), shared)

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        return dataclasses.replace(build, rotary_emb=ErnieMRotaryEmbedding(hf_config, head_dim_of(hf_config),
                                                                           max_position))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        self.num_experts = int(hf_config.moe_num_experts)
        super().__init__(hf_config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(modality_weights(weights, self.num_experts))


def normalize_ernie_vl_name(name: str) -> str:
    """The checkpoint's names -> ours: ``visual.*``, ``resampler_model.*``, ``language_model.*``."""
    for theirs, ours in (("model.vision_model.", "visual."), ("model.resampler_model.", "resampler_model.")):
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return "language_model." + name if name.startswith(("model.", "lm_head.")) else name


def ernie_mrope_positions(prompt_len: int, items: Sequence[tuple[int, int, Sequence[int]]],
                          merge: int) -> tuple[np.ndarray, int]:
    """transformers' ``get_rope_index`` for items ``(offset, length, (t, h, w))`` (in patches; an image's ``t`` is
    1, a video's its even frame count): an item's placeholders at the text position before it plus (frame pair,
    row, column), the text resuming ``max(rows, columns)`` past that position, however many frame pairs a video
    has. Later tokens are at ``index + delta``, one past the prompt's last position as transformers' ``generate``
    continues (not past the table's maximum: a video's time axis may reach further than the text after it)."""
    table = np.empty((3, prompt_len), dtype=np.int64)
    cursor = position = 0
    for offset, length, (t, h, w) in items:
        table[:, cursor:offset] = position + np.arange(offset - cursor)
        position += offset - cursor
        grid = (-(-t // 2), h // merge, w // merge)
        if math.prod(grid) != length:
            raise ValueError(f"an item of grid {(t, h, w)} has {length} placeholder tokens, not {math.prod(grid)}")
        table[:, offset : offset + length] = np.indices(grid).reshape(3, -1) + position
        position += max(grid[1:])
        cursor = offset + length
    table[:, cursor:] = position + np.arange(prompt_len - cursor)
    return table, int(table[:, -1].max()) + 1 - prompt_len if prompt_len else 0


class Ernie4_5_VLMoeForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Image features (tower, then resampler) replace the ``<|IMAGE_PLACEHOLDER|>`` embeddings; positions are
    M-RoPE's; image and video rows and their markers run the vision experts."""

    mm_string_placeholder = False
    """A "string" chat's media parts are refused: vLLM's placeholder text differs from the marker token
    (`MultiModalProcessor.placeholder_text`)."""

    is_moe = True
    tower_cls = ErnieVisionTower
    language_model_cls = ErnieVLLanguageModel
    mm_video_processing = ErnieVideoProcessing
    """Frames stamped with their time, patched one frame deep (asyncllm/mm/ernie_video.py)."""
    mm_routes_prompt_rows = True
    """The multimodal runner marks the step's prompt rows of requests with images or videos (`ModalityRows`)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(hf_config, dtype=dtype, **kwargs)
        self.resampler_model = ErnieResampler(hf_config, dtype)
        ids = [int(getattr(hf_config, name)) for name in _VISION_MARKERS if getattr(hf_config, name, None) is not None]
        self.language_model.model.rows.token_ids = torch.tensor(ids)

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        """Layer ``layer_idx``'s text experts (``hf_config``: the text config, as the registry's checks pass it)."""
        return ErnieVLLanguageModel.moe_spec(hf_config, layer_idx)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """Placeholders of an image (``t`` 1) or a video (``t`` frames, even): one per 2 x 2 patches of a frame
        pair (an image's one frame is paired with itself)."""
        t, h, w = pixel_shape[:3]
        return -(-t // 2) * h * w // hf_config.vision_config.spatial_merge_size ** 2

    @classmethod
    def mm_video_pieces(cls, hf_config: Any, tokenizer: Any, video: Video,
                        grid: tuple[int, int, int]) -> list[VideoPiece]:
        """A video's ``<|VIDEO_PLACEHOLDER|>`` becomes one run of placeholders (no timestamp text: its frames carry
        their times drawn on them)."""
        return [VideoPiece([], slice(0, grid[0]), [])]

    def mrope_positions(self, prompt_len: int, items: list[Any]) -> tuple[np.ndarray, int]:
        """The prompt's M-RoPE positions and later tokens' delta (`ernie_mrope_positions`)."""
        return ernie_mrope_positions(prompt_len, [(item.offset, item.length, tuple(item.shape[:3])) for item in items],
                                     self.merge)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, t, h, w, features]`` images of one grid -> ``[N, t * h * w / 4, text hidden]``."""
        n, t, h, w, features = pixel_values.shape
        grid = [(t, h, w)] * n
        out = self.resampler_model(self.visual(pixel_values.reshape(n * t * h * w, features), grid), grid)
        return out.view(n, -1, out.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return load_vision_language_weights(self, weights, normalize_ernie_vl_name, "ERNIE 4.5 VL")
