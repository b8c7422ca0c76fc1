"""Gemma 4 (asyncllm/models/gemma4.py) against transformers' forward, over a paged KV cache.

The tiny E2B-style model (asyncllm.tiny ``gemma4``): sliding layers of 4 heads x 16 over 2 KV heads, global layers
with one 32-wide KV head whose values are their keys and the proportional rope, the last two layers sharing the
first two's caches with double-wide MLPs, per-layer inputs, random ``layer_scalar``s, capped logits; the 26B-A4B-style
one (``gemma4_moe``): GELU experts with their own router beside the dense MLP. Three requests of 12 to 27 tokens
(past the 8-token window) run as chunked prefills mixed with decodes; every position's float32 logits must match
transformers' within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.models.checkpoint import hf_config_from_json, hf_config_json, prequantized_config
from asyncllm.models.gemma4 import Gemma4ForCausalLM, Gemma4TextOnly, kv_cache_layout
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 20, 27]
CHUNKED = [[5, 9, 0], [4, 9, 16], [1, 1, 9], [1, 1, 1], [1, 0, 1]]


def _load(path: str, hf_config=None, **fields):
    hf_config = hf_config or load_hf_config(path)
    return load_model(EngineConfig.create(path, **fields), hf_config, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("arch", ["gemma4", "gemma4_moe"])
def test_logits_match_transformers(arch: str) -> None:
    path = tiny_checkpoint(arch)
    model = _load(path)
    assert type(model) is Gemma4ForCausalLM
    assert_paged_logits_match_checkpoint(model, path, SEQ_LENS, CHUNKED, seed=3, atol=1e-4)


def test_structure_and_kv_cache_layout() -> None:
    """What the tiny config asks for reaches the layers: two caches of two shapes for four layers, the last two
    sharing the first two's, values projected by the keys' matrix, double-wide MLPs on the sharing layers, the
    proportional rope turning a quarter of each global head, the checkpoint's layer scalars."""
    path = tiny_checkpoint("gemma4")
    hf_config = load_hf_config(path)
    model = _load(path, hf_config)
    layout = kv_cache_layout(hf_config)
    assert layout.cache_of_layer == (0, 1, 0, 1) and layout.shares == (False, False, True, True)
    assert kv_cache_spec(hf_config, 1).shapes() == [(2, 16), (1, 32)]
    assert kv_cache_spec(hf_config, 2).shapes() == [(1, 16), (1, 32)]  # the global KV head replicated
    layers = model.model.layers
    qkv = layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.weight[qkv.q_size:qkv.q_size + qkv.kv_size], qkv.weight[qkv.q_size + qkv.kv_size:])
    assert not hasattr(layers[2].self_attn, "qkv_proj") and hasattr(layers[2].self_attn, "q_proj")
    assert [layer.mlp.down_proj.weight.shape[1] for layer in layers] == [128, 128, 256, 256]
    cos_sin = layers[1].self_attn.rotary_emb.cos_sin_cache  # [positions, 32]: 16 cos then 16 sin
    assert cos_sin.shape[1] == 32 and torch.all(cos_sin[:, 4:16] == 1) and torch.all(cos_sin[:, 20:] == 0)
    assert not torch.all(cos_sin[5, :4] == 1)
    assert [a.self_attn.attn.sliding_window for a in layers] == [8, None, 8, None]
    assert all(a.self_attn.attn.scale == 1.0 for a in layers)
    scalars = [float(layer.layer_scalar) for layer in layers]
    assert len(set(scalars)) == 4 and 1.0 not in scalars
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_workers_config_builds_the_same_model() -> None:
    """The host's transformers config refuses ``config.head_dim`` for Gemma 4 unless allowed (per-layer values);
    the worker's plain config (from the host's JSON) keeps ``per_layer_config`` as a dict: both give the same cache
    layout and the same logits."""
    path = tiny_checkpoint("gemma4")
    host = load_hf_config(path)
    assert host.head_dim == 16  # allowed: the model-wide value
    wire = hf_config_from_json(hf_config_json(host))
    assert isinstance(wire.per_layer_config, dict)
    assert kv_cache_layout(wire) == kv_cache_layout(host)
    assert kv_cache_spec(wire, 1) == kv_cache_spec(host, 1)
    assert_paged_logits_match_checkpoint(_load(path, wire), path, SEQ_LENS[:2], [[5, 9], [4, 11], [3, 0]], seed=4)


def test_image_text_checkpoint_serves_text(tmp_path) -> None:
    """``Gemma4ForConditionalGeneration`` (a tiny vision tower around the tiny Gemma 4) in language-model-only mode
    (``limit_mm_per_prompt`` of 0 images): its language model's logits equal transformers', the tower's weights left
    unread."""
    import transformers

    text_path = tiny_checkpoint("gemma4")
    text_config = load_hf_config(text_path)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2)
    config = transformers.Gemma4Config(text_config=text_config.to_dict(), vision_config=vision, audio_config=None,
                                       architectures=["Gemma4ForConditionalGeneration"])
    hf_model = transformers.Gemma4ForConditionalGeneration(config).eval()
    text_model = transformers.AutoModelForCausalLM.from_pretrained(text_path)
    hf_model.model.language_model.load_state_dict(text_model.model.state_dict())
    hf_model.save_pretrained(tmp_path)
    model = _load(str(tmp_path), limit_mm_per_prompt={"image": 0})
    assert type(model) is Gemma4TextOnly
    tokens = list(range(40, 67))
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    from model_utils import PagedRun

    spec = kv_cache_spec(load_hf_config(str(tmp_path)), 1)
    run = PagedRun(model, [tokens], block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    (logits,) = run.run([[20], [7]])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_variants_not_built_are_refused(tmp_path) -> None:
    path = tiny_checkpoint("gemma4")
    every_layer_shared = load_hf_config(path)
    every_layer_shared.num_kv_shared_layers = every_layer_shared.num_hidden_layers
    with pytest.raises(NotBuiltError, match="every layer's KV shared"):
        kv_cache_layout(every_layer_shared)
    bidirectional = load_hf_config(path)
    bidirectional.use_bidirectional_attention = "all"
    with pytest.raises(NotBuiltError, match="use_bidirectional_attention"):
        _load(path, bidirectional)
    moe = tiny_checkpoint("gemma4_moe")  # its experts are stored fused: their fp8 and int4 forms are not read
    quantized = load_hf_config(moe)
    quantized.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(NotBuiltError, match="pre-quantized fp8 experts of Gemma4ForCausalLM"):
        prequantized_config(quantized, moe, None)
    dense = load_hf_config(path)
    dense.quantization_config = quantized.quantization_config
    assert prequantized_config(dense, path, None) is not None  # the dense decoder's is (test_fp8_checkpoint.py)


def test_online_fp8_quantizes_the_linears_and_experts() -> None:
    """``quantization="fp8"``: the attention and MLP projections (the KV-sharing layers' q projections too) and the
    stacked experts (per expert matrix, asyncllm/models/fp8_online_experts.py) go to fp8; the per-layer-input
    matrices and the router stay float; the logits stay as close to the float model's as a tiny Llama's do (mean
    error within a fifth of their spread, most argmaxes kept)."""
    from model_utils import PagedRun

    for arch in ("gemma4", "gemma4_moe"):
        path = tiny_checkpoint(arch)
        hf_config = load_hf_config(path)
        model = load_model(EngineConfig.create(path, quantization="fp8"), hf_config, torch.device("cpu"),
                           torch.float32)
        fp8 = {name.removeprefix("model.layers.") for name, p in model.named_parameters()
               if p.dtype == torch.float8_e4m3fn}
        expected = {f"{i}.{m}.weight" for i in range(len(model.model.layers)) for m in
                    ("mlp.gate_up_proj", "mlp.down_proj", "self_attn.o_proj",
                     "self_attn.q_proj" if model.model.layers[i].self_attn.shares_kv else "self_attn.qkv_proj")}
        expected |= {f"{i}.experts.{w}" for i, layer in enumerate(model.model.layers) if hasattr(layer, "experts")
                     for w in ("w13_weight", "w2_weight")}
        assert fp8 == expected and ("experts" in str(expected)) == (arch == "gemma4_moe"), arch
        tokens = list(range(40, 60))
        logits = []
        for m in (model, _load(path, hf_config)):
            run = PagedRun(m, [tokens], block_size=4)
            run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
            logits.append(run.run([[20]])[0])
        error = (logits[0] - logits[1]).abs().mean().item()  # tiny Llama's: 0.14 of its logits' spread
        assert 0 < error < 0.2 * logits[1].std().item(), (arch, error)
        assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("standardize, clipped", [(True, True), (False, False)])
def test_vision_tower_features_equal_transformers(tmp_path, standardize: bool, clipped: bool) -> None:
    """An image's rows from the tower and embedder (its real patches with their positions, pooled 2 x 2, clipped
    linears and standardization as configured) equal transformers' ``get_image_features`` within float32 noise, for
    two aspect ratios (different row counts)."""
    import numpy as np
    import transformers
    from gemma4_mm_utils import make_tiny_gemma4_mm
    from mm_utils import make_image
    from PIL import Image
    import io

    from asyncllm.models.gemma4_mm import Gemma4ForConditionalGeneration

    path = make_tiny_gemma4_mm(tmp_path, standardize=standardize, clipped=clipped)
    model = _load(path)
    assert type(model) is Gemma4ForConditionalGeneration
    hf_model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    rows = []
    for width, height in ((40, 28), (20, 52)):
        image = Image.open(io.BytesIO(make_image(width, height, seed=width))).convert("RGB")
        processed = processor(images=[image], return_tensors="np")
        pixels = Gemma4ForConditionalGeneration.mm_pixel_values(processed)
        length = Gemma4ForConditionalGeneration.mm_placeholder_length(model.hf_config, pixels.shape)
        assert length == int(processed["num_soft_tokens_per_image"][0])
        with torch.no_grad():
            ours = model.embed_multimodal(torch.from_numpy(pixels)[None])[0]
            theirs = hf_model.model.get_image_features(torch.from_numpy(processed["pixel_values"]),
                                                       torch.from_numpy(processed["image_position_ids"]),
                                                       return_dict=True).pooler_output[0]
        assert ours.shape == (length, 64)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        rows.append(length)
    assert rows[0] != rows[1] and np.all(np.array(rows) <= 70)


def test_the_hosts_adapter_check_knows_each_layers_projections(tmp_path) -> None:
    """Gemma 4's layers differ: a PEFT adapter on every projection passes the host's check (global layers' q is
    twice as wide, sharing layers' MLPs too), one naming a v projection where a layer has none is refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from asyncllm.errors import InvalidRequestError
    from asyncllm.lora import LoRARequest
    from asyncllm.lora_checker import AdapterChecker
    from lora_utils import make_adapter

    path = tiny_checkpoint("gemma4")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    good = make_adapter(path, str(tmp_path / "good"), seed=1, targets=targets)
    checker = AdapterChecker(load_hf_config(path), max_lora_rank=8)
    checker.check(LoRARequest("good", 1, good))
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    tensors = load_file(f"{bad}/adapter_model.safetensors")
    renamed = {k.replace("layers.0.self_attn.v_proj", "layers.1.self_attn.v_proj"): v for k, v in tensors.items()}
    save_file(renamed, f"{bad}/adapter_model.safetensors")
    with pytest.raises(InvalidRequestError, match="layer 1 of Gemma4ForCausalLM has no v_proj"):
        checker.check(LoRARequest("bad", 2, bad))
