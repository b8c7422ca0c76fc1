"""A tiny random Whisper checkpoint (2 s of 16-bin log-mel frames -> 100 encoder rows) and transformers' greedy
transcript for it, for the Whisper tests."""

from __future__ import annotations

import functools
import os

WHISPER_TOKENS = ("<|startoftranscript|>", "<|en|>", "<|fr|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>")
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
CHUNK_SECONDS = 2
"""The tiny feature extractor's ``chunk_length``: 200 frames, 100 encoder rows."""


def make_tiny_whisper(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``WhisperForConditionalGeneration`` with its feature extractor (16 mel bins, 2 s) and a
    tokenizer holding Whisper's task tokens in ``path``."""
    from audio_utils import MEL_BINS, SAMPLING_RATE, _tokenizer
    from mm_utils import random_model
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tokenizer = _tokenizer(list(WHISPER_TOKENS), "")
    start = tokenizer.convert_tokens_to_ids(WHISPER_TOKENS[0])
    config = WhisperConfig(vocab_size=len(tokenizer), num_mel_bins=MEL_BINS, d_model=64, encoder_layers=2,
                           decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=100 * CHUNK_SECONDS // 2,
                           max_target_positions=96, decoder_start_token_id=start, bos_token_id=start,
                           eos_token_id=1, pad_token_id=2, begin_suppress_tokens=None, suppress_tokens=None)
    random_model(WhisperForConditionalGeneration, config, seed).save_pretrained(path)
    WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE,
                            chunk_length=CHUNK_SECONDS).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@functools.lru_cache(maxsize=None)
def _hf_whisper(path: str):
    """transformers' model and feature extractor of the checkpoint (loaded once per path)."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, WhisperFeatureExtractor.from_pretrained(path)


def _features(path: str, audio):
    from audio_utils import SAMPLING_RATE

    return _hf_whisper(path)[1](audio, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features


def hf_whisper_greedy(path: str, audio, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens after ``prompt_ids`` for a 16 kHz waveform: its feature extractor, the encoder
    once, the decoder a token at a time over the whole sequence (argmax, stopping after EOS)."""
    import torch

    features, model = _features(path, audio), _hf_whisper(path)[0]
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        encoded = model.model.encoder(features)
        for _ in range(max_new_tokens):
            logits = model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([ids])).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token == model.config.eos_token_id:
                break
    return out


def hf_whisper_prompt_logprobs(path: str, audio, prompt_ids: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the first, given the ones before it and the audio."""
    import torch

    features, model = _features(path, audio), _hf_whisper(path)[0]
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([prompt_ids])).logits[0]
    logprobs = torch.log_softmax(logits.double(), -1)
    return [float(logprobs[i - 1, token]) for i, token in enumerate(prompt_ids) if i > 0]
