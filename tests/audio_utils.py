"""A tiny random Qwen2-Audio checkpoint (Whisper-style encoder + Qwen2 decoder) with its processor, and audio
helpers for the audio tests."""

from __future__ import annotations

import io
import os

AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
SAMPLING_RATE = 16_000
MEL_BINS = 16

CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content %}{% set audio_count.value = audio_count.value + 1 %}"
    "{{ 'Audio ' ~ audio_count.value ~ ': <|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Qwen2-Audio-Instruct's template's audio parts (``Audio n: <|audio_bos|><|AUDIO|><|audio_eos|>``) in the tiny
tokenizer's chat format."""


def _tokenizer(tokens: list[str], template: str):
    """The tiny Qwen2 tokenizer with ``tokens`` added as special tokens and ``template`` as its chat template."""
    from transformers import AutoTokenizer

    from asyncllm.tiny import tiny_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = template
    return tokenizer


def _save(path: str | os.PathLike[str], model_cls, config, processor_cls, tokenizer, template: str, seed: int) -> str:
    """Save the seeded random model and its processor (a 16-bin Whisper feature extractor) in ``path``."""
    from mm_utils import random_model
    from transformers import WhisperFeatureExtractor

    random_model(model_cls, config, seed).save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE)
    processor_cls(feature_extractor=extractor, tokenizer=tokenizer, chat_template=template).save_pretrained(path)
    return str(path)


def _decoder(tokenizer) -> dict:
    """The tiny Qwen2 decoder's config."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2).to_dict()


def make_tiny_qwen2_audio(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``Qwen2AudioForConditionalGeneration`` with its processor (16 mel bins) in ``path``."""
    from transformers import (
        Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor,
    )

    tokenizer = _tokenizer(list(AUDIO_TOKENS), CHAT_TEMPLATE)
    encoder = Qwen2AudioEncoderConfig(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2,
                                      encoder_ffn_dim=64, d_model=32, max_source_positions=1500)
    config = Qwen2AudioConfig(audio_config=encoder.to_dict(), text_config=_decoder(tokenizer),
                              audio_token_index=tokenizer.convert_tokens_to_ids(AUDIO_TOKENS[0]))
    return _save(path, Qwen2AudioForConditionalGeneration, config, Qwen2AudioProcessor, tokenizer, CHAT_TEMPLATE, seed)


def make_tiny_audio_flamingo3(path: str | os.PathLike[str], seed: int = 3) -> str:
    """Save a tiny random ``AudioFlamingo3ForConditionalGeneration`` with its processor (16 mel bins) in ``path``."""
    from transformers import (
        AudioFlamingo3Config, AudioFlamingo3EncoderConfig, AudioFlamingo3ForConditionalGeneration,
        AudioFlamingo3Processor,
    )

    tokenizer = _tokenizer([SOUND], FLAMINGO_TEMPLATE)
    encoder = AudioFlamingo3EncoderConfig(num_mel_bins=MEL_BINS, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, hidden_size=32, max_source_positions=1500)
    config = AudioFlamingo3Config(audio_config=encoder.to_dict(), text_config=_decoder(tokenizer),
                                  audio_token_id=tokenizer.convert_tokens_to_ids(SOUND))
    return _save(path, AudioFlamingo3ForConditionalGeneration, config, AudioFlamingo3Processor, tokenizer,
                 FLAMINGO_TEMPLATE, seed)


SOUND = "<sound>"
FLAMINGO_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' %}{{ '<sound>' }}{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def hf_audio_greedy(path: str, text: str, audios: list, max_new_tokens: int,
                    add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with audio markers and 16 kHz waveforms (Qwen2-Audio or
    Audio Flamingo 3, as the checkpoint says)."""
    import torch
    from transformers import AudioFlamingo3ForConditionalGeneration, AutoProcessor, Qwen2AudioForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    flamingo = type(processor).__name__.startswith("AudioFlamingo3")
    inputs = processor(text=[text] if flamingo else text, audio=audios or None, sampling_rate=SAMPLING_RATE,
                       return_tensors="pt", add_special_tokens=add_special_tokens)
    model_cls = AudioFlamingo3ForConditionalGeneration if flamingo else Qwen2AudioForConditionalGeneration
    model = model_cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


def make_audio(seconds: float, seed: int, rate: int = SAMPLING_RATE):
    """A float32 mono waveform of ``seconds``: random tones with noise (so different seeds differ)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(rng.uniform(0.1, 0.4) * np.sin(2 * np.pi * rng.uniform(100, 2000) * t) for _ in range(3))
    return (tones + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def wav_bytes(waveform, rate: int = SAMPLING_RATE) -> bytes:
    """A 16-bit PCM WAV file of a float waveform in [-1, 1]."""
    import wave

    import numpy as np

    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((np.clip(waveform, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()
