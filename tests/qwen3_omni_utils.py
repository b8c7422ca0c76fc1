"""A tiny random Qwen3-Omni thinker (Qwen3-VL's vision tower with deepstack, its audio encoder, the Qwen3-MoE decoder
with interleaved M-RoPE), the full ``Qwen3OmniMoeForConditionalGeneration`` layout of it, and transformers' greedy
tokens."""

from __future__ import annotations

import functools
import io
import os

from qwen2_5_omni_utils import _expanded, _replaced, make_full_omni_layout, save_tiny_thinker, video_inputs

IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"
AUDIO_MARK = "<|audio_start|><|audio_pad|><|audio_end|>"
_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|audio_start|>", "<|audio_pad|>",
           "<|audio_end|>", "<|video_pad|>"]
_SPEECH_TENSORS = {"talker.model.codec_embedding.weight": (8, 4), "code2wav.pre_transformer.norm.weight": (4,)}
"""Stand-ins for the full checkpoint's speech-out parts, which the engine must skip."""
N_WINDOW = 50
"""The audio encoder's half chunk, as released: transformers counts 13 rows per whole chunk of 100 frames."""


def _thinker_config(tokenizer):
    from transformers import Qwen3OmniMoeThinkerConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3],
                                 "interleaved": True},
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, out_hidden_size=64,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, n_window=N_WINDOW, n_window_infer=200, max_source_positions=1500,
                 downsample_hidden_size=8)
    return Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, image_token_id=ids["<|image_pad|>"],
        audio_token_id=ids["<|audio_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], audio_start_token_id=ids["<|audio_start|>"],
        audio_end_token_id=ids["<|audio_end|>"], position_id_per_seconds=13)


def make_tiny_qwen3_omni(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``Qwen3OmniMoeThinkerForConditionalGeneration`` with its tokenizer, one
    ``preprocessor_config.json`` holding both its image processor and its 16-bin Whisper feature extractor (as the
    released checkpoints do) and the Qwen-VL tests' video settings in ``path``."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    return save_tiny_thinker(path, Qwen3OmniMoeThinkerForConditionalGeneration, _thinker_config, _TOKENS, seed, 16)


def make_full_omni3_layout(thinker: str, path: str | os.PathLike[str]) -> str:
    """The thinker at ``thinker`` saved as a ``Qwen3OmniMoeForConditionalGeneration`` checkpoint (speech out enabled,
    as released), beside stand-in talker and code2wav tensors."""
    return make_full_omni_layout(thinker, path, "Qwen3OmniMoeForConditionalGeneration", "qwen3_omni_moe",
                                 _SPEECH_TENSORS)


def audio_features(path: str, audios: list) -> dict:
    """The checkpoint's feature extractor called as transformers' ``Qwen3OmniMoeProcessor`` does (each audio whole,
    padded to the longest, with its frame mask), numpy."""
    from audio_utils import SAMPLING_RATE
    from transformers import AutoFeatureExtractor

    return AutoFeatureExtractor.from_pretrained(path)(audios, sampling_rate=SAMPLING_RATE, padding=True,
                                                      truncation=False, return_attention_mask=True,
                                                      return_tensors="np")


def audio_rows(frames: int) -> int:
    """transformers' placeholder count of an audio of ``frames`` mel frames (13 per whole chunk of 100)."""
    tail = frames % (2 * N_WINDOW)
    rows = (tail - 1) // 2 + 1
    return ((rows - 1) // 2 + 1 - 1) // 2 + 1 + frames // (2 * N_WINDOW) * 13


def hf_audio_in_video_text3(grid: list[int], seconds_per_grid: float, audio_rows: int) -> str:
    """transformers' ``Qwen3OmniMoeProcessor.replace_video_with_audio_token``'s text for a video of ``grid`` patches
    and its track of ``audio_rows`` placeholders (the processor's own ``position_id_per_seconds``, 13)."""
    from types import SimpleNamespace

    from transformers import Qwen3OmniMoeProcessor

    processor = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2), audio_bos_token="<|audio_start|>",
                                audio_eos_token="<|audio_end|>", video_token="<|video_pad|>", audio_token="<|audio_pad|>")
    return Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        processor, {"video_grid_thw": [grid], "video_second_per_grid": [seconds_per_grid]}, 0,
        {"num_audio_tokens": [audio_rows]}, 0, position_id_per_seconds=Qwen3OmniMoeProcessor.position_id_per_seconds)


def hf_omni3_greedy(path: str, text: str, images: list[bytes], audios: list, max_new_tokens: int,
                    videos: list = (), seconds_per_grid: list[float] = (),
                    audio_in_video: bool = False) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for ``text`` with one `IMAGE_MARK` per image, one `AUDIO_MARK` per
    16 kHz waveform and one `VIDEO_MARK` per video (its ``(t, h, w, features)`` patches, the engine's; its
    ``seconds_per_grid``), expanded as its ``Qwen3OmniMoeProcessor`` does (no processor is saved: it needs a video
    processor, which needs torchvision). ``audio_in_video``: ``audios`` are the videos' tracks, in order, merged
    with them by the processor's ``replace_video_with_audio_token``."""
    import torch
    from PIL import Image
    from qwen_vl_utils import image_processor
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs.update(image_processor(path)(images=pil, return_tensors="pt"))
        text = _expanded(text, "<|image_pad|>", iter((inputs["image_grid_thw"].prod(-1) // 4).tolist()))
    if audios:
        features = audio_features(path, audios)
        inputs["input_features"] = torch.from_numpy(features["input_features"])
        inputs["feature_attention_mask"] = torch.from_numpy(features["attention_mask"])
        rows = [audio_rows(int(n)) for n in features["attention_mask"].sum(-1)]
        text = text if audio_in_video else _expanded(text, "<|audio_pad|>", iter(rows))
    if videos and audio_in_video:
        video_inputs(inputs, text, "<|video_pad|>", videos, seconds_per_grid)
        text = _replaced(text, "<|video_pad|>", (hf_audio_in_video_text3(list(v.shape[:3]), seconds, n)
                                                 for v, seconds, n in zip(videos, seconds_per_grid, rows)))
    elif videos:
        text = video_inputs(inputs, text, "<|video_pad|>", videos, seconds_per_grid)
    ids = tokenizer([text], return_tensors="pt")["input_ids"]
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        out = hf_thinker3(path).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                         use_audio_in_video=audio_in_video)
    prompt_ids = ids[0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


@functools.lru_cache(maxsize=2)
def hf_thinker3(path: str):
    """transformers' thinker of the checkpoint at ``path`` (float32, eval mode), loaded once."""
    import torch
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    return Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
