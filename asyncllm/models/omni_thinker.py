"""What the Qwen-Omni thinkers share (Qwen2.5-Omni's: asyncllm/models/qwen2_5_omni.py, Qwen3-Omni's: qwen3_omni.py):
their multimodal hooks, M-RoPE over images and videos only, and the full checkpoint's speech-out parts skipped.

A thinker takes images and videos (its Qwen-VL tower's) and audios (its own encoder's ``[1, mel + 1, frames]`` packed
log-mel frames and mask: Qwen2-Audio's `mm_audio_values`); it serves text only, as vLLM does. Audio placeholders are
positioned as text is (transformers' ``get_rope_index``); a video is one run of placeholders whose temporal patches
are ``position_id_per_seconds`` x their seconds apart in time. Speech out (``enable_audio_output``) is a
`NotBuiltError`; a video's own audio track (``use_audio_in_video``) is laid out as each thinker's transformers
processor does (its ``mm_audio_in_video``: Qwen2.5-Omni's time chunks, Qwen3-Omni's time order;
asyncllm/models/omni_interleave.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.mm.videos import Video
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.mrope import mrope_positions
from asyncllm.models.omni_interleave import interleaved_positions, video_times
from asyncllm.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from asyncllm.models.vision_language import text_config_of

__all__ = ["OmniThinker"]

_REFUSED_PROCESSOR_KWARGS = {
    "load_audio_from_video": "decoding a video file's audio track (pass the track as the video's audio with "
                             "use_audio_in_video)",
    **dict.fromkeys(("return_audio", "enable_audio_output", "speaker"), "Qwen-Omni's speech output (the thinker "
                                                                         "serves text)"),
}


def check_no_audio_output(hf_config: Any) -> None:
    """`NotBuiltError` for a thinker config asking for speech (``enable_audio_output``, set in ``hf_overrides``)."""
    if getattr(hf_config, "enable_audio_output", False):
        raise NotBuiltError("enable_audio_output", True, "Qwen-Omni's speech output (its talker and vocoder); the "
                                                         "thinker serves text")


class OmniThinker:
    """Mixin before a Qwen-VL model class: the audio hooks around its vision ones. A subclass sets ``speech_parts``
    and ``audio_tower_cls`` and gives `audio_placeholders` and `embed_audios`."""

    mm_string_placeholder = False
    """A "string" chat's media parts are refused: vLLM's placeholder text differs from the marker token
    (`MultiModalProcessor.placeholder_text`)."""

    speech_parts: tuple[str, ...] = ()
    """The full checkpoint's speech-out parts' weight prefixes, skipped unread."""
    audio_tower_cls: type[nn.Module]
    """The audio encoder, built from ``(audio_config, dtype)``; its rows are the decoder's width."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        """``kwargs``: the Qwen-VL model's (``dtype`` among them)."""
        check_no_audio_output(hf_config)
        super().__init__(hf_config, **kwargs)  # type: ignore[call-arg]
        self.hf_config = hf_config
        if hf_config.audio_config.output_dim != text_config_of(hf_config).hidden_size:
            raise ConfigError("audio_config.output_dim", hf_config.audio_config.output_dim, "the decoder's hidden_size")
        self.audio_tower = self.audio_tower_cls(hf_config.audio_config, kwargs["dtype"])

    # ---- multimodal hooks (asyncllm/mm/processor.py)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image."""
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_audio_token_id(hf_config: Any) -> int:
        """The prompt token that marks an audio."""
        return int(hf_config.audio_token_id)

    @staticmethod
    def mm_video_token_id(hf_config: Any) -> int:
        """The prompt token that marks a video."""
        return int(hf_config.video_token_id)

    @classmethod
    def mm_video_pieces(cls, hf_config: Any, tokenizer: Any, video: Video, grid: tuple[int, int, int]) -> list[VideoPiece]:
        """A video is one run of placeholders; its `time_interval` is the seconds a temporal patch (transformers'
        ``temporal_patch_size / fps``), which `_plain_positions` and asyncllm/models/omni_interleave.py turn into
        time positions as transformers does."""
        return [VideoPiece([], slice(0, grid[0]), [], hf_config.vision_config.temporal_patch_size / video.sampled_fps)]

    mm_audio_values = staticmethod(Qwen2AudioForConditionalGeneration.mm_audio_values)
    mm_own_processor_kwargs = ("use_audio_in_video",)
    """``mm_processor_kwargs`` the processor reads itself (asyncllm/mm/processor.py), not the image processor's; a
    subclass gives ``mm_audio_in_video`` (asyncllm/models/omni_interleave.py's layout of a video with its audio)."""
    refused_processor_kwargs = _REFUSED_PROCESSOR_KWARGS
    """``mm_processor_kwargs`` this thinker does not build: what each would ask for."""

    @classmethod
    def mm_check_processor_kwargs(cls, overrides: dict[str, Any]) -> None:
        """`NotBuiltError` for ``mm_processor_kwargs`` asking for what this thinker does not build."""
        for key, feature in cls.refused_processor_kwargs.items():
            if overrides.get(key):
                raise NotBuiltError(f"mm_processor_kwargs.{key}", overrides[key], feature)

    @classmethod
    def audio_placeholders(cls, hf_config: Any, frames: int) -> int:
        """Placeholders (encoder rows) of an audio of ``frames`` mel frames."""
        raise NotImplementedError

    @classmethod
    def mm_placeholder_length_of(cls, hf_config: Any, values: np.ndarray) -> int:
        """An image's ``(t, h, w, features)`` patches or an audio's ``[1, mel + 1, frames]`` -> its placeholders."""
        if values.ndim == 3:
            return cls.audio_placeholders(hf_config, int(values[0, -1].sum()))
        return cls.mm_placeholder_length(hf_config, values.shape)  # type: ignore[attr-defined]

    def mrope_positions(self, prompt_len: int, items: list[Any]) -> tuple[np.ndarray, int]:
        """M-RoPE's positions of the images and videos; an audio's placeholders count on as text does; a video with
        its audio as transformers' ``get_rope_index`` (asyncllm/models/omni_interleave.py)."""
        if not any(item.rows for item in items):
            return self._plain_positions(prompt_len, items)
        spec = self.mm_audio_in_video(self.hf_config)  # type: ignore[attr-defined]
        return interleaved_positions(prompt_len, items, spec, self._plain_positions)

    def _plain_positions(self, prompt_len: int, items: list[Any]) -> tuple[np.ndarray, int]:
        """M-RoPE's positions of the images and videos (``get_rope_index``: a video's temporal patch i at ``(i *
        seconds) * position_id_per_seconds`` in float32, truncated: `video_times`)."""
        per_second = self.hf_config.position_id_per_seconds
        images = [(item.offset, item.length, tuple(item.shape[:3]), item.time_interval) for item in items
                  if len(item.shape) == 4]
        return mrope_positions(prompt_len, images, self.merge,  # type: ignore[attr-defined]
                               lambda t, seconds: video_times(t, seconds, per_second))

    def embed_audios(self, features: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        """``[N, mel, frames]`` log-mel frames, each audio's true frames -> each audio's input rows."""
        raise NotImplementedError

    def embed_multimodal(self, values: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """``[N, t, h, w, features]`` images or videos -> their rows (the Qwen-VL model's); ``[N, 1, mel + 1,
        frames]`` audios -> each audio's ``[placeholders, width]`` rows (`embed_audios`)."""
        if values.ndim == 5:
            return super().embed_multimodal(values)  # type: ignore[misc]
        flat = values[:, 0]
        return self.embed_audios(flat[:, :-1], flat[:, -1].sum(-1).round().long().tolist())

    # ---- weights
    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        return super()._packed(ckpt_name.removeprefix("thinker."))  # type: ignore[misc]

    def thinker_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterable[tuple[str, LoadedWeight]]:
        """``weights`` but the speech-out parts' (either layout: ``thinker.*`` or bare)."""
        return ((name, weight) for name, weight in weights if not name.startswith(self.speech_parts))
