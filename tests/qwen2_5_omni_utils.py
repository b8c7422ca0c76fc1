"""A tiny random Qwen2.5-Omni thinker (Qwen2.5-VL's vision tower, its audio encoder, the Qwen2 decoder with M-RoPE),
the full ``Qwen2_5OmniForConditionalGeneration`` layout of it, and transformers' greedy tokens."""

from __future__ import annotations

import functools
import io
import json
import os
from pathlib import Path

IMAGE_MARK = "<|vision_bos|><|IMAGE|><|vision_eos|>"
VIDEO_MARK = "<|vision_bos|><|VIDEO|><|vision_eos|>"
AUDIO_MARK = "<|audio_bos|><|AUDIO|><|audio_eos|>"
_TOKENS = ["<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>",
           "<|VIDEO|>"]
_SPEECH_TENSORS = {"talker.model.embed_tokens.weight": (8, 4), "token2wav.code2wav_dit_model.proj.weight": (4, 4)}
"""Stand-ins for the full checkpoint's speech-out parts, which the engine must skip."""


def _thinker_config(tokenizer):
    from transformers import Qwen2_5OmniThinkerConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, in_channels=3, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, n_window=20, max_source_positions=1500)
    return Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, image_token_index=ids["<|IMAGE|>"],
        audio_token_index=ids["<|AUDIO|>"], video_token_index=ids["<|VIDEO|>"],
        vision_start_token_id=ids["<|vision_bos|>"], audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"])


def make_tiny_qwen2_5_omni(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``Qwen2_5OmniThinkerForConditionalGeneration`` with its tokenizer, one
    ``preprocessor_config.json`` holding both its image processor and its 16-bin Whisper feature extractor (as the
    released checkpoints do) and the Qwen-VL tests' video settings in ``path``."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return save_tiny_thinker(path, Qwen2_5OmniThinkerForConditionalGeneration, _thinker_config, _TOKENS, seed, 14)


def save_tiny_thinker(path: str | os.PathLike[str], model_cls, make_config, tokens: list[str], seed: int,
                      patch_size: int) -> str:
    """Save a random ``model_cls`` of ``make_config(tokenizer)`` (the tiny Qwen2 tokenizer with ``tokens`` added),
    the tokenizer, one ``preprocessor_config.json`` holding both the image processor (``patch_size`` pixels) and the
    16-bin Whisper feature extractor, and the Qwen-VL tests' video settings in ``path``."""
    from audio_utils import MEL_BINS, SAMPLING_RATE
    from mm_utils import random_model
    from qwen_vl_utils import _save_video_settings, image_processor
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    random_model(model_cls, make_config(tokenizer), seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE)
    merged = {**extractor.to_dict(), **image_processor(patch_size=patch_size).to_dict()}
    (path / "preprocessor_config.json").write_text(json.dumps(merged))
    _save_video_settings(path, patch_size=patch_size)
    return str(path)


def make_full_omni_layout(thinker: str, path: str | os.PathLike[str],
                          architecture: str = "Qwen2_5OmniForConditionalGeneration", model_type: str = "qwen2_5_omni",
                          speech_tensors: dict[str, tuple[int, ...]] = _SPEECH_TENSORS) -> str:
    """The thinker at ``thinker`` saved as an ``architecture`` (a ``Qwen2_5OmniForConditionalGeneration``) checkpoint:
    its config the ``thinker_config`` of an Omni config (speech out enabled, as released), its weights under
    ``thinker.``, beside stand-in speech-out tensors (the talker's and token2wav's)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    shutil.copytree(thinker, path)
    (path / "model.safetensors").unlink()
    thinker_config = json.loads((Path(thinker) / "config.json").read_text())
    config = {"architectures": [architecture], "model_type": model_type, "enable_audio_output": True,
              "thinker_config": thinker_config}
    (path / "config.json").write_text(json.dumps(config))
    weights = {"thinker." + name: tensor for name, tensor in load_file(Path(thinker) / "model.safetensors").items()}
    weights.update({name: torch.zeros(shape) for name, shape in speech_tensors.items()})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def hf_omni_greedy(path: str, text: str, images: list[bytes], audios: list, max_new_tokens: int,
                   videos: list = (), seconds_per_grid: list[float] = (),
                   audio_in_video: bool = False) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for ``text`` with one `IMAGE_MARK` per image, one `AUDIO_MARK` per
    16 kHz waveform and one `VIDEO_MARK` per video (its ``(t, h, w, features)`` patches, the engine's: transformers'
    video processor needs torchvision; ``seconds_per_grid`` each), expanded as its ``Qwen2_5OmniProcessor`` does (no
    processor is saved, for the same reason). ``audio_in_video``: ``audios`` are the videos' tracks, in order,
    interleaved with them by the processor's ``replace_video_with_audio_token``."""
    import torch
    from audio_utils import SAMPLING_RATE
    from PIL import Image
    from qwen_vl_utils import image_processor
    from transformers import AutoFeatureExtractor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs.update(image_processor(path)(images=pil, return_tensors="pt"))
        counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
        text = _expanded(text, "<|IMAGE|>", counts)
    if audios:
        features = AutoFeatureExtractor.from_pretrained(path)(
            audios, sampling_rate=SAMPLING_RATE, padding="max_length", return_attention_mask=True, return_tensors="pt")
        inputs["input_features"] = features["input_features"]
        inputs["feature_attention_mask"] = features["attention_mask"]
        frames = features["attention_mask"].sum(-1)
        rows = ((((frames - 1) // 2 + 1) - 2) // 2 + 1).tolist()
        text = _expanded(text, "<|AUDIO|>", iter(rows))
    if videos:
        text = video_inputs(inputs, text, "<|VIDEO|>", videos, seconds_per_grid, rows if audio_in_video else None)
    ids = tokenizer([text], return_tensors="pt")["input_ids"]
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        out = hf_thinker(path).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                        use_audio_in_video=audio_in_video)
    prompt_ids = ids[0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


def video_inputs(inputs: dict, text: str, token: str, videos: list, seconds_per_grid: list[float],
                 audio_rows: list[int] | None = None) -> str:
    """Put the videos' (``(t, h, w, features)`` patches each) transformers inputs in ``inputs``; ``text`` with each
    ``token`` repeated once per placeholder, or (``audio_rows``: each video's track's placeholders) replaced as
    ``Qwen2_5OmniProcessor`` does with the video's audio."""
    import torch

    inputs["pixel_values_videos"] = torch.cat([torch.from_numpy(v.reshape(-1, v.shape[-1])) for v in videos])
    inputs["video_grid_thw"] = torch.tensor([list(v.shape[:3]) for v in videos])
    inputs["video_second_per_grid"] = torch.tensor(seconds_per_grid)
    if audio_rows is not None:
        return _replaced(text, token, (hf_audio_in_video_text(grid, seconds, rows) for grid, seconds, rows
                                       in zip(inputs["video_grid_thw"].tolist(), seconds_per_grid, audio_rows)))
    return _expanded(text, token, iter((inputs["video_grid_thw"].prod(-1) // 4).tolist()))


def hf_audio_in_video_text(grid: list[int], seconds_per_grid: float, audio_rows: int,
                           position_id_per_seconds: float = 25, seconds_per_chunk: float = 2.0) -> str:
    """transformers' ``Qwen2_5OmniProcessor.replace_video_with_audio_token``'s text for a video of ``grid`` patches
    and its track of ``audio_rows`` placeholders (the thinker config's defaults, which the tiny checkpoint keeps)."""
    from types import SimpleNamespace

    from transformers import Qwen2_5OmniProcessor

    processor = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2), audio_bos_token="<|audio_bos|>", audio_eos_token="<|audio_eos|>",
        video_token="<|VIDEO|>", audio_token="<|AUDIO|>",
        get_chunked_index=lambda values, per_chunk: Qwen2_5OmniProcessor.get_chunked_index(None, values, per_chunk))
    return Qwen2_5OmniProcessor.replace_video_with_audio_token(
        processor, {"video_grid_thw": [grid], "video_second_per_grid": [seconds_per_grid]}, 0,
        {"num_audio_tokens": [audio_rows]}, 0, position_id_per_seconds=position_id_per_seconds,
        seconds_per_chunk=seconds_per_chunk)


def _replaced(text: str, token: str, replacements) -> str:
    parts = text.split(token)
    return parts[0] + "".join(next(replacements) + part for part in parts[1:])


@functools.lru_cache(maxsize=2)
def hf_thinker(path: str):
    """transformers' thinker of the checkpoint at ``path`` (float32, eval mode), loaded once."""
    import torch
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _expanded(text: str, token: str, counts) -> str:
    parts = text.split(token)
    return parts[0] + "".join(token * next(counts) + part for part in parts[1:])
