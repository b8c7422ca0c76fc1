"""The pieces of `asyncllm bench` that need no engine: requests, percentiles, the roofline's byte counts."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from model_utils import save_tiny_checkpoint

from asyncllm.bench.common import int_range
from asyncllm.bench.report import percentile
from asyncllm.bench.requests import BenchRequest, decode_shape, sharegpt_like_requests, total_tokens, uniform_requests
from asyncllm.bench.roofline import decode_roofline, model_bytes
from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model


def test_uniform_requests_are_seeded_and_in_range() -> None:
    a = uniform_requests(50, (100, 1024), (5, 9), vocab_size=1000, seed=3)
    assert a == uniform_requests(50, (100, 1024), (5, 9), vocab_size=1000, seed=3)
    assert a != uniform_requests(50, (100, 1024), (5, 9), vocab_size=1000, seed=4)
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 5 <= r.output_len <= 9 for r in a)
    assert all(10 <= t < 1000 for r in a for t in r.prompt_token_ids)
    assert total_tokens(a) == (sum(len(r.prompt_token_ids) for r in a), sum(r.output_len for r in a))


def test_sharegpt_like_lengths_have_a_long_tail_and_respect_the_caps() -> None:
    requests = sharegpt_like_requests(2000, vocab_size=500, seed=0, max_input_len=1024, max_output_len=512)
    inputs = sorted(len(r.prompt_token_ids) for r in requests)
    outputs = sorted(r.output_len for r in requests)
    assert 150 < inputs[1000] < 260 and 110 < outputs[1000] < 200  # medians ~200 and ~150
    assert inputs[-1] == 1024 and outputs[-1] == 512 and inputs[0] >= 4  # clipped tails


def test_percentile_interpolates() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(range(101), 99) == 99.0


def test_int_range() -> None:
    assert int_range("100,1024") == (100, 1024) and int_range("7:7") == (7, 7)
    for bad in ("9,3", "0,4", "5"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_range(bad)


def test_bench_refuses_max_model_len_auto_and_lengths_below_1(capsys) -> None:
    """-1 would have run the model's maximum with no fit: refused, naming auto; 0 would have been unset."""
    from asyncllm.bench.common import add_common_args

    parser = argparse.ArgumentParser()
    add_common_args(parser)
    assert parser.parse_args(["--max-model-len", "96"]).max_model_len == 96
    for bad, says in (("-1", "not built for asyncllm bench"), ("auto", "not built"), ("0", "at least 1, got 0")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-model-len", bad])
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama_bias", "qwen2", "qwen3"])  # biases, tied embeddings, q/k norms
def test_model_bytes_count_every_parameter_read_by_a_decode_step(family: str, tmp_path) -> None:
    save_tiny_checkpoint(tmp_path, family)
    hf_config = load_hf_config(str(tmp_path))
    model = load_model(EngineConfig.create(str(tmp_path)), hf_config, torch.device("cpu"), torch.float32)
    params = sum(p.numel() for p in model.parameters())
    if not hf_config.tie_word_embeddings:  # only the batch's rows of a separate embedding table are read
        params -= model.model.embed_tokens.weight.numel()
    weight_bytes, kv_per_token = model_bytes(str(tmp_path), torch.float32)
    assert weight_bytes == 4 * params
    head_dim = getattr(hf_config, "head_dim", None) or 64 // 4
    assert kv_per_token == 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * 4


def test_decode_roofline_arithmetic(tmp_path) -> None:
    save_tiny_checkpoint(tmp_path, "llama")
    weight_bytes, kv = model_bytes(str(tmp_path), torch.bfloat16)
    line = decode_roofline(str(tmp_path), torch.bfloat16, bandwidth=1e12, decode_batch=4, mean_context=100)
    assert line.output_tokens_per_s == pytest.approx(4 * 1e12 / (weight_bytes + 4 * 100 * kv))
    assert line.fraction(line.output_tokens_per_s / 2) == pytest.approx(0.5)


def test_moe_model_bytes_count_the_experts_a_batch_reads() -> None:
    """Batch 1 reads k experts per MoE layer; a large batch reads every parameter (less the embedding table)."""
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint("qwen3_moe", mlp_only_layers=[1])  # 8 experts, top 2, one dense layer
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    every = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    experts = model.model.layers[0].mlp.experts
    one_expert = (experts.w13_weight.numel() + experts.w2_weight.numel()) // 8
    assert model_bytes(path, torch.float32, 10**6)[0] == 4 * every
    assert model_bytes(path, torch.float32, 1)[0] == 4 * (every - 6 * one_expert)
    fp8 = load_model(EngineConfig.create(path, quantization="fp8"), hf_config, torch.device("cpu"), torch.float32)
    stored = sum(p.numel() * p.element_size() for p in fp8.parameters()) - 4 * fp8.model.embed_tokens.weight.numel()
    assert model_bytes(path, torch.float32, 10**6, quantization="fp8")[0] == stored  # experts at one byte too


@pytest.mark.parametrize("arch", ["gemma4", "gemma4_moe"])
def test_gemma4_model_bytes_count_its_own_layers(arch: str) -> None:
    """Gemma 4's layers differ in shape: its bytes are counted on the built model. A large batch reads every
    parameter but the two embedding tables (the tied LM head once); the KV cache stores its two caches per token,
    and a decode step at a long context reads each layer's (the sharing layers their source's), the sliding
    layers' 8-token window of it."""
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint(arch)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    tables = model.model.embed_tokens.weight.numel() * (not model.tie_word_embeddings)
    tables += getattr(getattr(model.model, "embed_tokens_per_layer", None), "weight", torch.empty(0)).numel()
    every = sum(p.numel() for p in model.parameters()) - tables
    assert model_bytes(path, torch.float32, 10**6)[0] == 4 * every
    stored = 4 * 2 * (2 * 16 + 1 * 32)  # a sliding cache (2 KV heads x 16) and a global one (1 x 32), K and V
    assert model_bytes(path, torch.float32)[1] == stored
    global_, sliding = 4 * 2 * 32, 4 * 2 * 32 * 8 / 1000
    layers = len(model.model.layers)
    assert model_bytes(path, torch.float32, 1, mean_context=1000.0)[1] == pytest.approx(layers // 2 * (global_ + sliding))
    if arch == "gemma4_moe":  # batch 1: two of six experts per layer
        experts = model.model.layers[0].experts
        one_expert = (experts.w13_weight.numel() + experts.w2_weight.numel()) // 6
        assert model_bytes(path, torch.float32, 1)[0] == 4 * (every - layers * 4 * one_expert)
        fp8 = load_model(EngineConfig.create(path, quantization="fp8"), hf_config, torch.device("cpu"), torch.float32)
        stored = sum(p.numel() * p.element_size() for p in fp8.parameters()) - 4 * tables  # experts at one byte too
        assert model_bytes(path, torch.float32, 10**6, quantization="fp8")[0] == stored


def test_model_bytes_with_fp8_weights_and_kv_cache(tmp_path) -> None:
    """fp8 quantization counts the decoder's linear weights at one byte; an fp8 cache one byte per element."""
    from asyncllm.models.linear import LinearBase

    save_tiny_checkpoint(tmp_path, "qwen3")
    model = load_model(EngineConfig.create(str(tmp_path)), load_hf_config(str(tmp_path)), torch.device("cpu"),
                       torch.float32)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, LinearBase))
    plain, kv = model_bytes(str(tmp_path), torch.bfloat16)
    quantized, kv_fp8 = model_bytes(str(tmp_path), torch.bfloat16, kv_cache_dtype="fp8", quantization="fp8")
    assert plain - quantized == linear
    assert kv == 2 * kv_fp8


def test_gpt_oss_20b_preset_bytes_match_its_parameters_and_windows(tmp_path) -> None:
    """The preset's model, built on the meta device: the roofline reads each parameter (sinks, router and expert
    biases included; the embedding table but its rows) once at a large batch, 4 of 32 experts a layer at batch 1;
    its KV per token (bf16: K and V x 8 heads x 64 dims x 2 bytes = 2 KiB a layer) counts the 12 sliding-window
    layers' 128 tokens only. The preset is the published config, MXFP4: its experts' weights then count 17/32 of a
    byte each (a GPU reads them packed)."""
    import json

    from asyncllm.bench.model import preset_config
    from asyncllm.models.loader import build_model
    from asyncllm.models.mxfp4_experts import serves_packed

    published = preset_config("gpt-oss-20b")
    assert published["quantization_config"]["quant_method"] == "mxfp4"  # packed on a GPU, dequantized on the CPU
    bf16 = {key: value for key, value in published.items() if key != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(bf16))
    hf_config = load_hf_config(str(tmp_path))
    model = build_model(EngineConfig.create(str(tmp_path)), hf_config, torch.device("cpu"), torch.bfloat16,
                        tensor_device=torch.device("meta"))
    params = sum(p.numel() for p in model.parameters())
    assert params == 20_914_757_184  # gpt-oss-20b's 20.9 B
    every = params - model.model.embed_tokens.weight.numel()
    experts = model.model.layers[0].mlp.experts
    one_expert = sum(p.numel() for p in (experts.w13_weight, experts.w2_weight, experts.w13_bias, experts.w2_bias))
    assert one_expert % 32 == 0
    one_expert //= 32
    assert model_bytes(str(tmp_path), torch.bfloat16, 10**6)[0] == 2 * every
    assert model_bytes(str(tmp_path), torch.bfloat16, 1)[0] == 2 * (every - 24 * 28 * one_expert) == 7_216_614_528

    layer = 2 * 8 * 64 * 2
    assert model_bytes(str(tmp_path), torch.bfloat16)[1] == 24 * layer  # what the cache stores per token
    assert model_bytes(str(tmp_path), torch.bfloat16, mean_context=100)[1] == 24 * layer  # inside the window
    assert model_bytes(str(tmp_path), torch.bfloat16, mean_context=512)[1] == 12 * layer + 12 * layer * 128 / 512
    line = decode_roofline(str(tmp_path), torch.bfloat16, bandwidth=3e12, decode_batch=1, mean_context=512)
    step = 7_216_614_528 + 12 * layer * 512 + 12 * layer * 128
    assert line.output_tokens_per_s == pytest.approx(3e12 / step)

    (tmp_path / "config.json").write_text(json.dumps(published))  # the preset: its experts read packed on a GPU
    expert_weights = 24 * 32 * 3 * 2880 * 2880
    assert model_bytes(str(tmp_path), torch.bfloat16, 10**6, mxfp4_packed=True)[0] == pytest.approx(
        2 * every - expert_weights * (2 - 17 / 32), abs=1)
    assert model_bytes(str(tmp_path), torch.bfloat16, 10**6)[0] == 2 * every  # dequantized (torch_sdpa, the CPU)
    assert serves_packed(load_hf_config(str(tmp_path)), "triton", 2, False)  # 1440 rows a rank: 45 groups
    assert not serves_packed(load_hf_config(str(tmp_path)), "triton", 4, False)  # 720: 22.5 groups
    assert serves_packed(load_hf_config(str(tmp_path)), "triton", 4, True)  # whole experts
    assert not serves_packed(load_hf_config(str(tmp_path)), "torch_sdpa", 1, False)


def _request(prompt: int, output: int) -> BenchRequest:
    return BenchRequest(prompt_token_ids=list(range(10, 10 + prompt)), output_len=output)


def test_decode_shape_is_the_fastest_schedule() -> None:
    """Three requests decoding at once: 10 steps (the longest output), 16 tokens; each token's context weighted."""
    requests = [_request(100, 10), _request(300, 4), _request(50, 2)]
    batch, context = decode_shape(requests, max_num_seqs=256)
    assert batch == pytest.approx(16 / 10)
    assert context == pytest.approx((10 * (100 + 5) + 4 * (300 + 2) + 2 * (50 + 1)) / 16)
    # at most 1 request a step: one token a step, 16 steps
    assert decode_shape(requests, max_num_seqs=1)[0] == pytest.approx(1.0)


def test_decode_shape_bytes_bound_a_step_by_step_count() -> None:
    """The roofline's bytes (steps x weights + tokens x context x KV) are those of the schedule where every request
    decodes from the first step, counted step by step: a workload with mixed lengths is no faster than that."""
    requests = uniform_requests(64, (100, 1024), (100, 1024), 1000, seed=3)
    weights, kv = 1.0e9, 1.0e5
    batch, context = decode_shape(requests, max_num_seqs=256)
    outputs = total_tokens(requests)[1]
    roofline_bytes = outputs / batch * weights + outputs * context * kv
    step_bytes = sum(weights + sum((len(r.prompt_token_ids) + t + 0.5) * kv for r in requests if r.output_len > t)
                     for t in range(max(r.output_len for r in requests)))
    assert roofline_bytes == pytest.approx(step_bytes)
    # the former shape (every request in every step, the per-request mean context) counted fewer bytes
    prompt_tokens = total_tokens(requests)[0]
    former = outputs / len(requests) * weights + outputs * (prompt_tokens + outputs / 2) / len(requests) * kv
    assert former < 0.95 * step_bytes


def _parameters_read(model: Any) -> int:
    """Parameters a large decode batch reads: every module's own, a tied table once (by the LM head, whole), an
    input embedding or learned-position table not at all (only the batch's rows)."""
    from asyncllm.models.embedding import ParallelLMHead, VocabParallelEmbedding
    from asyncllm.models.gpt2 import LearnedPositions

    owner = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in owner or isinstance(module, ParallelLMHead):  # a tied table: read whole by the LM head
                owner[id(p)] = (module, p.numel())
    return sum(n for m, n in owner.values()
               if isinstance(m, ParallelLMHead) or not isinstance(m, (VocabParallelEmbedding, LearnedPositions)))


@pytest.mark.parametrize("arch", ["deepseek_v2", "dbrx", "kimi_linear", "gpt2", "mpt", "starcoder2", "gemma2",
                                  "qwen3_5"])
def test_roofline_of_families_counted_on_the_built_model(arch: str) -> None:
    """The roofline runs after the workload: a family whose experts sit below the layer (DeepSeek's ``mlp.experts``,
    DBRX's), a hybrid with fewer caches than layers (Kimi-Linear), or a config without ``num_key_value_heads``
    (GPT-2, MPT) is counted, not a traceback that loses the run; a two-matrix MLP (StarCoder2), Gemma 2's extra
    norms, a hybrid's linear-attention layers (Qwen3.5: no KV cache) are what the model holds, not a Llama's. A large
    batch reads every parameter but the embedding tables (GPT-2's learned positions too: only the batch's rows);
    batch 1 of a mixture of experts fewer."""
    from asyncllm.models.registry import kv_cache_spec
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint(arch)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    every = _parameters_read(model)
    weights, kv = model_bytes(path, torch.float32, 10**6, mean_context=4.0)  # inside every sliding window
    assert weights == 4 * every
    spec = kv_cache_spec(hf_config, 1)
    assert kv == sum(spec.kv_parts * 4 * heads * dim for heads, dim in spec.shapes())
    if getattr(model, "is_moe", False):
        assert model_bytes(path, torch.float32, 1, mean_context=4.0)[0] < weights


def test_roofline_of_a_multimodal_model_counts_its_decoder(tmp_path) -> None:
    """A decode step runs the language model only: Gemma 3's vision tower and projector are not read (before, the
    roofline failed with a traceback after the run)."""
    from gemma3_mm_utils import make_tiny_gemma3_mm

    path = make_tiny_gemma3_mm(tmp_path)
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    decoder = model.language_model  # its LM head tied to the embedding table: read once, whole
    weights, kv = model_bytes(path, torch.float32, 1, mean_context=4.0)
    assert weights == 4 * sum(p.numel() for p in decoder.parameters())
    text = load_hf_config(path).text_config
    assert kv == 2 * 4 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim


def _meta_build_configs(kind: str) -> Any:
    """A tiny config (no weights) of a family whose model once failed to build on the meta device."""
    import transformers

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if kind in ("qwen2_vl", "qwen2_5_vl"):  # M-RoPE's bands: a repeat_interleave a meta tensor cannot size
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
        if kind == "qwen2_vl":
            return transformers.Qwen2VLConfig(text_config=text, vision_config=dict(
                depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, patch_size=14))
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=14,
            window_size=56, fullatt_block_indexes=[0]))
    if kind == "hunyuan_vl":  # XD-RoPE's axes: the same repeat_interleave
        rope = {"type": "xdrope", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10_000.0, "xdrope_section": [2] * 4}
        return transformers.HunYuanVLConfig(text_config={**text, "head_dim": 16, "rope_scaling": rope},
                                            vision_config=dict(num_hidden_layers=1, hidden_size=32,
                                                               num_attention_heads=2, intermediate_size=64,
                                                               patch_size=8, spatial_merge_size=2),
                                            tie_word_embeddings=True)
    # Gemma 3n: its sparse MLPs' Gaussian quantile (a torch.distributions value: .item() on the meta device)
    gemma3n_text = dict(text, model_type="gemma3n_text", head_dim=16, num_hidden_layers=4, num_kv_shared_layers=2,
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=100, laurel_rank=8,
                        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True)
    if kind == "gemma3n":
        return transformers.Gemma3nTextConfig(**gemma3n_text, architectures=["Gemma3nForCausalLM"])
    return transformers.Gemma3nConfig(text_config=gemma3n_text, vision_config=dict(hidden_size=24, vocab_size=4,
                                                                                  vocab_offset=120),
                                      audio_config=dict(hidden_size=32, vocab_size=4, vocab_offset=124,
                                                        conf_num_hidden_layers=1,
                                                        conf_num_attention_heads=2, sscp_conv_channel_size=[8, 4]),
                                      architectures=["Gemma3nForConditionalGeneration"])


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "hunyuan_vl", "gemma3n", "gemma3n_mm"])
def test_roofline_builds_on_the_meta_device(kind: str, tmp_path) -> None:
    """`asyncllm bench` counts the roofline on a model built on the meta device after its run: Qwen2-VL's and
    HunYuan-VL's rotary axes (a repeat_interleave without ``output_size``) and Gemma 3n's sparse-MLP quantile (an
    ``.item()``) failed there with a traceback that lost the run's results. They build now and count what the
    CPU-built language model holds (less its embedding tables), the CPU build unchanged."""
    from asyncllm.models.loader import build_model

    config = _meta_build_configs(kind)
    config.architectures = config.architectures or [type(config).__name__.replace("Config", "ForConditionalGeneration")]
    config.save_pretrained(tmp_path)  # config.json only: the meta device needs no weights
    path = str(tmp_path)
    hf_config = load_hf_config(path)
    built = build_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    decoder = getattr(built, "language_model", built)
    every = _parameters_read(decoder)
    weights, kv = model_bytes(path, torch.float32, 10**6, mean_context=4.0)
    assert weights == 4 * every and kv > 0
    assert 0 < model_bytes(path, torch.bfloat16, 1, mean_context=100.0)[0] <= 2 * every
    if kind.startswith("gemma3n"):  # the quantile the meta build takes on the CPU is the CPU build's
        meta = build_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32,
                           tensor_device=torch.device("meta"))
        sparse = [m.std_multiplier for m in built.modules() if getattr(m, "sparse", False)]
        assert sparse == [m.std_multiplier for m in meta.modules() if getattr(m, "sparse", False)]
        assert sparse and sparse[0] == pytest.approx(1.6448536)  # icdf(0.95)
    else:  # each rotary column's axis (cos, then sin), as before
        axes = next(m.column_axis for m in decoder.modules() if hasattr(m, "column_axis")).tolist()
        section = [2, 3, 3] if kind != "hunyuan_vl" else [4] * 4
        assert axes == [a for a, n in enumerate(section) for _ in range(n)] * (2 if kind != "hunyuan_vl" else 1)


_CT_W8A8 = {"weights": {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True},
            "input_activations": {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True,
                                  "symmetric": True}}
_CT_W4A16 = {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True}}


def _ct(scheme: dict[str, Any], fmt: str) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], **scheme}}}


_PREQUANTIZED = {  # quantization_config -> the bytes of one served [rows, cols] linear weight and its scales
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, lambda n, k: n * k + 4),
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                  lambda n, k: n * k + 4 * -(-n // 128) * -(-k // 128)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
            lambda n, k: n * k // 2 + (2 + 2) * n * -(-k // 128)),  # float16 scales and zero points per group
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
             lambda n, k: n * k // 2 + (2 + 2) * n * -(-k // 128)),
    "ct_w8a8": (_ct(_CT_W8A8, "int-quantized"), lambda n, k: n * k + 4 * n),  # a float32 scale per row
    "ct_w4a16": (_ct(_CT_W4A16, "pack-quantized"), lambda n, k: n * k // 2 + (2 + 2) * n * -(-k // 128)),
}


@pytest.mark.parametrize("kind", list(_PREQUANTIZED))
def test_roofline_counts_a_prequantized_checkpoint_as_served(kind: str, tmp_path) -> None:
    """A pre-quantized checkpoint builds on the meta device with model-dtype weights (it is quantized at load): its
    linear weights counted 2 bytes each in bf16, twice an fp8 checkpoint's bytes, four times an int4 one's. They
    count as served now: the packed weights and their scales (and zero points) at their group or block size; the
    LM head, norms and modules the config leaves unquantized in bf16; int4 in bf16 off CUDA (dequantized)."""
    import transformers

    quantization_config, served = _PREQUANTIZED[kind]
    hidden, inter, vocab, layers, q, kv = 256, 512, 512, 2, 256, 128  # 4 heads of 64, 2 KV heads
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    float_bytes = model_bytes(_save_config(config, tmp_path / "float"), torch.bfloat16)[0]
    config.quantization_config = quantization_config
    path = _save_config(config, tmp_path / kind)
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]  # qkv, o, gate_up, down
    linear = layers * sum(n * k for n, k in shapes)
    other = 2 * (vocab * hidden + (2 * layers + 1) * hidden)  # the LM head and the norms in bf16
    assert float_bytes == 2 * linear + other
    assert model_bytes(path, torch.bfloat16)[0] == layers * sum(served(n, k) for n, k in shapes) + other
    if kind in ("awq", "gptq", "ct_w4a16"):  # the CPU serves them dequantized
        assert model_bytes(path, torch.bfloat16, int_packed=False)[0] == float_bytes
    if kind in ("awq", "fp8"):  # an unquantized module (modules_to_not_convert) stays in bf16
        config.quantization_config = {**quantization_config, "modules_to_not_convert": ["down_proj"]}
        down = shapes[3]
        expected = layers * (sum(served(n, k) for n, k in shapes[:3]) + 2 * down[0] * down[1]) + other
        assert model_bytes(_save_config(config, tmp_path / "ignored"), torch.bfloat16)[0] == expected


def _save_config(config: Any, path: Any) -> str:
    config.save_pretrained(path)  # config.json only: the meta device needs no weights
    return str(path)


def test_roofline_counts_prequantized_experts_as_served(tmp_path) -> None:
    """A block-wise fp8 mixture of experts: the dense layers and the experts at one byte a weight and a float32 scale
    per block, as the loaded model (``load_format="dummy"``) stores them."""
    import json
    import shutil
    from pathlib import Path

    from asyncllm.tiny import tiny_checkpoint

    src = Path(tiny_checkpoint("qwen3_moe"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for tokenizer_file in src.glob("tokenizer*"):
        shutil.copy(tokenizer_file, tmp_path)
    path = str(tmp_path)
    model = load_model(EngineConfig.create(path, load_format="dummy"), load_hf_config(path), torch.device("cpu"),
                       torch.bfloat16)
    assert model.model.layers[0].mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    stored = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
                 if "cos_sin" not in name) - 2 * model.model.embed_tokens.weight.numel()
    assert model_bytes(path, torch.bfloat16, 10**6)[0] == stored
