"""Gemma 3n (asyncllm/models/gemma3n.py) against transformers' forward, over a paged KV cache.

The tiny E2B-style model (asyncllm.tiny ``gemma3n``): four AltUp streams, LAuReL, per-layer inputs from a table
shorter than the vocabulary, the first two layers' MLP gates sparsified, MLP widths per layer, sliding and global
layers, the last two sharing the first two's caches, capped logits. Three requests of 12 to 27 tokens (past the
8-token window) run as chunked prefills mixed with decodes; every position's float32 logits must match
transformers' within 1e-4. An image-text-audio checkpoint serves its language model for text.
"""

from __future__ import annotations

import pathlib

import torch
from hf_reference import hf_logits
from model_utils import PagedRun, assert_paged_logits_match_checkpoint
from safetensors.torch import load_file, save_file

from asyncllm.config import EngineConfig
from asyncllm.models.gemma3n import Gemma3nForCausalLM, Gemma3nTextOnly
from asyncllm.models.gemma4 import kv_cache_layout
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 20, 27]
CHUNKED = [[5, 9, 0], [4, 9, 16], [1, 1, 9], [1, 1, 1], [1, 0, 1]]


def _load(path: str, **fields):
    return load_model(EngineConfig.create(path, **fields), load_hf_config(path), torch.device("cpu"), torch.float32)


def test_logits_match_transformers() -> None:
    path = tiny_checkpoint("gemma3n")
    model = _load(path)
    assert type(model) is Gemma3nForCausalLM
    assert_paged_logits_match_checkpoint(model, path, SEQ_LENS, CHUNKED, seed=3, atol=1e-4)


def test_structure_and_kv_cache_layout() -> None:
    """What the tiny config asks for reaches the layers: two caches for four layers, the last two sharing the
    first two's (and computing no keys or values), the per-layer MLP widths, sparse gates on the first two, four
    streams, unscaled attention, ids past the per-layer table, the tied LM head."""
    path = tiny_checkpoint("gemma3n")
    hf_config = load_hf_config(path)
    model = _load(path)
    layout = kv_cache_layout(hf_config)
    assert layout.cache_of_layer == (0, 1, 0, 1) and layout.shares == (False, False, True, True)
    assert kv_cache_spec(hf_config, 1).shapes() == [(2, 16), (2, 16)]
    layers = model.model.layers
    assert not hasattr(layers[2].self_attn, "qkv_proj") and hasattr(layers[2].self_attn, "q_proj")
    assert [layer.mlp.down_proj.weight.shape[1] for layer in layers] == [128, 128, 96, 96]
    assert [layer.mlp.sparse for layer in layers] == [True, True, False, False]
    assert abs(layers[0].mlp.std_multiplier - 1.6448536) < 1e-6  # the 95th percentile of a standard normal
    assert len(model.model.altup_projections) == 3 and len(model.model.altup_unembed_projections) == 3
    assert [a.self_attn.attn.sliding_window for a in layers] == [8, None, 8, None]
    assert all(a.self_attn.attn.scale == 1.0 for a in layers)
    assert model.model.per_layer_vocab == 300 < hf_config.vocab_size
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_image_text_audio_checkpoint_serves_its_language_model(tmp_path) -> None:
    """``Gemma3nForConditionalGeneration`` (the releases' architecture) in language-model-only mode
    (``limit_mm_per_prompt={"image": 0}``; audio: tests/engine/test_gemma3n_audio_engine.py): its language model under
    ``model.language_model.``, its towers' tensors left unread; logits equal transformers' text model's."""
    import transformers

    text_path = tiny_checkpoint("gemma3n")
    config = transformers.Gemma3nConfig(text_config=load_hf_config(text_path).to_dict(),
                                        architectures=["Gemma3nForConditionalGeneration"])
    config.save_pretrained(tmp_path)
    weights = {name.replace("model.", "model.language_model.", 1): tensor
               for name, tensor in load_file(f"{text_path}/model.safetensors").items()}
    towers = ("model.vision_tower.timm_model.conv_stem.conv.weight", "model.audio_tower.conformer.0.ffw_layer_start"
              ".ffw_layer_1.weight", "model.embed_vision.embedding.weight", "model.embed_audio.embedding.weight")
    weights.update({name: torch.zeros(2, 2) for name in towers})
    save_file(weights, str(tmp_path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((pathlib.Path(text_path) / name).read_bytes())
    model = _load(str(tmp_path), limit_mm_per_prompt={"image": 0})
    assert type(model) is Gemma3nTextOnly
    tokens = list(range(290, 317))  # some past the per-layer table's 300 rows
    run = PagedRun(model, [tokens], block_size=4)
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(str(tmp_path)), 1), torch.float32)
    (logits,) = run.run([[20], [7]])
    torch.testing.assert_close(logits, hf_logits(text_path, tokens), atol=1e-4, rtol=0)
