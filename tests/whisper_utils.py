"""A tiny random Whisper checkpoint (2 s of 16-bin log-mel frames -> 100 encoder rows) and transformers' greedy
transcript for it, for the Whisper tests."""

from __future__ import annotations

import functools
import os

WHISPER_TOKENS = ("<|startoftranscript|>", "<|en|>", "<|fr|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>")
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
TIMESTAMPS = 101
"""The timestamp tokens of `make_tiny_whisper(timestamps=True)`: ``<|0.00|>`` to ``<|2.00|>``."""
CHUNK_SECONDS = 2
"""The tiny feature extractor's ``chunk_length``: 200 frames, 100 encoder rows."""


def make_tiny_whisper(path: str | os.PathLike[str], seed: int = 0, timestamps: bool = False) -> str:
    """Save a tiny random ``WhisperForConditionalGeneration`` with its feature extractor (16 mel bins, 2 s) and a
    tokenizer holding Whisper's task tokens in ``path``; with ``timestamps``, also ``TIMESTAMPS`` timestamp tokens
    after ``<|notimestamps|>`` and a generation_config.json as a real checkpoint's (`_whisper_generation_config`)."""
    from audio_utils import MEL_BINS, SAMPLING_RATE, _tokenizer
    from mm_utils import random_model
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(TIMESTAMPS)] if timestamps else []
    tokenizer = _tokenizer(list(WHISPER_TOKENS) + stamps, "")
    start = tokenizer.convert_tokens_to_ids(WHISPER_TOKENS[0])
    config = WhisperConfig(vocab_size=len(tokenizer), num_mel_bins=MEL_BINS, d_model=64, encoder_layers=2,
                           decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=100 * CHUNK_SECONDS // 2,
                           max_target_positions=96, decoder_start_token_id=start, bos_token_id=start,
                           eos_token_id=1, pad_token_id=2, begin_suppress_tokens=None, suppress_tokens=None)
    model = random_model(WhisperForConditionalGeneration, config, seed)
    if timestamps:
        _whisper_generation_config(model, tokenizer)
    model.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE,
                            chunk_length=CHUNK_SECONDS).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _whisper_generation_config(model, tokenizer) -> None:
    """Whisper's generation keys (task and language ids, ``<|notimestamps|>``, ``max_initial_timestamp_index``)
    and suppress lists that change the greedy tokens: every third text id always, the EOS and every sixth at the
    first position."""
    ids = dict(zip(WHISPER_TOKENS, tokenizer.convert_tokens_to_ids(list(WHISPER_TOKENS))))
    config = model.generation_config
    config.no_timestamps_token_id, config.max_initial_timestamp_index = ids["<|notimestamps|>"], 5
    config.is_multilingual, config.lang_to_id = True, {"<|en|>": ids["<|en|>"], "<|fr|>": ids["<|fr|>"]}
    config.task_to_id = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    config.suppress_tokens = list(range(3, ids["<|startoftranscript|>"], 3))
    config.begin_suppress_tokens = [model.config.eos_token_id, *range(4, ids["<|startoftranscript|>"], 6)]
    config._from_model_config = False  # saved as set, not derived from the model's config again


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


def hf_whisper_greedy(path: str, audio, prompt_ids: list[int], max_new_tokens: int, suppress: bool = True
                      ) -> list[int]:
    """transformers' greedy tokens after ``prompt_ids`` for a 16 kHz waveform: its feature extractor, the encoder
    once, the decoder a token at a time over the whole sequence (argmax after the checkpoint's suppress lists, as
    ``generate`` applies them, unless not ``suppress``; stopping after EOS)."""
    import torch

    features, model = _features(path, audio), _hf_whisper(path)[0]
    processors = _suppressors(model.generation_config, len(prompt_ids)) if suppress else []
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        encoded = model.model.encoder(features)
        for _ in range(max_new_tokens):
            logits = model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([ids])).logits[:, -1]
            for processor in processors:
                logits = processor(torch.tensor([ids]), logits)
            token = int(logits[0].argmax())
            out.append(token)
            ids.append(token)
            if token == model.config.eos_token_id:
                break
    return out


def _suppressors(config, begin_index: int) -> list:
    """transformers' processors of the generation config's ``begin_suppress_tokens`` and ``suppress_tokens``."""
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                        SuppressTokensLogitsProcessor)

    processors = []
    if config.begin_suppress_tokens:
        processors.append(SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin_index))
    if config.suppress_tokens:
        processors.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
    return processors


def hf_whisper_prompt_logprobs(path: str, audio, prompt_ids: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the first, given the ones before it and the audio."""
    import torch

    features, model = _features(path, audio), _hf_whisper(path)[0]
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([prompt_ids])).logits[0]
    logprobs = torch.log_softmax(logits.double(), -1)
    return [float(logprobs[i - 1, token]) for i, token in enumerate(prompt_ids) if i > 0]


def hf_whisper_generate(path: str, audio, max_new_tokens: int, timestamps: bool, language: str = "en",
                        task: str = "transcribe") -> list[int]:
    """transformers' ``generate`` tokens after the task prompt for a 16 kHz waveform of at most ``CHUNK_SECONDS``:
    the checkpoint's suppress lists, and with ``timestamps`` its timestamp rules (the first pass over the audio:
    what one request of ours is)."""
    features, model = _features(path, audio), _hf_whisper(path)[0]
    if not timestamps:  # the generated tokens alone
        return model.generate(features, language=language, task=task, max_new_tokens=max_new_tokens)[0].tolist()
    out = model.generate(features, language=language, task=task, return_timestamps=True,
                         max_new_tokens=max_new_tokens, return_dict_in_generate=True)
    sequence = out["segments"][0][0]["result"]["sequences"]
    sequence = sequence["sequences"] if isinstance(sequence, dict) else sequence
    return sequence.tolist()[3:]  # after <|startoftranscript|><|lang|><|task|>
