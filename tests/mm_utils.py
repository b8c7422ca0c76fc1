"""A tiny random LLaVA checkpoint (CLIP vision tower + Llama decoder) for the multimodal tests."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
"""Placeholder tokens per image: one per patch (the CLS feature is dropped)."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def make_tiny_llava(path: str | os.PathLike[str], seed: int = 0, tower: str = "clip") -> str:
    """Save a tiny random ``LlavaForConditionalGeneration`` with its processor in ``path``: a CLIP tower (its CLS
    feature dropped), or ``tower="siglip"``: llava-interleave's SigLIP tower (every patch's feature of the last
    layer, ``"full"``; its pooling head saved, as transformers writes it)."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    tokenizer.chat_template = CHAT_TEMPLATE
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    if tower == "siglip":
        vision, layer, strategy, class_rows = SiglipVisionConfig(**shape), -1, "full", 0
        image_processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    else:
        vision, layer, strategy, class_rows = CLIPVisionConfig(**shape, projection_dim=32), -2, "default", 1
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        vision_feature_layer=layer, vision_feature_select_strategy=strategy, image_seq_length=NUM_IMAGE_TOKENS,
    )
    random_model(LlavaForConditionalGeneration, config, seed).save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy=strategy, image_token=IMAGE_TOKEN, num_additional_image_tokens=class_rows,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return str(path)


GRID_PINPOINTS = [[56, 112], [112, 56], [112, 112], [56, 168]]
"""The tiny LLaVA-NeXT's anyres grids (tiles of 56): 1x2, 2x1, 2x2 and 1x3."""


def make_tiny_llava_next(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``LlavaNextForConditionalGeneration`` (the tiny LLaVA's tower and decoder, anyres tiles of
    56 pixels over `GRID_PINPOINTS`) with its processor in ``path``."""
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    base = Path(make_tiny_llava(Path(path) / "base", seed))
    llava = AutoConfig.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    config = LlavaNextConfig(
        vision_config=llava.vision_config, text_config=llava.text_config, image_token_index=llava.image_token_id,
        vision_feature_layer=-2, vision_feature_select_strategy="default", image_grid_pinpoints=GRID_PINPOINTS,
    )
    random_model(LlavaNextForConditionalGeneration, config, seed).save_pretrained(path)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=GRID_PINPOINTS,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return str(path)


def make_tiny_llava_onevision(path: str | os.PathLike[str], seed: int = 0, aspect: str = "anyres_max_9") -> str:
    """Save a tiny random ``LlavaOnevisionForConditionalGeneration`` (a SigLIP tower of 56-pixel tiles, a Qwen2
    decoder, `GRID_PINPOINTS`, ``vision_aspect_ratio=aspect``) with its processor in ``path``."""
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessorPil,
        Qwen2Config,
        SiglipVisionConfig,
    )

    base = Path(make_tiny_llava(Path(path) / "base", seed))
    llava = AutoConfig.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    text = Qwen2Config(**{k: getattr(llava.text_config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False)
    config = LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=llava.image_token_id, vision_feature_layer=-1,
        vision_feature_select_strategy="full", image_grid_pinpoints=GRID_PINPOINTS, vision_aspect_ratio=aspect,
    )
    random_model(LlavaOnevisionForConditionalGeneration, config, seed).save_pretrained(path)
    LlavaOnevisionImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                    image_grid_pinpoints=GRID_PINPOINTS).save_pretrained(path)
    tokenizer.save_pretrained(path)  # no LlavaOnevisionProcessor: its video processor needs torchvision
    return str(path)


def hf_onevision_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for LLaVA-OneVision: ``<image>`` expanded by
    ``LlavaOnevisionProcessor``'s own count (its methods, without the video processor it cannot build here)."""
    import torch
    from PIL import Image
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoTokenizer,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionProcessor,
    )

    config, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    counter = object.__new__(LlavaOnevisionProcessor)  # only its feature-count methods are used
    counter.image_processor = AutoImageProcessor.from_pretrained(path)
    counter.num_image_tokens, counter.vision_aspect_ratio = NUM_IMAGE_TOKENS, config.vision_aspect_ratio
    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
    pixels = counter.image_processor(images=pil, return_tensors="pt")
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    image_id, expanded, sizes = config.image_token_id, [], iter(pixels["image_sizes"].tolist())
    for token in ids:
        count = counter._get_number_of_features(*next(sizes), IMAGE_SIZE, IMAGE_SIZE) if token == image_id else 1
        expanded += [token] * count
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([expanded]), pixel_values=pixels["pixel_values"],
                             image_sizes=pixels["image_sizes"], max_new_tokens=max_new_tokens, do_sample=False)
    return expanded, out[0, len(expanded):].tolist()


IDEFICS3_SPECIALS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                     *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]


def make_tiny_idefics3(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``Idefics3ForConditionalGeneration`` (tiles of 56 pixels, up to 2 x 2 of them plus the whole
    image; 4 features a tile) with its processor in ``path``."""
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
    )
    from transformers import AutoConfig

    base = Path(make_tiny_llava(Path(path) / "base", seed))
    llava = AutoConfig.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, *IDEFICS3_SPECIALS]})
    text = llava.text_config
    text.vocab_size = len(tokenizer)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    random_model(Idefics3ForConditionalGeneration, config, seed).save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                                                max_image_size={"longest_edge": IMAGE_SIZE})
    Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                      chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return str(path)


def make_tiny_smolvlm(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``SmolVLMForConditionalGeneration`` (the tiny Idefics3's shapes) with its image processor
    and tokenizer in ``path`` (no SmolVLMProcessor: its video processor needs torchvision)."""
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessorPil,
        SmolVLMVisionConfig,
    )

    idefics3 = Path(make_tiny_idefics3(Path(path) / "idefics3", seed))
    reference = AutoConfig.from_pretrained(idefics3)
    vision = SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = SmolVLMConfig(vision_config=vision, text_config=reference.text_config, scale_factor=2,
                           image_token_id=reference.image_token_id)
    random_model(SmolVLMForConditionalGeneration, config, seed).save_pretrained(path)
    SmolVLMImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
                             do_image_splitting=True).save_pretrained(path)
    AutoTokenizer.from_pretrained(idefics3).save_pretrained(path)
    return str(path)


def random_model(model_cls, config, seed: int, std: float = 0.2):
    """``model_cls(config)`` with seeded random weights wider than transformers' initialisation (norm scales
    N(0, 1), the rest N(0, ``std``)), so that greedy outputs do not hinge on rounding noise."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 1.0 if "norm" in name and name.endswith("weight") else std)
    return model


def processor_inputs(processor, text: str, images: list[bytes], add_special_tokens: bool = True) -> Any:
    """A transformers processor's tensors for ``text`` and encoded ``images`` (opened as RGB PIL images)."""
    from PIL import Image

    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
    return processor(text=text, images=pil or None, return_tensors="pt", add_special_tokens=add_special_tokens)


def expand_image_tokens(processor_cls: Any, processor: Any, text: str, images: list[bytes]) -> tuple[str, dict]:
    """``text`` with each ``processor.image_token`` expanded by ``processor_cls.replace_image_token`` (GLM-4.1V's,
    ERNIE 4.5 VL's: their processors' own expansion, run over a stand-in ``processor`` holding the checkpoint's
    image processor and ids), and the image processor's inputs ({} without images)."""
    from PIL import Image

    if not images:
        return text, {}
    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
    inputs = dict(processor.image_processor(images=pil, return_tensors="pt"))
    parts = text.split(processor.image_token)
    return parts[0] + "".join(processor_cls.replace_image_token(processor, inputs, i) + part
                              for i, part in enumerate(parts[1:])), inputs


def hf_generate(model, inputs, max_new_tokens: int, adapter: str | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers' image-text ``model`` for processed ``inputs``, wrapped in the
    PEFT ``adapter`` when one is given."""
    import torch

    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


def make_image(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels (so different seeds differ)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def hf_llava_greedy(path: str, text: str | None, images: list[bytes], max_new_tokens: int,
                    messages: list | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with ``<image>`` markers (or chat messages); LLaVA or
    LLaVA-NeXT, as the checkpoint says. The images go in as opened, in their own mode: the processor makes them RGB
    (transparency onto white)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    if messages is not None:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(image)) for image in images]
    inputs = processor(text=text, images=pil or None, return_tensors="pt", add_special_tokens=messages is None)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


class _Recorder:
    """Wraps a processor's msgpack encoder: every AddRequest sent, with its encoded size."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.sent: list[tuple[Any, int]] = []

    def encode(self, message: object) -> bytes:
        from asyncllm.protocol import AddRequest

        data = self.encoder.encode(message)
        if isinstance(message, AddRequest):
            self.sent.append((message, len(data)))
        return data


def sent_requests(engine: Any) -> list[tuple[Any, int]]:
    """The (AddRequest, encoded bytes) the engine's processor sent to the core since this was first called."""
    processor = engine._processor
    assert processor is not None
    if not isinstance(processor._encoder, _Recorder):
        processor._encoder = _Recorder(processor._encoder)
    return processor._encoder.sent


def laid_short(item: Any) -> Any:
    """``item`` over one placeholder fewer than its features (`items_altered`)."""
    import msgspec

    return msgspec.structs.replace(item, length=item.length - 1)


@contextlib.contextmanager
def items_altered(engine: Any, alter: Callable[[Any], Any] = laid_short) -> Iterator[None]:
    """While open, the engine's processor sends each request's last multimodal item as ``alter`` makes it (as a
    buggy or hostile host process sharing the core might): the workers must fail that request alone."""
    processor = engine._processor
    real = processor._encoder

    class _Shorten:
        def encode(self, message: Any) -> bytes:
            items = getattr(message, "mm_items", None)
            if items:
                message.mm_items = [*items[:-1], alter(items[-1])]
            return real.encode(message)

    processor._encoder = _Shorten()
    try:
        yield
    finally:
        processor._encoder = real
