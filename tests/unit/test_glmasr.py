"""GLM-ASR's placeholder count and windows (asyncllm/models/glmasr.py) against transformers' ``GlmAsrProcessor``."""

from __future__ import annotations

import numpy as np

from asyncllm.models.glmasr import GlmAsrForConditionalGeneration, glmasr_output_length

SAMPLING_RATE = 16_000


def test_placeholders_equal_the_processors_count() -> None:
    """Per window (what the encoder gives) they add up to transformers' count over the audio's summed frames, for
    audios of one, two and more windows and windows too short for a row."""
    import torch
    from transformers import GlmAsrProcessor

    count = GlmAsrProcessor._get_audio_token_length
    for frames in ([3000, 3000, 7], [3000, 101], [5], [1], [3000], [2999], [130]):
        total = int(count(None, torch.tensor(sum(frames))))
        assert sum(glmasr_output_length(n) for n in frames) == total, frames
    windows = GlmAsrForConditionalGeneration.mm_audio_windows(np.zeros(SAMPLING_RATE * 700, np.float32), SAMPLING_RATE)
    assert len(windows) == 21  # GlmAsrProcessor's max_audio_len 655 s
