"""A tiny random GLM-ASR checkpoint (rotary audio encoder + Llama decoder) with its processor, and transformers'
prompt ids and greedy tokens for it."""

from __future__ import annotations

import os

from audio_utils import MEL_BINS, SAMPLING_RATE, _tokenizer

AUDIO = "<|audio|>"
"""The placeholder token (``GlmAsrProcessor``'s ``audio_token``; the release's ``<|pad|>`` is the tiny tokenizer's
padding token)."""
MARK = f"<|begin_of_audio|>{AUDIO}<|end_of_audio|>"
TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' %}{{ '" + MARK + "' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""GLM-ASR's audio parts (``<|begin_of_audio|><|pad|><|end_of_audio|>``) in the tiny tokenizer's chat format."""


def make_tiny_glmasr(path: str | os.PathLike[str], seed: int = 5) -> str:
    """Save a tiny random ``GlmAsrForConditionalGeneration`` (grouped key/value heads in the encoder, a half-rotary
    head of 16) with its processor (16 mel bins) in ``path``."""
    from mm_utils import random_model
    from transformers import GlmAsrConfig, GlmAsrEncoderConfig, GlmAsrForConditionalGeneration, GlmAsrProcessor, \
        LlamaConfig, WhisperFeatureExtractor

    tokenizer = _tokenizer([AUDIO, "<|begin_of_audio|>", "<|end_of_audio|>"], TEMPLATE)
    encoder = GlmAsrEncoderConfig(num_mel_bins=MEL_BINS, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, hidden_size=64, intermediate_size=256)
    decoder = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = GlmAsrConfig(audio_config=encoder.to_dict(), text_config=decoder.to_dict(),
                          audio_token_id=tokenizer.convert_tokens_to_ids(AUDIO))
    random_model(GlmAsrForConditionalGeneration, config, seed).save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE)
    GlmAsrProcessor(extractor, tokenizer, chat_template=TEMPLATE, audio_token=AUDIO).save_pretrained(path)
    return str(path)


def hf_glmasr_inputs(path: str, text: str, audios: list, add_special_tokens: bool = True):
    """transformers' processor's inputs for one prompt with ``audios`` (16 kHz waveforms) in order. Its check that
    each text has one audio is skipped: its expansion (``ProcessorMixin``) handles several audios in one text, and
    its model takes their windows in order."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    processor.validate_inputs = lambda **kwargs: None
    return processor(text=[text], audio=audios, sampling_rate=SAMPLING_RATE, return_tensors="pt",
                     add_special_tokens=add_special_tokens)


def hf_glmasr_greedy(path: str, text: str, audios: list, max_new_tokens: int,
                     add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens)."""
    import torch
    from transformers import GlmAsrForConditionalGeneration

    inputs = hf_glmasr_inputs(path, text, audios, add_special_tokens)
    model = GlmAsrForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()
