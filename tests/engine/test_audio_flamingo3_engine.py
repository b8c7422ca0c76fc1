"""Audio Flamingo 3 end to end (asyncllm/models/qwen2_audio.py, docs/multimodal.md#audio): an audio longer than the
encoder's 30 s runs as consecutive 30 s windows whose rows follow each other in its placeholders, as transformers'
processor and model do: prompt ids and greedy tokens equal transformers', beside a short audio in the same batch;
audio past 10 minutes is cut there."""

from __future__ import annotations

import asyncio

import numpy as np
from audio_utils import SAMPLING_RATE, hf_audio_greedy, make_audio, make_tiny_audio_flamingo3

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.models.qwen2_audio import AudioFlamingo3ForConditionalGeneration, Qwen2AudioForConditionalGeneration

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


async def test_long_and_short_audios_match_transformers(tmp_path):
    path = make_tiny_audio_flamingo3(tmp_path / "af3")
    audios = [make_audio(35.0, seed=3), make_audio(3.0, seed=3)]
    texts = ["hi <sound> what", "short <sound> one"]
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=256, max_model_len=2048) as engine:
        outs = await asyncio.gather(*(engine.generate({"prompt": text, "multi_modal_data": {"audio": (a, SAMPLING_RATE)}},
                                                      GREEDY) for text, a in zip(texts, audios)))
    for out, text, audio in zip(outs, texts, audios):
        prompt_ids, tokens = hf_audio_greedy(path, text, [audio], 8)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    assert len(outs[0].prompt_token_ids) - len(outs[1].prompt_token_ids) > 750  # the long one: two windows


def test_windows_of_each_family() -> None:
    ten_minutes_and_more = np.zeros(SAMPLING_RATE * 620, np.float32)
    windows = AudioFlamingo3ForConditionalGeneration.mm_audio_windows(ten_minutes_and_more, SAMPLING_RATE)
    assert len(windows) == 20 and all(w.size == 30 * SAMPLING_RATE for w in windows)  # cut at 10 minutes
    short = np.zeros(SAMPLING_RATE * 31, np.float32)
    assert [w.size for w in AudioFlamingo3ForConditionalGeneration.mm_audio_windows(short, SAMPLING_RATE)] == [
        30 * SAMPLING_RATE, SAMPLING_RATE]
    assert [w.size for w in Qwen2AudioForConditionalGeneration.mm_audio_windows(short, SAMPLING_RATE)] == [
        30 * SAMPLING_RATE]  # Qwen2-Audio: the first 30 s


async def test_chat_audio_parts_render_the_sound_token(tmp_path):
    """A chat audio part (a ``(waveform, rate)`` pair) reaches the template as ``<sound>``: prompt and tokens equal
    transformers' for that rendering."""
    path = make_tiny_audio_flamingo3(tmp_path / "af3")
    audio = make_audio(0.5, seed=5)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": (audio, SAMPLING_RATE)},
                                             {"type": "text", "text": "what?"}]}]
    async with AsyncEngine(path, disable_log_stats=True) as engine:
        stream = engine.chat(messages, GREEDY)
        tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    text = "<|user|><sound>what?<|eos|><|assistant|>"  # the template's rendering (no BOS)
    prompt_ids, hf_tokens = hf_audio_greedy(path, text, [audio], 8, add_special_tokens=False)
    assert stream.collector.prompt_token_ids == prompt_ids
    assert tokens == hf_tokens
