"""A tiny random Voxtral checkpoint (Whisper encoder, stacked-row projector, Llama decoder) with its feature
extractor and a tokenizer holding ``[AUDIO]`` / ``[BEGIN_AUDIO]``, and transformers' prompt ids and greedy tokens
for it.

transformers' ``VoxtralProcessor`` tokenizes through mistral_common (its chat and transcription requests), which the
tiny checkpoint has no tokenizer for: the reference writes the ``[AUDIO]`` run mistral_common writes (375 per 30 s
window of the padded audio) itself and takes the features from ``VoxtralProcessor._retrieve_input_features``, the
processor's own feature code, with its default audio kwargs."""

from __future__ import annotations

import os

from audio_utils import MEL_BINS, SAMPLING_RATE, _tokenizer

AUDIO, BEGIN = "[AUDIO]", "[BEGIN_AUDIO]"
MARK = BEGIN + AUDIO
"""An audio in a prompt: mistral_common's ``[BEGIN_AUDIO]``, then the ``[AUDIO]`` the host repeats."""
TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' %}{{ '" + MARK + "' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
WINDOW_ROWS = 375
"""Placeholders per 30 s window (1500 encoder rows stacked by 4)."""


def make_tiny_voxtral(path: str | os.PathLike[str], seed: int = 7, tekken: bool = False) -> str:
    """Save a tiny random ``VoxtralForConditionalGeneration`` (encoder width 32, rows stacked by 4, 16 mel bins)
    with its feature extractor and tokenizer in ``path``; `tekken`: only a tekken.json with an audio section, as
    Mistral's releases ship (tests/mistral_utils.py), which transformers' ``VoxtralProcessor`` reads through
    mistral_common."""
    from mistral_utils import AUDIO_ID, write_tekken
    from mm_utils import random_model
    from transformers import LlamaConfig, VoxtralConfig, VoxtralEncoderConfig, VoxtralForConditionalGeneration, \
        WhisperFeatureExtractor

    tokenizer = None if tekken else _tokenizer([AUDIO, BEGIN], TEMPLATE)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=11) if tekken else dict(bos_token_id=0, eos_token_id=1,
                                                                                    pad_token_id=2)
    encoder = VoxtralEncoderConfig(num_mel_bins=MEL_BINS, num_hidden_layers=2, num_attention_heads=2,
                                   hidden_size=32, intermediate_size=128, max_source_positions=1500)
    decoder = LlamaConfig(vocab_size=512 if tekken else len(tokenizer), hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=4096, rope_theta=10000.0, **ids)
    config = VoxtralConfig(audio_config=encoder.to_dict(), text_config=decoder.to_dict(),
                           audio_token_id=AUDIO_ID if tekken else tokenizer.convert_tokens_to_ids(AUDIO))
    random_model(VoxtralForConditionalGeneration, config, seed).save_pretrained(path)
    WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE).save_pretrained(path)
    if tekken:
        write_tekken(str(path), mel_bins=MEL_BINS)
    else:
        tokenizer.save_pretrained(path)
    return str(path)


def hf_voxtral_inputs(path: str, text: str, audios: list, add_special_tokens: bool = True) -> dict:
    """transformers' inputs for ``text`` (each ``[AUDIO]`` one audio of ``audios``, 16 kHz waveforms, in order):
    ``input_ids`` with each ``[AUDIO]`` repeated 375 times per window, ``input_features`` from the processor's
    feature code."""
    from types import SimpleNamespace

    import numpy as np
    from transformers import AutoTokenizer, VoxtralProcessor, WhisperFeatureExtractor

    pieces = text.split(AUDIO)
    assert len(pieces) == len(audios) + 1, "one audio per [AUDIO]"
    windows = [-(-a.size // 480_000) for a in audios]
    expanded = pieces[0] + "".join(AUDIO * (WINDOW_ROWS * w) + rest for w, rest in zip(windows, pieces[1:]))
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = dict(tokenizer(expanded, return_tensors="pt", add_special_tokens=add_special_tokens))
    if audios:
        extractor = WhisperFeatureExtractor.from_pretrained(path)
        kwargs = {k: v for k, v in VoxtralProcessor.audio_kwargs.items() if k != "max_source_positions"}
        inputs["input_features"] = VoxtralProcessor._retrieve_input_features(
            SimpleNamespace(feature_extractor=extractor), [np.asarray(a) for a in audios], 3000, **kwargs)
    return inputs


def hf_voxtral_greedy(path: str, text: str, audios: list, max_new_tokens: int,
                      add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens)."""
    import torch
    from transformers import VoxtralForConditionalGeneration

    inputs = hf_voxtral_inputs(path, text, audios, add_special_tokens)
    model = VoxtralForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()
