"""A tiny random Gemma 3n audio-text checkpoint (Gemma 3n's audio tower and embedders before the tiny Gemma 3n
decoder), its feature extractor, and transformers' own processor and model as the reference.

transformers cannot build ``Gemma3nForConditionalGeneration`` without timm: its ``__init__`` makes the MobileNetV5
vision tower with ``AutoModel.from_config`` (``TimmWrapperModel``). `hf_gemma3n` builds transformers' class with that
one call answered by an empty module (the tower has no weights then, and no audio or text prompt runs it); every other
part (the audio tower, both embedders, the decoder, the merge of audio rows and special tokens, per-layer inputs,
``generate``) is transformers' own code, and those weights are what the checkpoint holds.

The token ids are laid out as the release's: ordinary tokens below ``vocab_size_per_layer_input``, then the vision
embedder's range (``<end_of_image>``, ``<image_soft_token>``, two more), then the audio embedder's
(``<end_of_audio>``, ``<audio_soft_token>``, two more) up to the vocabulary's end."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any, Iterator

__all__ = ["AUDIO", "SOFT_TOKENS", "hf_gemma3n", "hf_gemma3n_greedy", "hf_gemma3n_inputs", "make_tiny_gemma3n_audio"]

BOA, BOI, AUDIO = "<start_of_audio>", "<start_of_image>", "<audio_soft_token>"
VISION_RANGE = ("<end_of_image>", "<image_soft_token>", "<vision_2>", "<vision_3>")
AUDIO_RANGE = ("<end_of_audio>", AUDIO, "<audio_2>", "<audio_3>")
MEL = 16
SOFT_TOKENS = 12
"""``audio_soft_tokens_per_image``: a 1.3 s audio makes 8 rows, the other 4 are padding."""
NAMED = {"boa_token": BOA, "eoa_token": AUDIO_RANGE[0], "audio_token": AUDIO, "boi_token": BOI,
         "eoi_token": VISION_RANGE[0], "image_token": VISION_RANGE[1]}
"""The tokenizer attributes ``Gemma3nProcessor`` reads (the release's tokenizer config names them)."""


@contextlib.contextmanager
def _vision_tower_stubbed() -> Iterator[None]:
    """transformers' ``Gemma3nModel.__init__`` with its vision tower an empty module (see the module docstring)."""
    from unittest import mock

    import torch
    from transformers import Gemma3nVisionConfig
    from transformers.models.gemma3n import modeling_gemma3n

    real = modeling_gemma3n.AutoModel

    class _AutoModel:
        @staticmethod
        def from_config(config: Any, **kwargs: Any) -> Any:
            return torch.nn.Module() if isinstance(config, Gemma3nVisionConfig) else real.from_config(config, **kwargs)

    with mock.patch.object(modeling_gemma3n, "AutoModel", _AutoModel):
        yield


def _tokenizer() -> Any:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from asyncllm.tiny import tiny_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("gemma3n"))
    tokenizer.add_tokens([AddedToken("\n" * n, normalized=False, special=False) for n in (4, 3, 2, 1)])
    tokenizer.add_special_tokens({"additional_special_tokens": [BOA, BOI, *VISION_RANGE, *AUDIO_RANGE]})
    return tokenizer


def make_tiny_gemma3n_audio(path: str | os.PathLike[str], seed: int = 0, **text_overrides: Any) -> str:
    """Save the tiny checkpoint (a 2-layer audio tower: attention chunks of 4 frames, 4 back and 1 ahead), its
    tokenizer and feature extractor in ``path``; ``text_overrides``: the decoder's config fields changed."""
    from mm_utils import random_model
    from transformers import Gemma3nAudioFeatureExtractor, Gemma3nConfig, Gemma3nForConditionalGeneration

    from asyncllm.models.checkpoint import load_hf_config
    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = _tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (BOA, BOI, *VISION_RANGE, *AUDIO_RANGE)}
    vision_from, audio_from = ids[VISION_RANGE[0]], ids[AUDIO_RANGE[0]]
    assert audio_from - vision_from == 4 and len(tokenizer) == audio_from + 4
    text = load_hf_config(tiny_checkpoint("gemma3n")).to_dict()
    text.update(vocab_size=len(tokenizer), vocab_size_per_layer_input=vision_from, **text_overrides)
    audio = dict(hidden_size=32, input_feat_size=MEL, conf_num_hidden_layers=2, conf_num_attention_heads=2,
                 conf_attention_chunk_size=4, conf_attention_context_left=5, conf_attention_context_right=1,
                 conf_conv_kernel_size=5, sscp_conv_channel_size=[8, 4], vocab_size=4, vocab_offset=audio_from)
    config = Gemma3nConfig(text_config=text, audio_config=audio,
                           vision_config=dict(hidden_size=24, vocab_size=4, vocab_offset=vision_from),
                           audio_soft_tokens_per_image=SOFT_TOKENS, boa_token_id=ids[BOA], eoa_token_id=audio_from,
                           audio_token_id=ids[AUDIO], boi_token_id=ids[BOI], eoi_token_id=vision_from,
                           image_token_id=ids[VISION_RANGE[1]], architectures=["Gemma3nForConditionalGeneration"])
    with _vision_tower_stubbed():
        model = random_model(Gemma3nForConditionalGeneration, config, seed, std=0.05)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Gemma3nAudioFeatureExtractor(feature_size=MEL).save_pretrained(path)
    return str(path)


def hf_gemma3n(path: str) -> Any:
    """transformers' ``Gemma3nForConditionalGeneration`` of the checkpoint (its vision tower stubbed), float32."""
    import torch
    from transformers import Gemma3nForConditionalGeneration

    with _vision_tower_stubbed():
        return Gemma3nForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4)
def _processor(path: str) -> Any:
    """transformers' ``Gemma3nProcessor`` of the checkpoint (its image processor unused)."""
    from transformers import AutoFeatureExtractor, AutoTokenizer, Gemma3nProcessor, SiglipImageProcessorPil

    return Gemma3nProcessor(AutoFeatureExtractor.from_pretrained(path), SiglipImageProcessorPil(),
                            AutoTokenizer.from_pretrained(path, extra_special_tokens=NAMED),
                            audio_seq_length=SOFT_TOKENS)


def hf_gemma3n_inputs(path: str, text: str, audios: list) -> dict:
    """What transformers' ``Gemma3nProcessor`` makes of ``text`` with 16 kHz ``audios``: its prompt layout (ids)
    and its feature extraction (features and masks)."""
    inputs = dict(_processor(path)(text=[text], audio=audios or None, return_tensors="pt"))
    inputs.pop("token_type_ids", None)
    return inputs


def hf_gemma3n_greedy(model: Any, path: str, text: str, audios: list, max_new_tokens: int
                      ) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for ``text`` with 16 kHz ``audios`` (`hf_gemma3n_inputs`)."""
    import torch

    inputs = hf_gemma3n_inputs(path, text, audios)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()
