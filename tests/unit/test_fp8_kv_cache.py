"""The fp8 KV cache (kv_cache_dtype='fp8' / 'fp8_e4m3' / 'fp8_e5m2') outside the Triton kernels:
the torch_sdpa backend, the runner's cache and sizing, the CPU swap space, calibrated scales.
(Kernels: tests/kernels/test_fp8_kv_cache_kernels.py; the engine: tests/engine/test_fp8_kv_cache_engine.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import make_attn_metadata
from safetensors.torch import load_file, save_file

from asyncllm.attention.metadata import RotaryInputs
from asyncllm.attention.torch_sdpa import TorchSDPABackend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_torch_dtype
from asyncllm.workers import model_runner
from asyncllm.workers.model_runner import ModelRunner
from asyncllm.workers.swap import CPUSwapSpace

CPU = torch.device("cpu")
FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]


def test_kv_cache_dtype_names() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.float32) == kv_cache_torch_dtype("fp8_e4m3", torch.float16)
    assert kv_cache_torch_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_sdpa_backend_over_an_fp8_cache(fp8: torch.dtype, dtype: torch.dtype) -> None:
    """A decode, a chunk over a cached prefix and a fresh prefill through the backend: the cache holds the
    rotated K and the V rounded to fp8, and the output is attention over those rounded values, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    computed, scheduled = [9, 5, 0], [1, 3, 6]
    tables = [[3, 7, 1], [0, 5], [2, 6]]
    metadata, positions = make_attn_metadata(computed, scheduled, tables, block_size=4)
    num_tokens, num_kv_heads, head_dim = sum(scheduled), 2, 32
    query, key, value = ((torch.randn(num_tokens, h, head_dim, generator=gen) * 2).to(dtype) for h in (4, 2, 2))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    rotary = RotaryInputs(positions, reference.build_cos_sin_cache(inv_freq, 1.0, 64))
    full = (torch.randn(2, 8, 4, num_kv_heads, head_dim, generator=gen) * 2).to(dtype)  # the cached context
    cache = reference.to_kv_cache_dtype(full, fp8)
    rounded = cache.to(dtype)  # the same context, upcast: the reference's cache

    out = TorchSDPABackend().forward(query, key, value, cache, metadata, head_dim**-0.5, rotary=rotary)

    rot_q, rot_k = reference.norm_and_rotate(query, key, rotary)
    reference.write_kv_cache(reference.to_kv_cache_dtype(rot_k, fp8).to(dtype),
                             reference.to_kv_cache_dtype(value, fp8).to(dtype), rounded, metadata.slot_mapping)
    assert cache.dtype == fp8 and torch.equal(cache.to(dtype), rounded)
    expected = reference.paged_attention(rot_q, rounded, metadata, head_dim**-0.5)
    assert out.dtype == dtype and torch.equal(out, expected)
    exact = full.clone()
    reference.write_kv_cache(rot_k, value, exact, metadata.slot_mapping)
    unrounded = reference.paged_attention(rot_q, exact, metadata, head_dim**-0.5)
    assert float((out.float() - unrounded.float()).abs().max()) > 1e-2  # the cache really holds fp8


@pytest.mark.parametrize("fp8", FP8)
def test_cpu_swap_space_copies_fp8_blocks_exactly(fp8: torch.dtype) -> None:
    """Out and back in, byte for byte (torch's CPU index_copy_ has no float8 kernel: the copies go as bytes)."""
    gpu = [reference.to_kv_cache_dtype(torch.randn(2, 6, 4, 2, 3, generator=torch.Generator().manual_seed(i)) * 3,
                                       fp8) for i in range(2)]
    before = [layer.view(torch.uint8).clone() for layer in gpu]
    swap = CPUSwapSpace(3, gpu)
    assert all(c.dtype == fp8 for c in swap.caches)
    swap.swap(gpu, blocks_to_swap_out=[[1, 0], [4, 2]], blocks_to_swap_in=[])
    for layer in gpu:
        layer[:, [1, 4]] = reference.to_kv_cache_dtype(torch.zeros(2, 2, 4, 2, 3), fp8)  # the blocks are reused
    swap.swap(gpu, blocks_to_swap_out=[], blocks_to_swap_in=[[4, 0], [1, 2]])
    for layer, old in zip(gpu, before):
        raw = layer.view(torch.uint8)
        assert torch.equal(raw[:, 4], old[:, 1]) and torch.equal(raw[:, 1], old[:, 4])
        assert torch.equal(raw[:, [0, 2, 3, 5]], old[:, [0, 2, 3, 5]])


def _runner(path: str, kv_cache_dtype: str) -> ModelRunner:
    config = EngineConfig.create(str(path), kv_cache_dtype=kv_cache_dtype, dtype="float32", device="cpu",
                                 max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    return runner


def test_the_runner_sizes_and_allocates_one_byte_per_element(tiny_llama: str, monkeypatch) -> None:
    """Four times the blocks of float32 in the same CPU budget; the cache tensors and the profile step's
    temporary cache are fp8; the profile step runs the real model over it."""
    monkeypatch.setenv("ASYNCLLM_CPU_KVCACHE_SPACE_GB", "0.001")
    fp32, fp8 = _runner(tiny_llama, "auto"), _runner(tiny_llama, "fp8")
    assert fp8.kv_cache_dtype == torch.float8_e4m3fn and fp32.kv_cache_dtype == torch.float32
    assert fp32.bytes_per_block == 4 * fp8.bytes_per_block
    assert fp8.determine_num_available_blocks() // 4 == fp32.determine_num_available_blocks() > 0
    assert fp8.run_profile_step() == 8 * fp8.bytes_per_block  # 4 requests x 8 tokens / 4 per block
    fp8.init_cache(8)
    assert [c.dtype for c in fp8.kv_caches] == [torch.float8_e4m3fn] * 2 and fp8.kv_caches[0].shape[1] == 8
    assert fp8.determine_num_cpu_blocks() // 4 == fp32.determine_num_cpu_blocks() > 0


def test_e4m3_needs_sm89_for_the_triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton has no float8_e4m3fn conversions before sm_89: a ConfigError naming kv_cache_dtype, not a
    compile error at the first step; e5m2 and torch_sdpa pass."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(model_runner, "attention_backend_name", lambda model: "triton")
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError, match="fp8_e5m2") as info:
        model_runner._check_kv_cache_dtype_runs("fp8", torch.float8_e4m3fn, cuda, object())
    assert info.value.field == "kv_cache_dtype" and info.value.value == "fp8"
    model_runner._check_kv_cache_dtype_runs("fp8_e5m2", torch.float8_e5m2, cuda, object())
    monkeypatch.setattr(model_runner, "attention_backend_name", lambda model: "torch_sdpa")
    model_runner._check_kv_cache_dtype_runs("fp8", torch.float8_e4m3fn, cuda, object())


def _with_scales(tiny_llama: str, folder: Path, scales: dict[str, float]) -> str:
    folder.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((Path(tiny_llama) / name).read_bytes())
    weights = load_file(str(folder / "model.safetensors"))
    weights.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(weights, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("scales", [
    pytest.param({"model.layers.0.self_attn.k_scale": 0.05, "model.layers.0.self_attn.v_scale": 0.02,
                  "model.layers.1.self_attn.k_proj.k_scale": 0.5, "model.layers.1.self_attn.v_proj.v_scale": 4.0},
                 id="llm-compressor-modelopt"),
    pytest.param({"model.layers.0.self_attn.k_proj.output_scale": 0.05,
                  "model.layers.0.self_attn.v_proj.output_scale": 0.02,
                  "model.layers.0.self_attn.q_proj.output_scale": 1.0, "model.layers.1.self_attn.q_scale": 1.0,
                  "model.layers.1.self_attn.qkv_proj.k_scale": 0.5, "model.layers.1.self_attn.qkv_proj.v_scale": 4.0},
                 id="output_scale-qkv_proj"),
])
def test_calibrated_kv_cache_scales_go_to_the_attention_layers_of_an_fp8_cache(tiny_llama: str, tmp_path: Path,
                                                                              scales: dict[str, float]) -> None:
    """llm-compressor's names (``self_attn.k_scale`` / ``v_scale``), ModelOpt's (``k_proj.k_scale``), a fused
    projection's (``qkv_proj.k_scale``), a projection's ``output_scale`` (older llm-compressor, AutoFP8; vLLM's
    ``get_cache_scale``): set on each layer's attention with an fp8 cache; dropped with the model dtype's, as is a
    query scale (1.0 with an fp8 cache: nothing to do)."""
    path = _with_scales(tiny_llama, tmp_path, scales)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, kv_cache_dtype="fp8"), hf_config, CPU, torch.float32)
    assert [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in model.model.layers] == \
        [(pytest.approx(0.05), pytest.approx(0.02)), (0.5, 4.0)]
    plain = load_model(EngineConfig.create(path), hf_config, CPU, torch.float32)
    assert [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in plain.model.layers] == \
        [(1.0, 1.0)] * 2


def test_one_kv_scale_for_both_and_the_scales_refused(tiny_llama: str, tmp_path: Path) -> None:
    """One ``kv_scale`` sets both; a scale of a layer the model lacks is a `ConfigError`; per-head scales are a
    `NotBuiltError` with an fp8 cache (a query scale is dropped: test_a_query_scale_is_ignored_...)."""
    hf_config = load_hf_config(tiny_llama)
    both = _with_scales(tiny_llama, tmp_path / "kv", {"model.layers.1.self_attn.kv_scale": 0.25})
    model = load_model(EngineConfig.create(both, kv_cache_dtype="fp8_e5m2"), hf_config, CPU, torch.float32)
    assert (model.model.layers[1].self_attn.attn.k_scale, model.model.layers[1].self_attn.attn.v_scale) == (0.25, 0.25)
    bad = _with_scales(tiny_llama, tmp_path / "bad", {"model.layers.7.self_attn.k_scale": 0.5})
    with pytest.raises(ConfigError, match="a KV-cache scale of an attention layer the model has"):
        load_model(EngineConfig.create(bad, kv_cache_dtype="fp8"), hf_config, CPU, torch.float32)
    per_head = _with_scales(tiny_llama, tmp_path / "heads", {"model.layers.0.self_attn.k_scale": [0.5, 0.25]})
    with pytest.raises(NotBuiltError, match="KV-cache scales per head or channel"):
        load_model(EngineConfig.create(per_head, kv_cache_dtype="fp8"), hf_config, CPU, torch.float32)
    for value in (float("inf"), 0.0, float("nan")):  # inf: zeros in the cache and NaN scores (0 * inf), no error
        broken = _with_scales(tiny_llama, tmp_path / f"s{value}", {"model.layers.0.self_attn.v_scale": value})
        with pytest.raises(ConfigError, match="a positive finite KV-cache scale"):
            load_model(EngineConfig.create(broken, kv_cache_dtype="fp8"), hf_config, CPU, torch.float32)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-norms"])
def test_a_scaled_cache_holds_k_over_k_scale_and_attends_as_the_unscaled_keys(fp8: torch.dtype, qk_norm: bool) -> None:
    """Through `Attention`: the cache holds the rotated keys over ``k_scale`` and the values over ``v_scale``, in
    fp8, and the output is attention over those times the scales (the keys' norm, where the backend runs it, divides
    through its weight)."""
    from asyncllm.models.layers import Attention

    gen = torch.Generator().manual_seed(3)
    metadata, positions = make_attn_metadata([4, 0], [2, 5], [[1, 3], [0, 2]], block_size=4)
    tokens, head_dim, k_scale, v_scale = 7, 16, 0.01, 8.0
    query, key, value = (torch.randn(tokens, h, head_dim, generator=gen) * 3 for h in (4, 2, 2))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    norms = (1 + 0.1 * torch.randn(head_dim, generator=gen), 1 + 0.1 * torch.randn(head_dim, generator=gen), 1e-6)
    rotary = RotaryInputs(positions, reference.build_cos_sin_cache(inv_freq, 1.0, 64), *(norms if qk_norm else ()))
    context = reference.to_kv_cache_dtype(torch.randn(2, 4, 4, 2, head_dim, generator=gen), fp8)
    attn = Attention(4, 2, head_dim, TorchSDPABackend())
    attn.k_scale, attn.v_scale = k_scale, v_scale
    cache = context.clone()
    out = attn(query, key, value, cache, metadata, rotary)

    rot_q, rot_k = reference.norm_and_rotate(query, key, rotary)
    expected_cache = context.to(torch.float32)
    reference.write_kv_cache(reference.to_kv_cache_dtype(rot_k / k_scale, fp8).float(),
                             reference.to_kv_cache_dtype(value / v_scale, fp8).float(), expected_cache,
                             metadata.slot_mapping)
    torch.testing.assert_close(cache.float(), expected_cache, rtol=0, atol=0)
    dequantized = expected_cache.clone()
    dequantized[0] *= k_scale
    dequantized[1] *= v_scale
    expected = reference.paged_attention(rot_q, dequantized, metadata, head_dim**-0.5)
    torch.testing.assert_close(out, expected.reshape(tokens, -1), rtol=1e-5, atol=1e-5)


def test_calculate_kv_scales_as_vllm_names_it() -> None:
    """vLLM's documented `LLM(model, kv_cache_dtype="fp8", calculate_kv_scales=False)` (its default: the checkpoint's
    scales, else 1.0, which asyncllm does) was a ConfigError ("a known EngineConfig field"); now accepted, and True
    (scales estimated from the first batch) a NotBuiltError naming the field, from the flag too."""
    import argparse

    from asyncllm.cli_args import add_engine_args, engine_kwargs

    config = EngineConfig.create("m", kv_cache_dtype="fp8", calculate_kv_scales=False)
    assert config.calculate_kv_scales is False and config.kv_cache_dtype == "fp8"
    with pytest.raises(NotBuiltError, match="calculate_kv_scales=True"):
        EngineConfig.create("m", kv_cache_dtype="fp8", calculate_kv_scales=True)
    with pytest.raises(ConfigError, match="calculate_kv_scales='yes'"):
        EngineConfig.create("m", calculate_kv_scales="yes")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, value in ((["--no-calculate-kv-scales"], False), (["--calculate-kv-scales"], True)):
        assert engine_kwargs(parser.parse_args(argv))["calculate_kv_scales"] is value


@pytest.mark.parametrize("layout", ["model.language_model.layers", "model.layers", "language_model.model.layers"])
def test_a_multimodal_checkpoints_scales_in_either_layout(tmp_path: Path, layout: str) -> None:
    """A vision-language checkpoint's scales under transformers' newer layout (``model.language_model.layers.N``,
    Qwen3-VL's and Gemma 3's from transformers 4.52 on, whose weights load) were a ConfigError "a KV-cache scale of
    an attention layer the model has"; now they reach the decoder's layers as the older layouts' do."""
    from qwen_vl_utils import make_tiny_qwen_vl

    path = Path(make_tiny_qwen_vl(tmp_path / "vl", version="2"))
    shard = next(path.glob("*.safetensors"))
    weights = load_file(str(shard))
    weights.update({f"{layout}.1.self_attn.k_scale": torch.tensor(0.5),
                    f"{layout}.1.self_attn.v_scale": torch.tensor(0.25)})
    save_file(weights, str(shard))
    model = load_model(EngineConfig.create(str(path), kv_cache_dtype="fp8"), load_hf_config(str(path)), CPU,
                       torch.float32)
    assert [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale)
            for layer in model.language_model.model.layers] == [(1.0, 1.0), (0.5, 0.25)]


def _copy_with_scales(source: str, folder: Path, scales: dict[str, float]) -> str:
    """A copy of the checkpoint at ``source`` (one shard) with ``scales`` added."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in Path(source).iterdir():
        if file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    shard = next(folder.glob("*.safetensors"))
    weights = load_file(str(shard))
    weights.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(weights, str(shard))
    return str(folder)


def _fp8_logits(path: str, set_scales: list[tuple[float, float]] | None = None
                ) -> tuple[list[tuple[float, float]], list[torch.Tensor]]:
    """Each layer's (k_scale, v_scale) as loaded and two requests' float32 logits over an e4m3 cache (chunked
    prefills); ``set_scales``: each layer's scales set by hand after the load."""
    from model_utils import PagedRun

    from asyncllm.models.registry import kv_cache_spec

    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, kv_cache_dtype="fp8"), hf_config, CPU, torch.float32)
    scales = [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in model.model.layers]
    for layer, (k_scale, v_scale) in zip(model.model.layers, set_scales or []):
        layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale = k_scale, v_scale
    run = PagedRun(model, [list(range(40, 67)), list(range(100, 120))], block_size=4)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float8_e4m3fn)
    return scales, run.run([[9, 5], [9, 9], [9, 6]])


@pytest.mark.parametrize("arch", ["gemma4", "gemma3n"])
def test_a_kv_sharing_layer_reads_the_cache_with_the_writers_scales(arch: str, tmp_path: Path) -> None:
    """Gemma 4 / 3n's last layers attend over an earlier layer's cache, which holds ``k / k_scale`` of the layer that
    wrote it. A checkpoint with scales for the writing layers only: the sharing layers read the cache as unscaled
    (keys and values four and two times too large: logits off by ~1, no error); now they take the writer's scales:
    the logits are those of every layer given the writers' scales by hand, and, the scales being powers of two, within
    fp8 rounding of the unscaled cache's. Scales of the sharing layer's own that equal the writer's are accepted
    (they were a NotBuiltError at the first forward); ones that contradict them (the cache cannot hold both) are a
    ConfigError at load naming the layer."""
    from asyncllm.tiny import tiny_checkpoint

    source = tiny_checkpoint(arch)
    _, plain = _fp8_logits(source)
    writers = {**{f"model.layers.{i}.self_attn.k_scale": 0.25 for i in (0, 1)},
               **{f"model.layers.{i}.self_attn.v_scale": 0.5 for i in (0, 1)}}  # layers 2, 3 read 0's and 1's caches
    scales, scaled = _fp8_logits(_copy_with_scales(source, tmp_path / "writers", writers))
    assert scales == [(0.25, 0.5)] * 4
    _, by_hand = _fp8_logits(source, set_scales=[(0.25, 0.5)] * 4)
    for got, expected, unscaled in zip(scaled, by_hand, plain):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        torch.testing.assert_close(got, unscaled, atol=0.1, rtol=0)
    own = {**writers, "model.layers.2.self_attn.k_scale": 0.25, "model.layers.3.self_attn.kv_scale": 0.25}
    with pytest.raises(ConfigError, match=r"model.layers.3.self_attn.*v_scale 0.25 differs from the v_scale 0.5 of "
                                          r"model.layers.1.self_attn"):
        _fp8_logits(_copy_with_scales(source, tmp_path / "contradicting", own))
    own = {**writers, "model.layers.2.self_attn.k_proj.k_scale": 2.0}
    with pytest.raises(ConfigError, match=r"model.layers.2.self_attn.*k_scale 2.0 differs from the k_scale 0.25"):
        _fp8_logits(_copy_with_scales(source, tmp_path / "contradicting-k", own))
    own = {"model.layers.3.self_attn.v_scale": 0.5}  # its writer, layer 1, has none: 1.0
    with pytest.raises(ConfigError, match=r"v_scale 0.5 differs from the v_scale 1.0 of model.layers.1.self_attn.attn"):
        _fp8_logits(_copy_with_scales(source, tmp_path / "contradicting-none", own))
    own = {**writers, "model.layers.2.self_attn.k_scale": 0.25, "model.layers.3.self_attn.v_scale": 0.5}
    scales, same = _fp8_logits(_copy_with_scales(source, tmp_path / "agreeing", own))
    assert scales == [(0.25, 0.5)] * 4
    for got, expected in zip(same, scaled):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("fp8", FP8)
def test_a_layer_reading_a_scaled_cache_attends_as_over_the_unscaled_keys(fp8: torch.dtype) -> None:
    """Through `Attention` with no keys or values (a KV-sharing layer: the query rotated, the cache another layer
    wrote with ``k_scale`` / ``v_scale``): the output is attention over the dequantized cache (it was a NotBuiltError
    for any scale but 1.0)."""
    from asyncllm.models.layers import Attention

    gen = torch.Generator().manual_seed(5)
    metadata, _ = make_attn_metadata([4, 0], [2, 5], [[1, 3], [0, 2]], block_size=4)
    head_dim, k_scale, v_scale = 16, 0.01, 8.0
    query = torch.randn(7, 4, head_dim, generator=gen) * 3
    cache = reference.to_kv_cache_dtype(torch.randn(2, 4, 4, 2, head_dim, generator=gen) * 3, fp8)
    attn = Attention(4, 2, head_dim, TorchSDPABackend(), scale=0.3)
    attn.k_scale, attn.v_scale = k_scale, v_scale
    out = attn(query, None, None, cache, metadata)
    dequantized = cache.float()
    dequantized[0] *= k_scale
    dequantized[1] *= v_scale
    expected = reference.paged_attention(query, dequantized, metadata, 0.3)
    torch.testing.assert_close(out, expected.reshape(7, -1), rtol=1e-5, atol=1e-5)


def test_one_of_k_scale_and_v_scale_serves_both(tiny_llama: str, tmp_path: Path) -> None:
    """vLLM's ``BaseKVCacheMethod.process_weights_after_loading``: a layer with a ``k_scale`` and no ``v_scale``
    stores its values over the same scale (its ``max(k_scale, v_scale)``, v_scale unset); asyncllm kept v_scale 1.0.
    A lone ``v_scale`` serves both too (vLLM's assertion there fails)."""
    hf_config = load_hf_config(tiny_llama)
    path = _with_scales(tiny_llama, tmp_path / "one", {"model.layers.0.self_attn.k_scale": 0.25,
                                                       "model.layers.1.self_attn.v_proj.v_scale": 4.0})
    model = load_model(EngineConfig.create(path, kv_cache_dtype="fp8"), hf_config, CPU, torch.float32)
    assert [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in model.model.layers] == \
        [(0.25, 0.25), (4.0, 4.0)]


def test_a_query_scale_is_ignored_as_the_query_stays_in_the_model_dtype(tiny_llama: str, tmp_path: Path) -> None:
    """A ``q_scale`` (fp8 attention's query scale: the query is stored as ``q / q_scale``) other than 1.0 was a
    NotBuiltError with an fp8 cache. vLLM's backends that keep the query in the model dtype ignore it (FlashAttention
    3 rounds the query to fp8 with it, the same attention up to that rounding): asyncllm's query stays unrounded, so
    the scale changes nothing (with the model dtype's cache too). So does fp8 attention's probabilities' scale
    (``self_attn.prob_output_scale``, vLLM's ``attn.prob_scale``: its fp8 and Quark configs read it), which was an
    "unexpected weights" ConfigError. The layer's k / v scales are its own."""
    hf_config = load_hf_config(tiny_llama)
    path = _with_scales(tiny_llama, tmp_path / "q", {"model.layers.0.self_attn.q_scale": 0.1,
                                                     "model.layers.1.self_attn.q_proj.output_scale": 3.0,
                                                     "model.layers.1.self_attn.k_scale": 0.5,
                                                     "model.layers.0.self_attn.prob_output_scale": 0.02,
                                                     "model.layers.1.self_attn.attn.prob_scale": 0.02})
    for kv_cache_dtype, scales in (("fp8", [(1.0, 1.0), (0.5, 0.5)]), ("auto", [(1.0, 1.0)] * 2)):
        model = load_model(EngineConfig.create(path, kv_cache_dtype=kv_cache_dtype), hf_config, CPU, torch.float32)
        assert [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in model.model.layers] == scales


def test_kv_cache_dtypes_vllm_accepts() -> None:
    """vLLM's ``bfloat16`` (and newer releases' ``float16``) cache is the model dtype's when it is that dtype: accepted
    as ``auto``; against another model dtype (no backend of vLLM's attends a cache of another dtype) and vLLM's
    ``int8``, ``fp8_inc``, ``fp8_ds_mla`` are NotBuiltErrors naming the value (they were a ConfigError "one of ...",
    as for a misspelt name, which stays one)."""
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert EngineConfig.create("m", kv_cache_dtype=name, dtype=name).kv_cache_dtype == name
        assert EngineConfig.create("m", kv_cache_dtype=name).kv_cache_dtype == name  # dtype auto: checked at load
        assert kv_cache_torch_dtype(name, dtype) == dtype
        with pytest.raises(NotBuiltError, match=f"a {name} KV cache under a float32 model") as info:
            kv_cache_torch_dtype(name, torch.float32)
        assert (info.value.field, info.value.value) == ("kv_cache_dtype", name)
    with pytest.raises(NotBuiltError, match="a bfloat16 KV cache under a float16 model"):
        EngineConfig.create("m", kv_cache_dtype="bfloat16", dtype="half")
    for name in ("int8", "fp8_inc", "fp8_ds_mla"):
        with pytest.raises(NotBuiltError, match=f"kv_cache_dtype='{name}'") as info:
            EngineConfig.create("m", kv_cache_dtype=name)
        assert (info.value.field, info.value.value) == ("kv_cache_dtype", name)
    with pytest.raises(ConfigError, match="one of") as info:
        EngineConfig.create("m", kv_cache_dtype="fp9")
    assert not isinstance(info.value, NotBuiltError)


def test_a_runner_loads_a_cache_of_the_model_dtype_by_name(tiny_llama: str) -> None:
    """``kv_cache_dtype="bfloat16"`` under a bfloat16 model is its ``auto`` cache; under the float32 model (dtype
    ``auto`` on the CPU) a NotBuiltError at load, not a KeyError."""
    config = EngineConfig.create(tiny_llama, kv_cache_dtype="bfloat16", dtype="bfloat16", device="cpu",
                                 max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    assert runner.kv_cache_dtype == torch.bfloat16
    with pytest.raises(NotBuiltError, match="a bfloat16 KV cache under a float32 model"):
        _runner(tiny_llama, "bfloat16")


@pytest.mark.parametrize("layout", ["model.language_model.layers", "language_model.model.layers"])
def test_an_image_text_checkpoint_served_as_text_takes_its_decoders_scales(tmp_path: Path, layout: str) -> None:
    """A Gemma 4 image-text checkpoint's scales (under its decoder, in either layout): in the image-text model and in
    its language model served alone (``limit_mm_per_prompt`` of 0 images: ``model.layers.N``, whose scales were a
    ConfigError "a KV-cache scale of an attention layer the model has"), the KV-sharing layer 3 taking layer 1's."""
    from gemma4_mm_utils import make_tiny_gemma4_mm

    from asyncllm.models.layers import Attention

    path = Path(make_tiny_gemma4_mm(tmp_path / "gemma4", num_kv_shared_layers=1))
    scaled = _copy_with_scales(str(path), tmp_path / "scaled", {f"{layout}.1.self_attn.k_scale": 0.25,
                                                                 f"{layout}.1.self_attn.v_scale": 0.5})
    for limits in ({}, {"limit_mm_per_prompt": {"image": 0}}):
        model = load_model(EngineConfig.create(scaled, kv_cache_dtype="fp8", **limits), load_hf_config(scaled), CPU,
                           torch.float32)
        layers = [m for m in model.modules() if isinstance(m, Attention)][-4:]  # the decoder's, after any tower's
        assert [(a.k_scale, a.v_scale) for a in layers] == [(1.0, 1.0), (0.25, 0.5), (1.0, 1.0), (0.25, 0.5)]


def test_auto_resolves_to_the_fp8_cache_a_checkpoint_declares(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's ``auto``: fp8 for llm-compressor's ``kv_cache_scheme`` (its ``Attention`` sets ``cache_dtype="fp8"``) and
    ``fp8_e4m3`` for ModelOpt's ``kv_cache_quant_algo: FP8`` (``resolve_kv_cache_dtype_string``), with a log line;
    the model dtype otherwise; an explicit value wins (the engine: tests/engine/test_kv_cache_scheme_auto.py)."""
    from types import SimpleNamespace

    from asyncllm.models.checkpoint import resolve_kv_cache_dtype

    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    ct = SimpleNamespace(quantization_config={"quant_method": "compressed-tensors", "kv_cache_scheme": scheme})
    with caplog.at_level("INFO", logger="asyncllm.engine"):
        assert resolve_kv_cache_dtype("auto", ct) == "fp8"
    assert "kv_cache_dtype 'auto' is 'fp8'" in caplog.text and "kv_cache_scheme" in caplog.text
    assert [resolve_kv_cache_dtype(value, ct) for value in ("bfloat16", "float16", "fp8_e5m2")] == \
        ["bfloat16", "float16", "fp8_e5m2"]
    multimodal = SimpleNamespace(text_config=SimpleNamespace(compression_config={  # compressed-tensors' older key
        "quant_method": "compressed_tensors", "kv_cache_scheme": scheme}))
    assert resolve_kv_cache_dtype("auto", multimodal) == "fp8"
    modelopt = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}
    assert resolve_kv_cache_dtype("auto", SimpleNamespace(quantization_config=modelopt)) == "fp8_e4m3"
    flat = {"quant_method": "modelopt_fp4", "kv_cache_quant_algo": "fp8"}
    assert resolve_kv_cache_dtype("auto", SimpleNamespace(quantization_config=flat)) == "fp8_e4m3"
    unknown = {"quant_method": "modelopt", "kv_cache_quant_algo": "NVFP4"}  # vLLM: a warning, the model dtype
    assert resolve_kv_cache_dtype("auto", SimpleNamespace(quantization_config=unknown)) == "auto"
    latent = SimpleNamespace(quantization_config=ct.quantization_config, kv_lora_rank=16)  # DeepSeek's one-part cache
    with caplog.at_level("WARNING", logger="asyncllm.engine"):
        assert resolve_kv_cache_dtype("auto", latent) == "auto"  # its scales are not built: served as before
    assert "latent attention" in caplog.text
    for section in ({"quant_method": "compressed-tensors", "kv_cache_scheme": None},
                    {"quant_method": "fp8", "kv_cache_scheme": scheme},  # vLLM's Fp8Config reads no kv_cache_scheme
                    None):
        assert resolve_kv_cache_dtype("auto", SimpleNamespace(quantization_config=section)) == "auto"
