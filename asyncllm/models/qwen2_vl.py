"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a native-resolution vision tower and the Qwen2 / Qwen3 decoder with M-RoPE.

The decoder is `Qwen2ForCausalLM` (Qwen3-VL: `Qwen3ForCausalLM`) whose rotary
embedding is multimodal (asyncllm/models/mrope.py): a step whose tokens include an
image's placeholders, or follow one, gets ``[3, T]`` positions from the model runner
(workers/mm_runner.py, from `mrope_positions` here), every other step ``[T]``.
The vision tower (asyncllm/models/qwen_vision.py; Qwen3-VL's: qwen3_vision.py)
encodes each image at its own resolution: the HF image processor resizes it to a
multiple of 28 pixels (Qwen3-VL: 32) within its pixel bounds and cuts it into
14 x 14 patches (16 x 16), and every 2 x 2 patches become one placeholder token.
Qwen3-VL's tower also outputs deepstack features, which its decoder adds to the
first layers' outputs at the image's tokens (`Qwen3VLTextModel`). An image's item therefore
has the shape ``(t, h, w, patch_features)``: its grid rides in the shape, so
images of one grid batch together (asyncllm/mm/embeddings.py).

Checkpoints come in two layouts: the original one (``visual.*``,
``model.layers.*``, ``lm_head``) and transformers 5's (``model.visual.*``,
``model.language_model.*``); both load.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager, Iterable

import numpy as np
import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError
from asyncllm.mm.qwen_video import (
    QWEN3_VIDEO_SETTINGS,
    VideoPiece,
    VideoSettings,
    frame_timestamps,
)
from asyncllm.mm.videos import Video
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel, head_dim_of
from asyncllm.models.llama import DecoderBuild, LlamaModel
from asyncllm.models.mrope import MRopePositions, MRotaryEmbedding, mrope_positions
from asyncllm.models.qwen2 import Qwen2ForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.qwen3_vision import Qwen3VisionTower
from asyncllm.models.qwen_vision import QwenVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, load_vision_language_weights, text_config_of

__all__ = ["Qwen2VLForConditionalGeneration", "Qwen3VLForConditionalGeneration", "normalize_qwen2_vl_name"]


def normalize_qwen2_vl_name(name: str) -> str:
    """Either checkpoint layout -> ours: ``visual.*``, ``language_model.model.*``, ``language_model.lm_head.*``
    (and Qwen3.5's top-level ``mtp.*``, the decoder's, which leaves it unread: ``language_model.mtp.*``)."""
    name = name.removeprefix("model.") if name.startswith(("model.visual.", "model.language_model.")) else name
    if name.startswith("language_model."):
        return "language_model.model." + name.removeprefix("language_model.")
    if name.startswith(("model.", "lm_head.", "mtp.")):
        return "language_model." + name
    return name


class Qwen2VLTextModel(MRopePositions, LlamaModel):
    """The decoder stack; ``[3, T]`` positions rotate by their M-RoPE table for the step."""

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        self.rotary_emb = b.rotary_emb

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with self.layer_positions(positions) as flat, self.step_scope(input_ids, metadata):
            return self.decode(input_ids, flat, kv_caches, metadata, inputs_embeds)

    def step_scope(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> ContextManager[None]:
        """What holds around a step's layers beside its positions (ERNIE 4.5 VL's rows by modality); a pipeline
        stage enters it around its own layers (asyncllm/models/pipeline.py)."""
        return contextlib.nullcontext()

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
               metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """The layers at ``[T]`` positions (a step's own table's rows when M-RoPE's are rotating)."""
        return super().forward(input_ids, positions, kv_caches, metadata, inputs_embeds)


class Qwen3VLTextModel(Qwen2VLTextModel):
    """Qwen3-VL's decoder stack: deepstack features join the residual stream after the first layers.

    A step with images gets ``inputs_embeds`` ``[T, hidden * (1 + k)]`` (`Qwen3VLForConditionalGeneration.
    embed_input_ids`): the embeddings, then k deepstack rows (zeros where no image is). After layer i < k the
    stream is summed as transformers does (``residual + output``, then ``+ deepstack[i]``), so the next layer
    starts from it unfused. A pipeline's first stage does the same over its layers (asyncllm/models/pipeline.py).
    """

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        self.hidden_size = int(b.hf_config.hidden_size)

    def split_deepstack(self, inputs_embeds: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A step's input rows as (the embeddings, the deepstack rows ``[T, k, hidden]``); no deepstack rows
        without images."""
        width = self.hidden_size
        if inputs_embeds is None or inputs_embeds.shape[-1] == width:
            return inputs_embeds, None
        return inputs_embeds[:, :width], inputs_embeds[:, width:].unflatten(-1, (-1, width))

    @staticmethod
    def add_deepstack(index: int, hidden: torch.Tensor, residual: torch.Tensor,
                      deepstack: torch.Tensor) -> tuple[torch.Tensor, None]:
        """After layer ``index`` < k: the stream joined (``residual + output``), plus that layer's deepstack row."""
        return residual + hidden + deepstack[:, index], None

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
               metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        embeds, deepstack = self.split_deepstack(inputs_embeds)
        if deepstack is None:
            return super().decode(input_ids, positions, kv_caches, metadata, inputs_embeds)
        hidden, residual = embeds, None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if self.aux_layers:  # an EAGLE-3 head's inputs (workers/eagle_runner.py)
                self.keep_aux(index, hidden, residual)
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
            if index < deepstack.shape[1]:
                hidden, residual = self.add_deepstack(index, hidden, residual, deepstack)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class _MRopeBuild:
    """The decoder's rotary embedding is M-RoPE's (interleaved for Qwen3-VL)."""

    interleaved_mrope = False
    default_mrope_section: tuple[int, ...] = ()

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        """The decoder's build with M-RoPE (an instance method, so it composes with the hybrids' build)."""
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position,  # type: ignore[misc]
                                      expert_parallel)
        rotary = MRotaryEmbedding(hf_config, head_dim_of(hf_config), max_position, self.interleaved_mrope,
                                  self.default_mrope_section)
        return dataclasses.replace(build, rotary_emb=rotary)


class Qwen2VLLanguageModel(_MRopeBuild, Qwen2ForCausalLM):
    model_cls = Qwen2VLTextModel
    default_mrope_section = (16, 24, 24)


class Qwen3VLLanguageModel(_MRopeBuild, Qwen3ForCausalLM):
    model_cls = Qwen3VLTextModel
    interleaved_mrope = True
    default_mrope_section = (24, 20, 20)


class Qwen2VLForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features replace the ``<|image_pad|>`` placeholder embeddings; positions are M-RoPE's."""

    supports_encoder_data_parallel = True
    tower_cls: type[nn.Module] = QwenVisionTower
    language_model_cls: type[Qwen2ForCausalLM] = Qwen2VLLanguageModel
    normalize_name = staticmethod(normalize_qwen2_vl_name)
    """`_packed` reads a checkpoint's names (either layout) as well as an adapter's decoder names."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        """``decoder_options``: the decoder's own (an MoE decoder's ``expert_parallel``)."""
        super().__init__()
        if mm_encoder_tp_mode not in ("weights", "data"):
            raise ConfigError("mm_encoder_tp_mode", mm_encoder_tp_mode, "'weights' or 'data'")
        self.encoder_tp = tp if mm_encoder_tp_mode == "weights" else TensorParallel()
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        self.visual = self.tower_cls(hf_config.vision_config, self.encoder_tp, dtype)  # checks the shards split
        self.language_model = self.language_model_cls(text_config_of(hf_config), dtype=dtype, tp=tp,
                                                      attn_backend=attn_backend, max_position=max_position,
                                                      **decoder_options)

    # ---- multimodal hooks (asyncllm/mm/, workers/mm_runner.py)
    mm_placeholder_around = {"image": ("vision_start_token_id", "vision_end_token_id"),
                             "video": ("vision_start_token_id", "vision_end_token_id")}
    """The config's tokens around a medium's marker in a "string" chat (`MultiModalProcessor.placeholder_text`)."""

    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image (``<|image_pad|>``)."""
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's processor output -> ``(t, h, w, patch_features)`` float32 (the grid in the shape)."""
        t, h, w = (int(n) for n in processed["image_grid_thw"][0])
        return processed["pixel_values"].astype("float32", copy=False).reshape(t, h, w, -1)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """Placeholder tokens of an image of ``(t, h, w, features)`` patches: one per merged 2 x 2 patches."""
        t, h, w = pixel_shape[:3]
        return t * h * w // hf_config.vision_config.spatial_merge_size ** 2

    video_settings = VideoSettings()
    """The video processor's defaults (asyncllm/mm/qwen_video.py; the checkpoint's config overrides them)."""

    @staticmethod
    def mm_video_token_id(hf_config: Any) -> int:
        """The prompt token that marks a video (``<|video_pad|>``)."""
        return int(hf_config.video_token_id)

    @classmethod
    def mm_video_pieces(cls, hf_config: Any, tokenizer: Any, video: Video, grid: tuple[int, int, int]) -> list[VideoPiece]:
        """A video is one run of placeholders; Qwen2.5-VL spaces its temporal patches ``tokens_per_second`` x
        their seconds apart on the time axis (float32, as transformers), Qwen2-VL one apart."""
        per_second = getattr(hf_config.vision_config, "tokens_per_second", None)
        interval = 1.0
        if per_second is not None:
            seconds = np.float32(hf_config.vision_config.temporal_patch_size / video.sampled_fps)
            interval = float(np.float32(per_second) * seconds)
        return [VideoPiece([], slice(0, grid[0]), [], interval)]

    def mrope_positions(self, prompt_len: int, items: list[Any]) -> tuple[np.ndarray, int]:
        """The prompt's ``[3, prompt_len]`` M-RoPE positions and the delta of every later token (mrope.py)."""
        images = [(item.offset, item.length, tuple(item.shape[:3]), item.time_interval) for item in items]
        return mrope_positions(prompt_len, images, self.merge)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, t, h, w, features]`` images of one grid -> ``[N, t * h * w / 4, text hidden]``."""
        n, t, h, w, features = pixel_values.shape
        grid = [(t, h, w)] * n
        out = self.visual(pixel_values.reshape(n * t * h * w, features), grid)
        return out.view(n, -1, out.shape[-1])

    # ---- weights
    @staticmethod
    def checkpoint_module_name(name: str) -> str:
        """Our module name -> the original checkpoint layout's (Qwen2-VL's and Qwen2.5-VL's checkpoints use it, so a
        quantization_config's names are those)."""
        return name.removeprefix("language_model.")

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Route the decoder's weights to its loader; the vision tower's parameters keep their shard."""
        return load_vision_language_weights(self, weights, normalize_qwen2_vl_name, "Qwen2-VL")

    def unread_weight(self, name: str) -> bool:
        """Whether the decoder's loader leaves a checkpoint tensor unread (Qwen3.5's ``mtp.*``; a pushed one is
        refused): the decoder's own `unread_weight`, over its name."""
        ours = normalize_qwen2_vl_name(name)
        text, unread = ours.removeprefix("language_model."), getattr(self.language_model, "unread_weight", None)
        return text != ours and unread is not None and unread(text)


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL: its tower (learned position embeddings, deepstack mergers), the Qwen3 decoder with interleaved
    M-RoPE, and the deepstack features added to the first layers' outputs at the image's tokens."""

    tower_cls = Qwen3VisionTower
    language_model_cls = Qwen3VLLanguageModel

    @staticmethod
    def checkpoint_module_name(name: str) -> str:
        """Our module name -> transformers 5's layout, the one Qwen3-VL checkpoints are saved in."""
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        return name.removeprefix("language_model.") if name.startswith("language_model.") else "model." + name

    video_settings = QWEN3_VIDEO_SETTINGS

    @classmethod
    def mm_video_pieces(cls, hf_config: Any, tokenizer: Any, video: Video, grid: tuple[int, int, int]) -> list[VideoPiece]:
        """One run per temporal patch, as transformers' processor writes it: ``<{seconds:.1f} seconds>``, vision
        start, the patch's placeholders, vision end; each is positioned as an image of one frame."""
        start, end = int(hf_config.vision_start_token_id), int(hf_config.vision_end_token_id)
        times = frame_timestamps(video, hf_config.vision_config.temporal_patch_size)
        return [VideoPiece(tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False) + [start],
                           slice(i, i + 1), [end]) for i, seconds in enumerate(times[: grid[0]])]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A step's input rows when images are in it: the token embeddings, then zeros where each image token's
        deepstack features go (the encoder's rows are as wide: ``embed_multimodal``)."""
        embeds = self.language_model.embed_input_ids(input_ids)
        return torch.cat([embeds, embeds.new_zeros(embeds.shape[0], embeds.shape[1] * self.visual.num_deepstack)], -1)
