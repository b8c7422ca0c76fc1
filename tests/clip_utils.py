"""Tiny random ``CLIPModel`` and ``SiglipModel`` checkpoints (text and vision towers, their heads) and
transformers' embeddings of them."""

from __future__ import annotations

import io
import os
from pathlib import Path

IMAGE_SIZE = 32


def make_tiny_clip(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``CLIPModel`` (text hidden 48, vision hidden 32, projection 24: three widths, so a mixed-up
    one fails) with the shipped tiny Llama's tokenizer and a CLIP image processor in ``path``."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessorPil, CLIPModel

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    text = dict(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=40, hidden_act="quick_gelu",
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=8, hidden_act="quick_gelu")
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    torch.manual_seed(seed)
    model = CLIPModel(config)
    _jitter_norms(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                          crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    return str(path)


def make_tiny_siglip(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``SiglipModel`` (text hidden 48 with its head to 32, the vision width; the attention-pooling
    head) with the shipped tiny Llama's tokenizer and a SigLIP image processor in ``path``."""
    import torch
    from transformers import AutoTokenizer, SiglipConfig, SiglipImageProcessorPil, SiglipModel

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    text = dict(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=40, projection_size=32,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=8)
    torch.manual_seed(seed)
    model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
    _jitter_norms(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    return str(path)


def _jitter_norms(model) -> None:
    """LayerNorms (and the pooling probe) away from their initial values, so a missed one shows."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "probe" in name:
                param.add_(torch.randn_like(param) * 0.2)


def hf_text_rows(path: str, token_ids: list[int]):
    """transformers' projected final hidden state of every row of ``token_ids`` (``text_projection`` over the text
    model's ``last_hidden_state``) and its ``get_text_features`` pooled output, float32."""
    import torch
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        out = model.text_model(input_ids=ids)
        return model.text_projection(out.last_hidden_state)[0], model.get_text_features(input_ids=ids).pooler_output[0]


def hf_image_embedding(path: str, image: bytes):
    """transformers' ``get_image_features`` of one encoded image, float32."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, CLIPModel

    model = CLIPModel.from_pretrained(path, dtype=torch.float32).eval()
    pixels = AutoImageProcessor.from_pretrained(path)(Image.open(io.BytesIO(image)), return_tensors="pt")
    with torch.no_grad():
        return model.get_image_features(pixel_values=pixels["pixel_values"]).pooler_output[0]


def hf_siglip_embeddings(path: str, token_ids: list[int] | None = None, image: bytes | None = None):
    """transformers' ``get_text_features`` of ``token_ids`` or ``get_image_features`` of ``image``, float32."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, SiglipModel

    model = SiglipModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        if token_ids is not None:
            return model.get_text_features(input_ids=torch.tensor([token_ids])).pooler_output[0]
        pixels = AutoImageProcessor.from_pretrained(path)(Image.open(io.BytesIO(image)), return_tensors="pt")
        return model.get_image_features(pixel_values=pixels["pixel_values"]).pooler_output[0]
