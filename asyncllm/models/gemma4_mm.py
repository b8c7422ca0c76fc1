"""Gemma 4 with images and audio (``Gemma4ForConditionalGeneration``): Gemma 4's vision tower and embedder
(gemma4_vision.py) and, in the checkpoints that have one (E2B, E4B), its audio tower and embedder (gemma4_audio.py)
before the Gemma 4 decoder (gemma4.py). Video is not built (refused as for any model without videos).

An image keeps its aspect ratio: the checkpoint's image processor resizes it to at most ``max_soft_tokens`` pooled
cells, so its row count varies (``P / k^2`` for ``P`` patches). In the prompt each image token becomes
``<|image>``, that many image tokens (one item), ``<image|>``, as transformers' ``Gemma4Processor`` writes it. With
``use_bidirectional_attention="vision"`` an image's rows attend to each other both ways in the sliding layers (the
global layers stay causal, as transformers builds its masks): the items say so, the scheduler never cuts a prefill
inside one, and only the sliding layers take the step's ``attend_limit`` (gemma4.py). Each image row's per-layer
input is the pad token's (its projection part from the image features), as in transformers.

An audio token becomes ``<|audio>``, one audio token per real frame the tower keeps, ``<audio|>`` (its rows causal,
as transformers marks only vision both ways). An audio item is ``[1, frames, mel + 1]`` (the log-mel frames, their
mask last), an image's ``[P, 3 p^2 + 2]``: `embed_multimodal` tells a batch's kind by its rank.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import InvalidRequestError
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.gemma4 import Gemma4ForCausalLM
from asyncllm.models.gemma4_audio import Gemma4AudioTower, audio_rows
from asyncllm.models.gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionTower
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.moe import MoESpec
from asyncllm.models.pipeline import PipelineStage
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["Gemma4ForConditionalGeneration"]

_DECODERS = {"gemma4_text": Gemma4ForCausalLM}


class Gemma4ForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features replace the image tokens' embeddings; the rest is the Gemma 4 decoder."""

    supports_encoder_data_parallel = True
    """The tower and embedder are whole on every rank in either mode, so "data" splits a step's images."""
    decoder_classes = _DECODERS
    """By ``text_config.model_type``: what the KV cache's shapes follow (asyncllm/models/registry.py)."""
    is_moe = True
    """26B-A4B's decoder has experts (the others none: `moe_spec` says per layer)."""

    @staticmethod
    def moe_spec(hf_config: Any, layer_idx: int) -> MoESpec | None:
        return Gemma4ForCausalLM.moe_spec(hf_config, layer_idx)

    @staticmethod
    def mm_bidirectional(hf_config: Any) -> bool:
        """Whether an image's rows attend to each other both ways (``use_bidirectional_attention="vision"``)."""
        return getattr(hf_config.text_config, "use_bidirectional_attention", None) == "vision"

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", expert_parallel: bool = False,
                 pipeline: PipelineStage | None = None) -> None:
        """``pipeline``: a stage's decoder part; the tower and embedder run on the first (the loader drops them
        from the others: `VisionLanguageModel.drop_encoder`)."""
        super().__init__()
        self.language_model = build_decoder(hf_config, _DECODERS, "Gemma 4", mm_encoder_tp_mode, dtype=dtype, tp=tp,
                                            attn_backend=attn_backend, max_position=max_position,
                                            expert_parallel=expert_parallel, pipeline=pipeline)
        self.vision_tower = Gemma4VisionTower(hf_config.vision_config, dtype)
        self.embed_vision = Gemma4MultimodalEmbedder(hf_config.vision_config, hf_config.text_config.hidden_size, dtype)
        if getattr(hf_config, "audio_config", None) is not None:
            self.audio_tower = Gemma4AudioTower(hf_config.audio_config, dtype)
            self.embed_audio = Gemma4MultimodalEmbedder(hf_config.audio_config, hf_config.text_config.hidden_size, dtype)
        soft = [hf_config.image_token_id] + [getattr(hf_config, f"{kind}_token_id", None) for kind in ("video", "audio")]
        self.language_model.model.soft_token_ids = torch.tensor([t for t in soft if t is not None])
        self.language_model.model.pad_token_id = int(hf_config.text_config.pad_token_id or 0)
        self.hf_config = hf_config

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image: the image token itself."""
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_image_text(hf_config: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
        """``<|image>`` before an image's rows, ``<image|>`` after."""
        return [int(hf_config.boi_token_id)], [int(hf_config.eoi_token_id)]

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's processor output -> its real patches ``[P, 3 p^2]`` (the padding rows dropped) with their
        (x, y) positions appended: ``[P, 3 p^2 + 2]`` float32."""
        pixels, positions = processed["pixel_values"][0], processed["image_position_ids"][0]
        real = (positions >= 0).all(axis=-1)
        return np.concatenate([pixels[real], positions[real]], axis=-1).astype("float32", copy=False)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        return int(pixel_shape[0]) // int(hf_config.vision_config.pooling_kernel_size) ** 2

    @staticmethod
    def mm_audio_token_id(hf_config: Any) -> int | None:
        """The prompt token that marks an audio (``<|audio|>``); None for a checkpoint without an audio tower."""
        return None if getattr(hf_config, "audio_config", None) is None else int(hf_config.audio_token_id)

    @staticmethod
    def mm_audio_text(hf_config: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
        """``<|audio>`` before an audio's rows, ``<audio|>`` after (the config's ``eoa_token_index``)."""
        end = getattr(hf_config, "eoa_token_id", None)
        return [int(hf_config.boa_token_id)], [int(end if end is not None else hf_config.eoa_token_index)]

    mm_audio_extractor_kwargs: dict[str, Any] = {}
    """The feature extractor's defaults, as ``Gemma4Processor`` calls it: the samples padded to a multiple of 128,
    cut at 30 s, and each frame's mask."""

    @staticmethod
    def mm_audio_windows(waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        return [waveform]

    @staticmethod
    def mm_audio_values(processed: Any) -> np.ndarray:
        """One audio's feature extractor output -> ``[1, frames, mel + 1]`` float32: its frames, their mask last
        (`InvalidRequestError` for an audio too short to make a row)."""
        features = processed["input_features"].astype("float32", copy=False)
        mask = processed["input_features_mask"].astype("float32", copy=False)
        if mask.shape[-1] == 0 or not mask[:, 0].all():
            raise InvalidRequestError("audio", "too short: not one whole analysis frame (about 10 ms at 16 kHz)")
        return np.concatenate([features, mask[..., None]], axis=-1)

    @classmethod
    def mm_placeholder_length_of(cls, hf_config: Any, values: np.ndarray) -> int:
        """An audio's rows (its real frames after two halvings) or an image's (its patches / k^2)."""
        if values.ndim == 3:
            return int(audio_rows(values[:, :, -1] > 0.5)[0])
        return cls.mm_placeholder_length(hf_config, values.shape)

    def embed_multimodal(self, values: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """``[N, P, 3 p^2 + 2]`` images of one size -> ``[N, P / k^2, text hidden]``; ``[N, 1, frames, mel + 1]``
        audios -> each audio's ``[rows, text hidden]`` (`audio_rows`)."""
        if values.ndim == 3:
            return self.embed_vision(self.vision_tower(values))
        features, mask = values[:, 0, :, :-1], values[:, 0, :, -1] > 0.5
        rows = self.embed_audio(self.audio_tower(features, mask))
        return [audio[:count] for audio, count in zip(rows, audio_rows(mask).tolist())]

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers 5's layout (``model.vision_tower.*``, ``model.embed_vision.*``, ``model.audio_tower.*``,
        ``model.embed_audio.*``, ``model.language_model.*``)."""
        return load_vision_language_weights(self, weights, normalize_llava_name, "Gemma 4")
