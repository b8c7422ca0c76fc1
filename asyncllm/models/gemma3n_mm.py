"""Gemma 3n with audio (``Gemma3nForConditionalGeneration``: gemma-3n-E2B / E4B and their -it): its audio tower and
embedder (gemma3n_audio.py) before the Gemma 3n decoder (gemma3n.py). Images are not built: the vision tower is
MobileNetV5, which transformers builds with timm; an image (or an image limit) is a `NotBuiltError` naming it.

An audio token (``<audio_soft_token>``) becomes ``"\\n\\n<start_of_audio>"``, ``audio_soft_tokens_per_image``
(188) audio tokens (one item), ``"<end_of_audio>\\n\\n"``, as transformers' ``Gemma3nProcessor`` writes it (newline
tokens meeting the prompt's merge as Gemma 3's do). The count is fixed: the feature extractor cuts an audio at 30 s
(188 rows); the rows of a shorter one past its last real row, and those its mask drops, are the audio embedder's
last token's embedding (transformers' padding). An audio item is ``[1, frames, mel + 1]`` (the log-mel frames, their
mask last); the tower reads every frame, padding included, as transformers does for one audio.

Token ids in the towers' ranges (``vision_config.vocab_offset`` .. ``audio_config.vocab_offset``: the image tokens and
``<end_of_image>``; from ``audio_config.vocab_offset``: ``<end_of_audio>`` and the audio tokens) are embedded by
``embed_vision`` / ``embed_audio`` from their own tables, not by the decoder's (`embed_special`, in every step and on
a pipeline's first stage). Each row's per-layer input is its token's (ids past ``vocab_size_per_layer_input``, the
audio tokens among them, take id 0's) plus the projection of its embedding (an audio row's: its features), as in
transformers.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.gemma3_mm import newline_merges
from asyncllm.models.gemma3n import Gemma3nForCausalLM
from asyncllm.models.gemma3n_audio import Gemma3nAudioTower, Gemma3nMultimodalEmbedder, gemma3n_audio_name
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.pipeline import PipelineStage
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["Gemma3nForConditionalGeneration"]

_DECODERS = {"gemma3n_text": Gemma3nForCausalLM}
IMAGES_NOT_BUILT = "Gemma 3n's vision tower (MobileNetV5, which transformers builds with timm)"


def _name(raw: str) -> str:
    """transformers 5's layout, the audio tower's layers under the conformer's names (`gemma3n_audio_name`)."""
    name = normalize_llava_name(raw)
    if name.startswith("audio_tower."):
        return "audio_tower." + gemma3n_audio_name(name.removeprefix("audio_tower."))
    return name


class Gemma3nForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Audio features replace the audio tokens' embeddings; the rest is the Gemma 3n decoder (which takes LoRA
    adapters: `DecoderLoRA`)."""

    supports_encoder_data_parallel = True
    """The tower and embedders are whole on every rank in either mode, so "data" splits a step's audios."""
    decoder_classes = _DECODERS
    """By ``text_config.model_type``: what the KV cache's shapes follow (asyncllm/models/registry.py)."""
    mm_takes_images = False
    mm_not_built = {"image": IMAGES_NOT_BUILT}
    """An image limit above 0 is a `NotBuiltError`, an image fails its request, each naming the tower
    (asyncllm/mm/processor.py)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", expert_parallel: bool = False,
                 pipeline: PipelineStage | None = None) -> None:
        """``pipeline``: a stage's decoder part; the tower and embedders run on the first (the loader drops them
        from the others: `VisionLanguageModel.drop_encoder`)."""
        super().__init__()
        text_hidden = hf_config.text_config.hidden_size
        self.language_model = build_decoder(hf_config, _DECODERS, "Gemma 3n", mm_encoder_tp_mode, dtype=dtype, tp=tp,
                                            attn_backend=attn_backend, max_position=max_position,
                                            expert_parallel=expert_parallel, pipeline=pipeline)
        self.audio_tower = Gemma3nAudioTower(hf_config.audio_config, dtype)
        self.embed_audio = Gemma3nMultimodalEmbedder(hf_config.audio_config, text_hidden, dtype)
        self.embed_vision = Gemma3nMultimodalEmbedder(hf_config.vision_config, text_hidden, dtype)
        padding = int(hf_config.text_config.vocab_size) - 1  # transformers' audio padding token
        if not 0 <= padding - self.embed_audio.vocab_offset < self.embed_audio.vocab_size:
            raise ConfigError("audio_config.vocab_offset", self.embed_audio.vocab_offset,
                              f"the audio embedder's rows ending at the vocabulary's last id ({padding})")
        self.register_buffer("padding_id", torch.tensor([padding]), persistent=False)
        self.language_model.model.embed_special = self.embed_special
        self.hf_config = hf_config

    def embed_special(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``embeds`` with the rows of ids in the towers' token ranges from their embedders' own tables (computed for
        every row and selected, as transformers does: no data-dependent step)."""
        audio_from = self.embed_audio.vocab_offset
        ranges = ((self.embed_vision, (input_ids >= self.embed_vision.vocab_offset) & (input_ids < audio_from)),
                  (self.embed_audio, input_ids >= audio_from))
        for embedder, inside in ranges:
            rows = embedder.embed_ids(torch.where(inside, input_ids, embedder.vocab_offset))
            embeds = torch.where(inside[:, None], rows.to(embeds.dtype), embeds)
        return embeds

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_special(input_ids, self.language_model.embed_input_ids(input_ids))

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_audio_token_id(hf_config: Any) -> int:
        """The prompt token that marks an audio (``<audio_soft_token>``)."""
        return int(hf_config.audio_token_id)

    @staticmethod
    def mm_audio_text(hf_config: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
        """``"\\n\\n<start_of_audio>"`` before an audio's rows, ``"<end_of_audio>\\n\\n"`` after."""
        newlines = [int(t) for t in tokenizer.encode("\n\n", add_special_tokens=False)]
        return newlines + [int(hf_config.boa_token_id)], [int(hf_config.eoa_token_id)] + newlines

    @staticmethod
    def mm_token_merges(tokenizer: Any) -> dict[tuple[int, int], int]:
        return newline_merges(tokenizer)

    mm_audio_extractor_kwargs: dict[str, Any] = {}
    """The feature extractor's defaults, as ``Gemma3nProcessor`` calls it: the samples padded to a multiple of 128,
    cut at 30 s; a frame is real when its first sample is."""

    @staticmethod
    def mm_audio_windows(waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        return [waveform]

    @staticmethod
    def mm_audio_values(processed: Any) -> np.ndarray:
        """One audio's feature extractor output -> ``[1, frames, mel + 1]`` float32: its frames, their mask last
        (`InvalidRequestError` for an audio shorter than one 32 ms analysis frame)."""
        features = processed["input_features"].astype("float32", copy=False)
        mask = processed["input_features_mask"].astype("float32", copy=False)
        if mask.shape[-1] == 0:
            raise InvalidRequestError("audio", "too short: not one whole analysis frame (about 32 ms at 16 kHz)")
        return np.concatenate([features, mask[..., None]], axis=-1)

    @staticmethod
    def mm_placeholder_length_of(hf_config: Any, values: np.ndarray) -> int:
        """``audio_soft_tokens_per_image`` (`InvalidRequestError` for an audio whose rows would not fit: longer
        than the feature extractor's 30 s)."""
        count = int(hf_config.audio_soft_tokens_per_image)
        rows = _tower_rows(hf_config.audio_config, values.shape[1])
        if rows > count:
            raise InvalidRequestError("audio", f"too long: {rows} rows, over the model's {count} audio tokens")
        return count

    def embed_multimodal(self, values: torch.Tensor) -> torch.Tensor:
        """``[N, 1, frames, mel + 1]`` audios -> ``[N, audio_soft_tokens_per_image, text hidden]``."""
        rows, kept = self.audio_tower(values[:, 0, :, :-1], values[:, 0, :, -1] > 0.5)
        rows = self.embed_audio(rows)
        padding = self.embed_audio.embed_ids(self.padding_id).to(rows.dtype)  # [1, hidden]
        rows = torch.where(kept[..., None], rows, padding)
        extra = int(self.hf_config.audio_soft_tokens_per_image) - rows.shape[1]
        return torch.cat([rows, padding.expand(rows.shape[0], extra, -1)], dim=1)

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers 5's layout (``model.audio_tower.*``, ``model.embed_audio.*``, ``model.embed_vision.*``,
        ``model.language_model.*``); the vision tower's tensors are not read."""
        kept = ((name, w) for name, w in weights if not _name(name).startswith("vision_tower."))
        return load_vision_language_weights(self, kept, _name, "Gemma 3n")


def _tower_rows(cfg: Any, frames: int) -> int:
    """The rows the tower makes of ``frames``: two strided convolutions, then every ``conf_reduction_factor``-th."""
    for stride in cfg.sscp_conv_stride_size:  # padded by kernel - 1 frames after: ceil(frames / stride)
        frames = (frames - 1) // stride[0] + 1
    return (frames - 1) // int(cfg.conf_reduction_factor) + 1
