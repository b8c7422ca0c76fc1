"""Qwen3-Omni's thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``, and ``Qwen3OmniMoeForConditionalGeneration``:
Qwen/Qwen3-Omni-30B-A3B-Instruct, -Thinking, -Captioner): text out only, as vLLM serves it.

The thinker is Qwen3-VL's vision tower with deepstack (asyncllm/models/qwen3_vision.py; its mergers saved as
``ln_q`` / ``mlp.0`` / ``mlp.2`` and the deepstack ones as ``merger_list``), the Qwen3-MoE decoder with interleaved
M-RoPE (asyncllm/models/qwen3_vl_moe.py; its router renormalizes the top-k weights only with ``norm_topk_prob``) and
Qwen3-ASR's audio encoder (asyncllm/models/qwen3_asr.py) ending in ``proj2(act(proj1(x)))`` to the decoder's width.
The full checkpoint's talker and code2wav (speech out) are not built: their weights (``talker.*``, ``code2wav.*``) are
skipped unread, the thinker's (``thinker.*``) served, and its config is the ``thinker_config``
(asyncllm/models/family_config.py's `omni_thinker_config`). The hooks shared with Qwen2.5-Omni's thinker (speech out
refused, audio positioned as text, videos as one run of placeholders) are asyncllm/models/omni_thinker.py's. With
``mm_processor_kwargs={"use_audio_in_video": True}`` each video takes the next audio of the prompt (its track), merged
with its frames token by token in time order as transformers' processor lays them (not Qwen2.5-Omni's chunks:
asyncllm/models/omni_interleave.py's `TimeOrderedAudioInVideo`), by the config's ``position_id_per_seconds`` (13 in
the release, as transformers' processor's own).

The host reads each audio whole (transformers' ``Qwen3OmniMoeProcessor``: the checkpoint's ``WhisperFeatureExtractor``,
no 30 s cut, no padding). The encoder cuts an audio's frames into chunks of ``2 * n_window`` (1 s; the last shorter,
zero-padded to a whole chunk when the audio has one), convolves each chunk alone, keeps the rows of its true frames
and attends within windows of ``n_window_infer`` frames' rows: ``13 * (L // 100) + rows(L % 100)`` placeholders of
``L`` frames. transformers pads every chunk of one call to the call's longest, so a shorter-than-a-chunk audio beside
a longer one in its prompt differs there; here each audio is encoded as if alone (its rows are cached by its hash, so
they must not depend on the audios beside it). ``conv_chunksize`` only bounds transformers' memory; not read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.mm.qwen_video import VideoSettings
from asyncllm.models.clip import activation
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.moe import MoESpec
from asyncllm.models.omni_interleave import TimeOrderedAudioInVideo
from asyncllm.models.omni_thinker import OmniThinker
from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration, normalize_qwen2_vl_name
from asyncllm.models.qwen3_asr import Qwen3ASREncoder, kept_rows, qwen3_asr_output_length
from asyncllm.models.qwen3_moe import Qwen3MoeForCausalLM
from asyncllm.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeLanguageModel
from asyncllm.models.vision_language import load_vision_language_weights

__all__ = ["Qwen3OmniAudioEncoder", "Qwen3OmniMoeThinkerForConditionalGeneration"]

_MERGER = re.compile(r"^visual\.(merger|merger_list\.\d+)\.(ln_q|mlp\.0|mlp\.2)\.")
_MERGER_PARTS = {"ln_q": "norm", "mlp.0": "linear_fc1", "mlp.2": "linear_fc2"}


class Qwen3OmniAudioEncoder(Qwen3ASREncoder):
    """Log-mel frames ``[B, mel, frames]`` and each audio's true frames -> each audio's ``[rows, output_dim]``
    (transformers' ``Qwen3OmniMoeAudioEncoder``)."""

    positions_field = "max_source_positions"

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model, dtype=dtype)
        self.act = activation(cfg.activation_function, "audio_config.activation_function")
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim, dtype=dtype)

    def _audio_rows(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        """One audio's ``[mel, frames]`` true frames -> its convolved rows: chunks of ``2 * n_window`` frames (a
        shorter audio is one chunk of its own length), the last zero-padded."""
        chunk = min(2 * self.n_window, frames)
        padded = F.pad(features[:, :frames], (0, -frames % chunk))
        return kept_rows(self._chunk_rows(padded[None], chunk), [frames], chunk)

    def forward(self, features: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        packed = torch.cat([self._audio_rows(f, n) for f, n in zip(features, frames)])
        rows = self._attend(packed, [qwen3_asr_output_length(n, self.n_window) for n in frames])
        return [self.proj2(self.act(self.proj1(x))) for x in rows]


class Qwen3OmniMoeLanguageModel(Qwen3VLMoeLanguageModel):
    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        """Qwen3-MoE's: the top-k weights renormalized only with ``norm_topk_prob`` (unlike Qwen3-VL-MoE's)."""
        return Qwen3MoeForCausalLM.moe_spec(hf_config, layer_idx)


def normalize_omni3_name(name: str) -> str:
    """Any Qwen3-Omni checkpoint layout -> ours (``audio_tower.*``, ``visual.*``, ``language_model.*``)."""
    name = name.removeprefix("thinker.")
    if name.startswith("model.audio_tower."):
        return name.removeprefix("model.")
    name = normalize_qwen2_vl_name(name)
    match = _MERGER.match(name)
    if match is None:
        return name
    merger = match.group(1).replace("merger_list", "deepstack_merger_list")
    return f"visual.{merger}.{_MERGER_PARTS[match.group(2)]}.{name[match.end():]}"


class Qwen3OmniMoeThinkerForConditionalGeneration(OmniThinker, Qwen3VLMoeForConditionalGeneration):
    """Image and video features (with their deepstack rows) replace ``<|image_pad|>`` and ``<|video_pad|>``
    placeholders, audio rows ``<|audio_pad|>`` ones; positions are M-RoPE's."""

    language_model_cls = Qwen3OmniMoeLanguageModel
    speech_parts = ("talker.", "code2wav.")
    audio_tower_cls = Qwen3OmniAudioEncoder
    video_settings = dataclasses.replace(VideoSettings(), min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32)
    """``Qwen2VLVideoProcessor``'s defaults (each frame's pixels bounded, not all the frames' as Qwen3-VL's) under
    ``Qwen3OmniMoeProcessor``'s bounds; the checkpoint's config overrides them."""
    checkpoint_module_name = staticmethod(Qwen2VLForConditionalGeneration.checkpoint_module_name)
    """The released checkpoints' layout is the original one (``model.layers.*``, ``visual.*``)."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        """Layer ``layer_idx``'s MoE (``hf_config``: the text config, as the registry's checks pass it)."""
        return Qwen3OmniMoeLanguageModel.moe_spec(hf_config, layer_idx)

    # ---- audio (asyncllm/models/omni_thinker.py's hooks)
    mm_audio_in_video = staticmethod(TimeOrderedAudioInVideo.of)

    @property
    def mm_piece_audio_window(self) -> int:
        """The audio encoder's ``n_window``, by which the core checks an audio piece's whole rows
        (asyncllm/mm/cache.py's ``piece_audio_window``)."""
        return int(self.hf_config.audio_config.n_window)

    mm_audio_extractor_kwargs = {"padding": True, "truncation": False, "return_attention_mask": True}
    """How transformers' ``Qwen3OmniMoeProcessor`` calls the feature extractor: the whole audio, unpadded."""

    @staticmethod
    def mm_audio_windows(waveform: Any, rate: int) -> list[Any]:
        """The whole audio (the encoder chunks it itself)."""
        return [waveform]

    @classmethod
    def audio_placeholders(cls, hf_config: Any, frames: int) -> int:
        return qwen3_asr_output_length(frames, hf_config.audio_config.n_window)

    def embed_audios(self, features: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        """Each audio's rows, zeros in their deepstack columns (deepstack is the images' and videos' only)."""
        rows = self.audio_tower(features.to(self.audio_tower.conv_out.weight.dtype), frames)
        deepstack = self.visual.num_deepstack
        return [torch.cat([x, x.new_zeros(x.shape[0], x.shape[1] * deepstack)], -1) for x in rows]

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The thinker's weights (either layout, ``thinker.`` or not; experts per expert or fused); the talker's and
        code2wav's skipped unread."""
        return load_vision_language_weights(self, self.thinker_weights(weights), normalize_omni3_name, "Qwen3-Omni")
