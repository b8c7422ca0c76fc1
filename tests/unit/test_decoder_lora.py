"""`DecoderLoRA`: the one way an image- or audio-text model's decoder takes LoRA adapters (no model loaded)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from asyncllm.engine.prepare import LORA_MULTIMODAL_ARCHITECTURES
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.llama4 import Llama4ForConditionalGeneration
from asyncllm.models.llava import LlavaForConditionalGeneration
from asyncllm.models.paligemma import PaliGemmaForConditionalGeneration
from asyncllm.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration
from asyncllm.models.registry import _MODELS


def test_every_image_and_audio_text_model_taking_adapters_takes_them_through_decoder_lora() -> None:
    """Each multimodal architecture that takes adapters but Whisper (its cross-attention's names: its own hooks) is a
    `DecoderLoRA`, and none of its classes copies the decoder's fused projections."""
    archs = [arch for arch in LORA_MULTIMODAL_ARCHITECTURES if arch != "WhisperForConditionalGeneration"]
    assert len(archs) > 30
    for arch in archs:
        cls = _MODELS[arch]
        assert issubclass(cls, DecoderLoRA), arch
        assert inspect.getattr_static(cls, "packed_modules") is DecoderLoRA.__dict__["packed_modules"], arch


def _model(cls: type) -> SimpleNamespace:
    """``cls``'s hooks over a Llama decoder (its q/k/v and gate/up fused), without building either."""
    decoder = SimpleNamespace(packed_modules=LlamaForCausalLM.packed_modules)
    decoder._packed = lambda name: LlamaForCausalLM._packed(decoder, name)
    return SimpleNamespace(language_model=decoder, normalize_name=cls.normalize_name)


QKV = "language_model.model.layers.0.self_attn.qkv_proj.weight"


@pytest.mark.parametrize("wrapper, name, expected", [
    (LlavaForConditionalGeneration, "model.layers.0.self_attn.k_proj.weight", (QKV, "k")),  # an adapter's name
    (Llama4ForConditionalGeneration, "model.layers.0.mlp.up_proj.weight",
     ("language_model.model.layers.0.mlp.gate_up_proj.weight", 1)),
    (Qwen2VLForConditionalGeneration, "model.layers.0.self_attn.v_proj.weight", (QKV, "v")),
    (Qwen2VLForConditionalGeneration, "model.language_model.layers.0.self_attn.q_proj.bias",  # a checkpoint's
     ("language_model.model.layers.0.self_attn.qkv_proj.bias", "q")),
    (Qwen2VLForConditionalGeneration, "visual.blocks.0.attn.qkv.weight", ("visual.blocks.0.attn.qkv.weight", None)),
    (Qwen2AudioForConditionalGeneration, "language_model.model.layers.0.self_attn.k_proj.bias",
     ("language_model.model.layers.0.self_attn.qkv_proj.bias", "k")),
    (Qwen2AudioForConditionalGeneration, "model.language_model.layers.0.self_attn.k_proj.bias",  # transformers 5's
     ("language_model.model.layers.0.self_attn.qkv_proj.bias", "k")),
    (Qwen2AudioForConditionalGeneration, "model.layers.0.mlp.up_proj.weight",  # an adapter's
     ("language_model.model.layers.0.mlp.gate_up_proj.weight", 1)),
    (Qwen2AudioForConditionalGeneration, "lm_head.weight", ("language_model.lm_head.weight", None)),
    (Qwen2AudioForConditionalGeneration, "audio_tower.layers.0.fc1.weight",
     ("audio_tower.layers.0.fc1.weight", None)),
    (PaliGemmaForConditionalGeneration, "model.layers.0.self_attn.q_proj.weight", (QKV, "q")),
    (PaliGemmaForConditionalGeneration, "vision_tower.vision_model.embeddings.patch_embedding.weight",
     ("vision_tower.embeddings.patch_embedding.weight", None)),
])
def test_packed_maps_adapter_and_checkpoint_names_into_the_decoder(wrapper: type, name: str, expected: tuple) -> None:
    """An adapter's decoder name lands under ``language_model.`` in every wrapper; a wrapper whose `_packed` reads its
    checkpoint's names too (quantized checkpoints' biases) maps them as its loader does, a tower's left as they are."""
    assert wrapper._packed(_model(wrapper), name) == expected
