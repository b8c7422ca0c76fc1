"""A tiny random Qwen3-ASR checkpoint (its windowed audio encoder + a Qwen3 decoder) with its processor, and
transformers' greedy reference for prompts with any number of audios."""

from __future__ import annotations

import os

from audio_utils import MEL_BINS, SAMPLING_RATE

AUDIO_TOKENS = {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                "audio_eos_token": "<|audio_end|>"}
MARK = "<|audio_start|><|audio_pad|><|audio_end|>"
"""One audio in a prompt: the processor expands its ``<|audio_pad|>``."""

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' %}{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Qwen3-ASR's template's audio parts in the tiny tokenizer's chat format."""


def make_tiny_qwen3_asr(path: str | os.PathLike[str], seed: int = 0, n_window_infer: int = 200) -> str:
    """Save a tiny random ``Qwen3ASRForConditionalGeneration`` with its processor (16 mel bins) in ``path``; its
    encoder attends within windows of ``n_window_infer`` mel frames (2 s: 26 rows)."""
    from mm_utils import random_model
    from transformers import (
        AutoTokenizer, Qwen3ASRConfig, Qwen3ASRFeatureExtractor, Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor,
        Qwen3Config,
    )

    from asyncllm.tiny import tiny_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"), extra_special_tokens=AUDIO_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    decoder = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                          bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    encoder = dict(model_type="qwen3_asr_encoder", num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2,
                   encoder_ffn_dim=64, d_model=32, output_dim=64, downsample_hidden_size=8,
                   n_window_infer=n_window_infer)
    config = Qwen3ASRConfig(audio_config=encoder, text_config=decoder.to_dict(), pad_token_id=2, eos_token_id=1,
                            audio_token_id=tokenizer.convert_tokens_to_ids(AUDIO_TOKENS["audio_token"]))
    random_model(Qwen3ASRForConditionalGeneration, config, seed).save_pretrained(path)
    extractor = Qwen3ASRFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE)
    Qwen3ASRProcessor(feature_extractor=extractor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return str(path)


def hf_qwen3_asr_greedy(path: str, text: str, audios: list, max_new_tokens: int,
                        add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with one `MARK` per 16 kHz waveform.

    transformers' processor takes one audio per text, so each audio goes through it alone (its placeholders and
    features, exactly as for a one-audio prompt); the prompt is the text with each audio's expansion in its place,
    the features are stacked (zero-padded frames, masked) for one ``generate``."""
    import torch
    from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    pieces = text.split(MARK)
    assert len(pieces) == len(audios) + 1, "one MARK per audio"
    alone = [processor(text=[MARK], audio=[audio], sampling_rate=SAMPLING_RATE, return_tensors="pt",
                       add_special_tokens=False) for audio in audios]
    expanded = pieces[0] + "".join(processor.tokenizer.decode(inputs["input_ids"][0]) + piece
                                   for inputs, piece in zip(alone, pieces[1:]))
    input_ids = processor.tokenizer(expanded, return_tensors="pt", add_special_tokens=add_special_tokens).input_ids
    model = Qwen3ASRForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    kwargs = {}
    if audios:
        frames = max(inputs["input_features"].shape[-1] for inputs in alone)
        pad = [(inputs["input_features"], inputs["input_features_mask"]) for inputs in alone]
        kwargs = {"input_features": torch.cat([torch.nn.functional.pad(f, (0, frames - f.shape[-1])) for f, _ in pad]),
                  "input_features_mask": torch.cat([torch.nn.functional.pad(m, (0, frames - m.shape[-1]))
                                                    for _, m in pad])}
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs,
                             max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = input_ids[0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()
