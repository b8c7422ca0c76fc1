"""The triton attention backend end to end in a model, and how it is selected.

Tiny float32 Mistral (sliding window, head dim 24), Qwen3 (per-head q/k
norms), Gemma 2 (capped attention scores, Gemma's norm and GeGLU kernels),
Phi-3 (partial rotary, LongRoPE), Granite (multipliers around the fused kernels), OLMo 2 (whole-projection
q/k norms), Hunyuan-dense and Ministral 3 (their own `attend` on the fused decode path), gpt-oss (attention sinks, experts with biases and a clamped SwiGLU) and DeepSeek-V3 (latent attention
expanded into the cache) run chunked prefills mixed with
decodes over a paged cache with every op on the Triton kernels; logits must match
transformers' within the same 1e-4 as the torch_sdpa path (tests/unit/test_models.py).
"""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedRun, hf_logits, save_tiny_checkpoint

from asyncllm.attention.selector import get_attention_backend
from asyncllm.attention.triton import TritonBackend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.kernels import reference
from asyncllm.kernels.decode_linear import FUSED_ROWS
from asyncllm.models.llama import LlamaAttention, LlamaDecoderLayer
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from kernel_testing import DEVICE

ATOL = 1e-4
SEQ_LENS = [8, 14, 20]
CHUNKED = [[3, 6, 0], [2, 5, 9], [1, 1, 8], [1, 1, 1], [1, 1, 1], [0, 0, 1]]  # prefill chunks mixed with decodes


@pytest.mark.parametrize("family", ["qwen3"])  # Llama (and Mistral, no window): test_triton_engine.py, the engine
def test_triton_model_logits_match_transformers(family: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' fused decode products (ASYNCLLM_DECODE_LINEAR=1) run model-level in the Granite case below."""
    monkeypatch.setenv("ASYNCLLM_DECODE_LINEAR", "0")
    hf_model = save_tiny_checkpoint(tmp_path, family, seed=len(family))
    hf_config = load_hf_config(str(tmp_path))
    config = EngineConfig.create(str(tmp_path), attention_backend="triton")
    model = load_model(config, hf_config, DEVICE, torch.float32)
    assert isinstance(model.model.layers[0].self_attn.attn.backend, TritonBackend)
    assert all(layer.fused_decode_rows == 0 for layer in model.model.layers)
    spec = kv_cache_spec(hf_config, 1)
    gen = torch.Generator().manual_seed(7)
    sequences = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in SEQ_LENS]
    run = PagedRun(model, sequences, block_size=4)
    with torch.device(DEVICE):  # the driver's step tensors on the model's device (a GPU when there is one)
        run.new_kv_caches_for(spec, torch.float32)
        all_logits = [logits.cpu() for logits in run.run(CHUNKED)]
    for tokens, logits in zip(sequences, all_logits):
        expected = hf_logits(hf_model, tokens)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_triton_gemma2_logits_match_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both attention kernels cap the scores (the prefills: unified; the decode-only step after them: split-KV),
    the 8-token window cutting into both; Gemma layers never take the fused decode products, even when asked."""

    from asyncllm.tiny import tiny_checkpoint

    monkeypatch.setenv("ASYNCLLM_DECODE_LINEAR", "1")
    path = tiny_checkpoint("gemma2")
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    assert not any(hasattr(layer, "fused_decode_rows") for layer in model.model.layers)
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config)


def test_triton_phi3_logits_match_transformers() -> None:
    """Phi-4-mini's rope on the fused rotary/KV-write kernel: 12 of each head's 16 dims rotated, the rest passed
    through, with LongRoPE's short factors (max_model_len 64: docs/phi3.md); prefills, then a decode-only step."""

    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint("phi3")
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, attention_backend="triton", max_model_len=64)
    model = load_model(config, hf_config, DEVICE, torch.float32)
    assert model.model.layers[0].self_attn.rotary_emb.rotary_dim == 12
    assert [layer.fused_decode_rows for layer in model.model.layers] == [FUSED_ROWS] * 2
    # the rope is under test here (the decode step's too: `attention_values`), not the fused products' kernel,
    # which Granite's case runs model-level: quicker
    _fused_products_on_the_reference(model)
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config)


@pytest.mark.parametrize("arch", ["granite", "olmo2", "hunyuan_v1_dense", "ministral3"])
def test_triton_llama_variants_logits_match_transformers(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Granite's residual multiplier before the fused residual-add + RMSNorm kernel (the 20-row prefill step) and
    before the fused decode products' add (the decode step); OLMo 2's whole-projection q/k norms before the
    rotary/KV-write kernel, which must not norm per head; Hunyuan-dense's and Ministral 3's attentions change
    `attend` (q/k norms after the rotary, attention-temperature scaling), so their fused decode step runs it and
    its own output product instead of the fused one."""

    from asyncllm.tiny import tiny_checkpoint

    monkeypatch.setenv("ASYNCLLM_DECODE_LINEAR", "1")
    path = tiny_checkpoint(arch)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    fused_rows = [getattr(layer, "fused_decode_rows", None) for layer in model.model.layers]
    assert fused_rows == ([None, None] if arch == "olmo2" else [FUSED_ROWS] * 2)
    overrides = type(model.model.layers[0].self_attn).attend is not LlamaAttention.attend
    assert overrides == (arch in ("hunyuan_v1_dense", "ministral3"))
    if overrides:  # which products the fused step runs is under test there, not the kernel (as Granite's): quicker
        _fused_products_on_the_reference(model)
    # Ministral 3's attention temperature starts at position 16 (asyncllm/tiny_shapes.py): a decode past it
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config, 18 if arch == "ministral3" else 13)


def test_fused_decode_runs_in_every_layer_at_steps_of_at_most_fused_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 1 and `FUSED_ROWS` tokens run `forward_fused_decode` in every layer, the first (no residual yet)
    too; a step of one token more runs none. docs/kernels.md, configuration.md and architecture.md say 2."""
    from asyncllm.tiny import tiny_checkpoint

    assert FUSED_ROWS == 2
    monkeypatch.setenv("ASYNCLLM_DECODE_LINEAR", "1")
    path = tiny_checkpoint("llama")
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    fused, index = LlamaDecoderLayer.forward_fused_decode, {layer: i for i, layer in enumerate(model.model.layers)}
    calls: list[tuple[int, int]] = []  # (layer index, rows)

    def spy(layer, positions, hidden, *rest):
        calls.append((index[layer], hidden.shape[0]))
        return fused(layer, positions, hidden, *rest)

    monkeypatch.setattr(LlamaDecoderLayer, "forward_fused_decode", spy)
    _fused_products_on_the_reference(model)  # the path taken is under test here, not the kernel: quicker
    run = PagedRun(model, [list(range(40, 44)), list(range(50, 52))], block_size=4)
    layers = range(len(model.model.layers))
    with torch.device(DEVICE):
        run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
        for num_scheduled, fused_rows in ([2, 1], None), ([1, 0], 1), ([1, 1], 2):
            calls.clear()
            run.step(num_scheduled)
            assert calls == ([] if fused_rows is None else [(i, fused_rows) for i in layers]), num_scheduled


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_triton_moe_logits_match_transformers(arch: str) -> None:
    """The fused-MoE kernels: Qwen3-MoE's (SiLU-and-mul, no biases) and gpt-oss's, whose attention kernels also
    take sinks (the prefills: unified; the decode-only step: split-KV), the 8-token window cutting into every
    other layer, with the experts' biases and the clamped SwiGLU and YaRN's scaled cos/sin through the
    rotary/KV-write kernel; DeepSeek-V3's expanded latent keys (24 wide, 8 of them rotated) and zero-padded
    values, with grouped sigmoid routing; GLM-4.5's per-head q/k norms fused before a half-head rotary."""

    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint(arch)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    assert model.model.layers[-1].mlp.experts.fused_moe.__module__ == "asyncllm.kernels.fused_moe"
    # GLM-4.5's dense first layer takes the fused decode path; its products' kernel (biases too:
    # test_decode_linear_kernel.py) is Granite's case's, not under test here: quicker
    _fused_products_on_the_reference(model)
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config)


@pytest.mark.parametrize("arch", ["bloom", "mpt"])
def test_triton_alibi_logits_match_transformers(arch: str) -> None:
    """BLOOM's and MPT's ALiBi at 6 heads (slopes of a head count that is not a power of two) on the unified kernel
    (the prefills) and the split-KV kernels (the decode-only step); MPT's clamped q/k/v and own softmax scale."""
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint(arch, num_heads=6, num_kv_heads=6, hidden_size=96)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    assert model.model.layers[0].self_attn.attn.alibi_slopes.shape == (6,)
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config)


def test_triton_llama4_logits_match_transformers() -> None:
    """Llama 4: the chunked layer (chunks of 8, straddled by both prompts) on the unified kernel, the decode-only
    step on the split-KV kernels; q/k L2 norms and the NoPE layer's temperature before them, the top-1 routed expert
    on its scaled input through the fused-MoE kernel."""
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint("llama4")
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config)


def test_triton_qwen3_5_logits_match_transformers() -> None:
    """Qwen3.5's gated full attention (zero-centred q/k norms in the model, a quarter-head rotary in the fused
    rotary/KV-write kernel) on the Triton kernels, its Gated DeltaNet's decode step on the gated-delta kernel (its
    prefill chunks in torch)."""
    from asyncllm.kernels.gated_delta import gated_delta_step
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint("qwen3_5")
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    assert model.model.layers[0].linear_attn.gated_delta_step is gated_delta_step
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config)


def test_triton_granite4_logits_match_transformers() -> None:
    """Granite 4.0's Mamba2 layer decoding through the Triton SSD step (its prefill chunks in torch), its attention
    and shared MLP and experts on the Triton kernels."""
    from asyncllm.kernels.ssd_step import ssd_decode_step
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint("granitemoehybrid")
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    assert model.model.layers[0].mamba.ssd_decode_step is ssd_decode_step
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config)


@pytest.mark.parametrize("arch", ["gemma4", "gemma4_moe"])
def test_triton_gemma4_logits_match_transformers(arch: str) -> None:
    """Gemma 4 on the Triton kernels: sliding layers (head dim 16) and global ones (head dim 32, one KV head, the
    proportional rope's unrotated pairs) through the fused rotary/KV-write kernel into caches of two shapes; the
    KV-sharing layers' queries over another layer's cache, writing nothing (both attention kernels); the GELU-tanh
    experts on the fused-MoE kernel."""
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint(arch)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="triton"), hf_config, DEVICE, torch.float32)
    if arch == "gemma4_moe":
        assert model.model.layers[0].experts.fused_moe.__module__ == "asyncllm.kernels.fused_moe"
    else:
        assert [layer.self_attn.shares_kv for layer in model.model.layers] == [False, False, True, True]
    _two_prefills_then_a_decode_match_transformers(model, path, hf_config)


def test_selector_defaults_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert get_attention_backend(None, cpu).name == "torch_sdpa"
    assert get_attention_backend("torch_sdpa", cpu).name == "torch_sdpa"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match="bfloat16"):
        get_attention_backend("triton", cpu, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="CUDA device") as info:
        get_attention_backend("triton", cpu, torch.float32)
    assert info.value.field == "attention_backend"
    with pytest.raises(ConfigError, match="pip install flash-attn"):
        get_attention_backend("flash_attn", cpu)


def test_decode_linear_switch_refuses_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """ASYNCLLM_DECODE_LINEAR: 1/0 (and their spellings), on by default; anything else names the variable."""
    from asyncllm import envs

    monkeypatch.delenv("ASYNCLLM_DECODE_LINEAR", raising=False)
    assert envs.DECODE_LINEAR.get() is True
    for raw, expected in (("1", True), ("on", True), ("0", False), ("no", False)):
        monkeypatch.setenv("ASYNCLLM_DECODE_LINEAR", raw)
        assert envs.DECODE_LINEAR.get() is expected
    monkeypatch.setenv("ASYNCLLM_DECODE_LINEAR", "auto")
    with pytest.raises(ConfigError, match="ASYNCLLM_DECODE_LINEAR='auto' is not allowed: expected 1 or 0"):
        envs.DECODE_LINEAR.get()


def _fused_products_on_the_reference(model) -> None:
    """The fused decode path's products as `reference.decode_linear` (torch) instead of the interpreted kernel."""
    for layer in model.model.layers:
        if getattr(layer, "fused_decode_rows", 0):
            layer.decode_linear = reference.decode_linear


def _two_prefills_then_a_decode_match_transformers(model, path: str, hf_config, second: int = 13) -> None:
    """Two sequences of 9 and ``second`` tokens prefilled in chunks of 8 and ``second - 1``, then one decode
    step each, on a paged cache."""
    from hf_reference import hf_logits as hf_path_logits

    spec = kv_cache_spec(hf_config, 1)
    sequences = [list(range(40, 49)), list(range(300, 300 + second))]
    run = PagedRun(model, sequences, block_size=4)
    with torch.device(DEVICE):
        run.new_kv_caches_for(spec, torch.float32)
        all_logits = [logits.cpu() for logits in run.run([[8, second - 1], [1, 1]])]
    for tokens, logits in zip(sequences, all_logits):
        torch.testing.assert_close(logits, hf_path_logits(path, tokens), atol=ATOL, rtol=0)
