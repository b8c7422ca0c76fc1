"""Gemma (1), Gemma 2 and Gemma 3 (asyncllm/models/gemma.py) against transformers' forward, over a paged KV cache.

The tiny checkpoints (asyncllm.tiny) have a sliding window of 8 tokens on alternate layers, an attention
scale that is not ``head_dim ** -0.5``, Gemma 2's attention and final-logit caps, Gemma 3's two ropes;
three requests of 12 to 27 tokens run as chunked prefills mixed with decodes, and every position's float32
logits must match transformers' within 1e-4 (final-logit capping changes no argmax, so only logits show it).
"""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedRun, assert_paged_logits_match_checkpoint, randomize_
from model_utils import hf_logits as model_hf_logits

from asyncllm.config import EngineConfig
from asyncllm.models.gemma import Gemma1ForCausalLM
from asyncllm.models.gemma2 import Gemma2ForCausalLM
from asyncllm.models.gemma3 import Gemma3ForCausalLM, Gemma3TextOnly
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

ATOL = 1e-4
SEQ_LENS = [12, 20, 27]
CHUNKED = [[5, 9, 0], [4, 9, 16], [1, 1, 9], [1, 1, 1], [1, 0, 1]]
CLASSES = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def gemma(request):
    path = tiny_checkpoint(request.param)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    return request.param, path, hf_config, model


def test_logits_match_transformers(gemma):
    family, path, hf_config, model = gemma
    assert type(model) is CLASSES[family]
    assert_paged_logits_match_checkpoint(model, path, SEQ_LENS, CHUNKED, seed=5, atol=ATOL)


def test_gemma1_logits_match_transformers():
    """Gemma (1): two norms per layer, full attention, ``head_dim ** -0.5``, the scaled embeddings."""
    path = tiny_checkpoint("gemma")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    assert type(model) is Gemma1ForCausalLM
    assert float(model.model.embed_tokens.embed_scale) == pytest.approx(64**0.5)
    assert all(layer.self_attn.attn.scale == 16**-0.5 and layer.self_attn.attn.sliding_window is None
               for layer in model.model.layers)
    assert_paged_logits_match_checkpoint(model, path, SEQ_LENS, CHUNKED, seed=5, atol=ATOL)


def test_gemma_structure(gemma):
    """What the tiny configs ask for reaches the layers: windows, scale, caps, ropes, tied head."""
    family, _, hf_config, model = gemma
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.attn.sliding_window for a in attns] == [8, None]
    assert all(a.attn.scale == 32**-0.5 for a in attns)
    assert [a.attn.softcap for a in attns] == ([5.0, 5.0] if family == "gemma2" else [None, None])
    assert model.final_logit_softcapping == (30.0 if family == "gemma2" else None)
    assert ("model.layers.0.self_attn.q_norm.weight" in dict(model.named_parameters())) == (family == "gemma3")
    local, full = (a.rotary_emb.cos_sin_cache for a in attns)
    assert torch.equal(local, full) == (family == "gemma2")  # Gemma 3: local theta 1e4, global 1e6 scaled by 8
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert float(model.model.embed_tokens.embed_scale) == pytest.approx(hf_config.hidden_size**0.5)


def test_image_text_checkpoint_serves_text(tmp_path):
    """``Gemma3ForConditionalGeneration`` (a tiny SigLIP tower around the tiny Gemma 3) in language-model-only mode
    (``limit_mm_per_prompt`` of 0 images): its language model's logits for a text prompt equal transformers', the
    vision weights left unread."""
    import transformers

    text_config = load_hf_config(tiny_checkpoint("gemma3"))
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text_config.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_(hf_model, seed=3)
    hf_model.save_pretrained(tmp_path)
    hf_config = load_hf_config(str(tmp_path))
    text_only = EngineConfig.create(str(tmp_path), limit_mm_per_prompt={"image": 0})  # language-model-only mode
    model = load_model(text_only, hf_config, torch.device("cpu"), torch.float32)
    assert type(model) is Gemma3TextOnly
    assert type(load_model(EngineConfig.create(str(tmp_path)), hf_config, torch.device("cpu"),
                           torch.float32)).__name__ == "Gemma3ForConditionalGeneration"
    spec = kv_cache_spec(hf_config, 1)
    sequences = [list(range(10, 31)), list(range(100, 112))]
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    for tokens, logits in zip(sequences, run.run([[9, 12], [12, 0]])):
        expected = model_hf_logits(hf_model, tokens)
        assert expected.std() > 0.5
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
