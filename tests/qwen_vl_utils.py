"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (vision tower + Qwen2 decoder with M-RoPE) for the tests."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mm_utils import make_image, random_model

__all__ = ["IMAGE_PAD", "IMAGE_PLACEHOLDER", "VIDEO_PAD", "VIDEO_PLACEHOLDER", "make_image", "make_tiny_qwen_vl",
           "make_mp4", "make_video", "video_patches_of", "hf_qwen_vl_greedy", "hf_qwen_vl_inputs", "hf_qwen_vl_video_greedy", "load_tower",
           "random_patches"]

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
"""What a prompt holds per image (the checkpoint's chat template renders the same)."""
VIDEO_PAD = "<|video_pad|>"
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)



def make_tiny_qwen_vl(path: str | os.PathLike[str], version: str = "2", seed: int = 0, num_layers: int = 2) -> str:
    """Save a tiny random ``Qwen2VLForConditionalGeneration`` (``version="2"``),
    ``Qwen2_5_VLForConditionalGeneration`` (``"2.5"``), ``Qwen3VLForConditionalGeneration`` (``"3"``) or
    ``Qwen3VLMoeForConditionalGeneration`` (``"3-moe"``), ``Qwen3_5ForConditionalGeneration`` (``"3.5"``) or
    ``Qwen3_5MoeForConditionalGeneration`` (``"3.5-moe"``) with its tokenizer and image processor in ``path``
    (``num_layers`` decoder layers: Qwen3.5's alternate Gated DeltaNet and attention)."""
    from transformers import AutoTokenizer

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END,
                                                                "<|video_pad|>", "<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (VISION_START, IMAGE_PAD, VISION_END,
                                                                        "<|video_pad|>")}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    common = dict(image_token_id=ids[IMAGE_PAD], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END])
    model_cls, config = _configs(version, text, common)
    random_model(model_cls, config, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor(patch_size=16 if version.startswith("3") else 14).save_pretrained(path)
    _save_video_settings(path, patch_size=16 if version.startswith("3") else 14)
    return str(path)


def _save_video_settings(path: Path, patch_size: int) -> None:
    """The checkpoint's ``video_preprocessor_config.json`` (written by hand: transformers' video processors need
    torchvision) with the tests' bounds: 4 to 64 merged tokens per frame (Qwen3-VL: over all the frames)."""
    import json

    unit = (2 * patch_size) ** 2
    (path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 4 * unit, "longest_edge": 64 * unit}, "patch_size": patch_size,
         "temporal_patch_size": 2, "merge_size": 2}))


def make_mp4(frames: int, width: int = 64, height: int = 48) -> bytes:
    """An mpeg4 video file of ``frames`` grey frames at 10 fps, frame i of grey level 12 i mod 256 (PyAV)."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), i * 12 % 256, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def make_video(frames: int, width: int, height: int, seed: int):
    """A random ``[frames, height, width, 3]`` uint8 video."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def _configs(version: str, text: dict, common: dict):
    if version in ("3.5", "3.5-moe"):  # the hybrid decoder (a Gated DeltaNet layer, then gated attention), no deepstack
        import transformers

        pairs = text["num_hidden_layers"] // 2
        text = {**text, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"] * pairs,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                                                                "partial_rotary_factor": 0.5,
                                                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
        if version == "3.5-moe":  # hidden 64 != 2 x 24: fused experts' two layouts differ in shape
            text = {**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                    "shared_expert_intermediate_size": 32}
        name = "Qwen3_5" if version == "3.5" else "Qwen3_5Moe"
        config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=vision, **common)
        return getattr(transformers, f"{name}ForConditionalGeneration"), config
    if version in ("3", "3-moe"):
        import transformers

        text = {**text, "head_dim": 16, "rope_parameters": {**text["rope_parameters"], "mrope_interleaved": True}}
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0, 1])
        name = "Qwen3VL" if version == "3" else "Qwen3VLMoe"
        if version == "3-moe":  # hidden 64 != 2 x 16: the fused experts' two layouts differ in shape
            text = {**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "decoder_sparse_step": 1}
        config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=vision, **common)
        return getattr(transformers, f"{name}ForConditionalGeneration"), config
    if version == "2":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, in_channels=3,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        return Qwen2VLForConditionalGeneration, Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, in_channels=3, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1])
    return Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)


def image_processor(path: str | os.PathLike[str] | None = None, patch_size: int = 14, **overrides):
    """The checkpoint's image processor (the PIL one: no torchvision here), or a new one with the tests' bounds
    (4 to 64 merged tokens per image; Qwen3-VL's patches are 16 pixels).

    No ``Qwen2VLProcessor`` is saved: it needs a video processor, which needs torchvision.
    """
    from transformers import AutoImageProcessor, Qwen2VLImageProcessorPil

    if path is not None and (Path(path) / "preprocessor_config.json").exists():
        return AutoImageProcessor.from_pretrained(path, **overrides)
    unit = (2 * patch_size) ** 2
    return Qwen2VLImageProcessorPil(min_pixels=4 * unit, max_pixels=64 * unit, patch_size=patch_size)


def hf_qwen_vl_inputs(path: str, text: str, images: list[bytes], add_special_tokens: bool = True,
                      processor_kwargs: dict | None = None) -> dict:
    """transformers' model inputs for ``text`` with one `IMAGE_PLACEHOLDER` per image (what its processor makes:
    each ``<|image_pad|>`` repeated once per merged patch)."""
    from PIL import Image
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs = dict(image_processor(path, **(processor_kwargs or {}))(images=pil, return_tensors="pt"))
        counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
        text = _expand(text, counts)
    inputs["input_ids"] = tokenizer([text], return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"]
    # what the processor marks (1: image) and the model's M-RoPE positions need: without it, 1-D positions
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == tokenizer.convert_tokens_to_ids(IMAGE_PAD)).int()
    return inputs


def _expand(text: str, counts) -> str:
    parts = text.split(IMAGE_PAD)
    return parts[0] + "".join(IMAGE_PAD * next(counts) + part for part in parts[1:])


def hf_qwen_vl_greedy(path: str, text: str | None, images: list[bytes], max_new_tokens: int,
                      messages: list | None = None, processor_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with image placeholders (or chat messages)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    if messages is not None:
        text = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False)
    inputs = hf_qwen_vl_inputs(path, text, images, add_special_tokens=messages is None,  # a template has its own
                               processor_kwargs=processor_kwargs)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


def load_tower(tower, weights: dict):
    """``tower`` (eval mode) with each checkpoint tensor loaded through its parameter's weight loader, as a model's
    loader does; the names must be the checkpoint's, nothing extra, nothing missing."""
    from asyncllm.models.layers import default_weight_loader

    params = dict(tower.named_parameters())
    assert params.keys() == weights.keys()
    for name, tensor in weights.items():
        getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor)
    return tower.eval()


def random_patches(grids: list[tuple[int, int, int]], width: int, seed: int = 1):
    """Random processor-shaped pixel values ``[patches, width]`` for images of these (t, h, w) grids."""
    import torch

    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, width, generator=torch.Generator().manual_seed(seed))


def hf_qwen_vl_video_greedy(path: str, prompt_ids: list[int], videos: list, images: list[bytes],
                            max_new_tokens: int, seconds_per_grid: list[float] | None = None) -> list[int]:
    """transformers' greedy tokens for expanded ``prompt_ids`` with these videos' pixel values (``(t, h, w,
    features)`` arrays: transformers' video processor needs torchvision) and images (its image processor).

    ``seconds_per_grid`` (Qwen2-VL and Qwen2.5-VL): each video's seconds per temporal patch; then the positions are
    the Qwen rule's, given to transformers (`qwen_rope_positions`)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([prompt_ids])
    inputs: dict = {"input_ids": ids}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs.update(image_processor(path)(images=pil, return_tensors="pt"))
    inputs["pixel_values_videos"] = torch.from_numpy(np.concatenate([v.reshape(-1, v.shape[-1]) for v in videos]))
    inputs["video_grid_thw"] = torch.tensor([list(v.shape[:3]) for v in videos])
    if seconds_per_grid is not None and hasattr(AutoConfig.from_pretrained(path).vision_config, "tokens_per_second"):
        inputs["second_per_grid_ts"] = torch.tensor(seconds_per_grid)
    inputs["mm_token_type_ids"] = ((ids == tokenizer.convert_tokens_to_ids(IMAGE_PAD)).int()
                                   + 2 * (ids == tokenizer.convert_tokens_to_ids(VIDEO_PAD)).int())
    if seconds_per_grid is not None:  # the Qwen rule's positions, given (see qwen_rope_positions)
        per_second = getattr(AutoConfig.from_pretrained(path).vision_config, "tokens_per_second", None)
        intervals = [1.0 if per_second is None else float(np.float32(per_second) * np.float32(s))
                     for s in seconds_per_grid]
        inputs["position_ids"] = qwen_rope_positions(
            prompt_ids, tokenizer.convert_tokens_to_ids(IMAGE_PAD), tokenizer.convert_tokens_to_ids(VIDEO_PAD),
            inputs.get("image_grid_thw", torch.zeros(0, 3)).tolist(), inputs["video_grid_thw"].tolist(), intervals)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def qwen_rope_positions(prompt_ids: list[int], image_pad: int, video_pad: int, image_grids: list, video_grids: list,
                        video_intervals: list[float], merge: int = 2):
    """``[4, 1, L]`` position ids by the Qwen models' own rule (transformers' ``get_rope_index`` up to 5.2, vLLM's):
    row 0 the token index, rows 1-3 M-RoPE's, the text after an image or video starting at its largest position +
    1 (transformers >= 5.3 starts it at ``max(h, w) / merge`` past the video's start instead, and ``generate``
    continues from the last prompt position: given these, it continues from their last + 1)."""
    import torch

    images, videos = iter(image_grids), iter(zip(video_grids, video_intervals))
    out = torch.zeros(3, len(prompt_ids), dtype=torch.long)
    index = position = 0
    while index < len(prompt_ids):
        token = prompt_ids[index]
        if token not in (image_pad, video_pad):
            out[:, index] = position
            index, position = index + 1, position + 1
            continue
        (t, h, w), interval = (next(images), 1.0) if token == image_pad else next(videos)
        rows, cols = h // merge, w // merge
        time = (torch.arange(t, dtype=torch.float32) * torch.tensor(interval, dtype=torch.float32)).long()
        grid = torch.stack(torch.meshgrid(time, torch.arange(rows), torch.arange(cols), indexing="ij")).reshape(3, -1)
        out[:, index : index + grid.shape[1]] = grid + position
        position = int(out[:, index : index + grid.shape[1]].max()) + 1
        index += grid.shape[1]
    return torch.cat([torch.arange(len(prompt_ids))[None], out])[:, None, :]


def video_patches_of(path: str, video):
    """A video's pixel values as the engine makes them for the checkpoint at ``path`` (checked against
    transformers' image processor in tests/unit/test_qwen_video.py)."""
    from transformers import AutoConfig

    from asyncllm.mm.qwen_video import load_video_settings, video_patches
    from asyncllm.mm.videos import read_video
    from asyncllm.models.registry import get_model_class

    settings = load_video_settings(path, get_model_class(AutoConfig.from_pretrained(path)).video_settings)
    return video_patches(read_video(video, "video", 10**8), settings, "video")
