"""A tiny random Granite Speech checkpoint (Conformer encoder, Q-Former projector, Granite decoder) saved with its audio
LoRA adapter in the same folder, as the releases ship, and transformers' prompt ids and greedy tokens for it.

transformers' ``GraniteSpeechFeatureExtractor`` (and so its processor) needs torchaudio, which is not installed: the
checkpoint's ``preprocessor_config.json`` is written as transformers saves it, transformers' model is given the
features asyncllm computes (tests/unit/test_granite_speech_audio.py holds those to an independent reference), and its
prompt is expanded as ``GraniteSpeechProcessor`` expands it (one ``<|audio|>`` per projector row)."""

from __future__ import annotations

import contextlib
import functools
import json
import os

from audio_utils import SAMPLING_RATE, _tokenizer

AUDIO = "<|audio|>"
MEL_BINS = 16
TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Granite Speech's prompts hold ``<|audio|>`` in the text of a message."""
PREPROCESSOR = {"feature_extractor_type": "GraniteSpeechFeatureExtractor", "processor_class": "GraniteSpeechProcessor",
                "sampling_rate": SAMPLING_RATE, "n_fft": 512, "win_length": 400, "hop_length": 160,
                "n_mels": MEL_BINS, "projector_window_size": 15, "projector_downsample_rate": 5,
                "feature_size": MEL_BINS, "padding_value": 0.0, "padding_side": "right"}


def make_tiny_granite_speech(root: str | os.PathLike[str], seed: int = 7) -> str:
    """Save a tiny random ``GraniteSpeechForConditionalGeneration`` (`tiny_granite_speech_model`) in ``root/base``,
    and the folder served, ``root/release``: those files with a random PEFT adapter of the decoder's q and v
    projections beside them, as the releases ship theirs. transformers' own adapter loading (which would read the adapter of ``release``) needs a
    newer PEFT than the tests have: its references load ``base`` and wrap it in PEFT's model themselves."""
    import shutil

    from lora_utils import make_adapter
    from transformers import GraniteSpeechForConditionalGeneration

    tokenizer = _tokenizer([AUDIO], TEMPLATE)
    model = tiny_granite_speech_model(len(tokenizer), tokenizer.convert_tokens_to_ids(AUDIO), seed)
    base, release = os.path.join(root, "base"), os.path.join(root, "release")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    with open(os.path.join(base, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(PREPROCESSOR, f)
    shutil.copytree(base, release)
    make_adapter(base, release, seed, rank=4, alpha=8, targets=["q_proj", "v_proj"],
                 auto_class=GraniteSpeechForConditionalGeneration)
    return release


def tiny_granite_speech_model(vocab_size: int, audio_token_id: int, seed: int):
    """transformers' seeded random model (its batch normalization's running statistics random too): attention
    blocks of 20 rows, a Q-Former whose second layer has no cross-attention, Granite's four multipliers."""
    import torch
    from mm_utils import random_model
    from transformers import Blip2QFormerConfig, GraniteConfig, GraniteSpeechConfig, GraniteSpeechEncoderConfig, \
        GraniteSpeechForConditionalGeneration

    decoder = GraniteConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                            embedding_multiplier=4.0, attention_multiplier=0.2, residual_multiplier=0.5,
                            logits_scaling=2.0, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    encoder = GraniteSpeechEncoderConfig(input_dim=2 * MEL_BINS, num_layers=2, hidden_dim=32, feedforward_mult=2,
                                         num_heads=2, dim_head=16, output_dim=12, context_size=20, max_pos_emb=24)
    qformer = Blip2QFormerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 cross_attention_frequency=2, encoder_hidden_size=32)
    config = GraniteSpeechConfig(text_config=decoder.to_dict(), encoder_config=encoder.to_dict(),
                                 projector_config=qformer.to_dict(), audio_token_index=audio_token_id)
    model = random_model(GraniteSpeechForConditionalGeneration, config, seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.normal_(0.0, 0.3)
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 2.0)
    return model


def hf_granite_speech_greedy(release: str, text: str, audio, max_new_tokens: int,
                             adapter: bool | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for ``text`` with at most one ``<|audio|>`` and its 16 kHz
    waveform (None: a text prompt), through PEFT's model with the release's adapter when ``adapter`` (None: with it
    for audio only, as transformers' own ``generate`` turns a checkpoint's adapter on and off)."""
    import torch
    from transformers import AutoTokenizer

    from asyncllm.mm.granite_speech_audio import GraniteSpeechFeatures

    model = _hf_model(release)
    config = model.config
    kwargs = {}
    if audio is not None:
        features = GraniteSpeechFeatures.from_pretrained(release)([audio], SAMPLING_RATE)["input_features"]
        rows = -(-features.shape[1] // config.window_size) * (config.window_size // config.downsample_rate)
        text = text.replace(AUDIO, AUDIO * rows)
        kwargs["input_features"] = torch.from_numpy(features)
    ids = AutoTokenizer.from_pretrained(release)(text, return_tensors="pt")["input_ids"]
    adapted = audio is not None if adapter is None else adapter
    with torch.no_grad(), contextlib.nullcontext() if adapted else model.disable_adapter():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **kwargs)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


@functools.lru_cache(maxsize=2)
def _hf_model(release: str):
    """transformers' model of the base weights in PEFT's model with the release's adapter."""
    import torch
    from peft import PeftModel
    from transformers import GraniteSpeechForConditionalGeneration

    base = os.path.join(os.path.dirname(release), "base")
    model = GraniteSpeechForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(model, release).eval()
