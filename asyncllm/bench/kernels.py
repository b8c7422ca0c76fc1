"""kernels: micro-benchmarks of the Triton kernels against their torch references (GPU only).

For each kernel at the real shapes of a preset (Qwen3-0.6B, Llama-3.1-8B; the fused MoE at
Qwen3-30B-A3B's experts, once):
time per call (``triton.testing.do_bench``, median), the bytes it must move,
the bandwidth that implies and its fraction of the measured copy bandwidth
(every one of these kernels is memory-bound), and the speed-up over the
torch reference. Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any, Callable

import torch

from asyncllm.bench import report
from asyncllm.bench.model import preset_config

__all__ = ["add_args", "run", "time_ms"]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", action="append", choices=("qwen3-0.6b", "llama3.1-8b"),
                        help="model shapes to use (repeatable; default: both)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--output-json", help="write the results to this file")
    parser.add_argument("--no-progress", action="store_true", help="accepted for symmetry: there is no bar")


def time_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds per call."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _row(name: str, shape: str, nbytes: int, triton_ms: float, torch_ms: float, bandwidth: float) -> dict[str, Any]:
    achieved = nbytes / (triton_ms / 1000)
    return {"kernel": name, "shape": shape, "triton_us": 1000 * triton_ms, "torch_us": 1000 * torch_ms,
            "speedup": torch_ms / triton_ms, "gb_s": achieved / 1e9, "fraction_of_copy_bw": achieved / bandwidth}


def _elementwise(cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float) -> list[dict[str, Any]]:
    from asyncllm.kernels import reference
    from asyncllm.kernels.rms_norm import fused_add_rms_norm
    from asyncllm.kernels.silu_and_mul import silu_and_mul

    rows, hidden, inter = [], cfg["hidden_size"], cfg["intermediate_size"]
    size = torch.empty((), dtype=dtype).element_size()
    for tokens in (256, 8192):
        x, r = (torch.randn(tokens, hidden, dtype=dtype, device="cuda") for _ in range(2))
        w = torch.randn(hidden, dtype=dtype, device="cuda")
        rows.append(_row("fused_add_rms_norm", f"{tokens}x{hidden}", 4 * tokens * hidden * size,
                         time_ms(lambda: fused_add_rms_norm(x, r, w, 1e-6)),
                         time_ms(lambda: reference.fused_add_rms_norm(x, r, w, 1e-6)), bandwidth))
        gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device="cuda")
        rows.append(_row("silu_and_mul", f"{tokens}x{2 * inter}", 3 * tokens * inter * size,
                         time_ms(lambda: silu_and_mul(gate_up)), time_ms(lambda: reference.silu_and_mul(gate_up)),
                         bandwidth))
    return rows


def _rotary(cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float) -> list[dict[str, Any]]:
    """The rotary/KV-write kernel; for a model with per-head q/k RMSNorm (Qwen3) also with the norm
    fused in, next to the three launches it replaces (two Triton RMSNorms, then the rotary kernel)."""
    from asyncllm.attention.metadata import RotaryInputs
    from asyncllm.kernels import reference
    from asyncllm.kernels.rms_norm import rms_norm
    from asyncllm.kernels.rotary_kv import rotary_embedding_with_kv_cache

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    size, rows = torch.empty((), dtype=dtype).element_size(), []
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cuda") / head_dim))
    cos_sin = reference.build_cos_sin_cache(inv_freq, 1.0, 8192)
    q_w, k_w = (1 + 0.5 * torch.randn(head_dim, dtype=dtype, device="cuda") for _ in range(2))
    eps, qk_norm = cfg.get("rms_norm_eps", 1e-6), cfg.get("model_type") == "qwen3"
    for tokens in (1, 256, 8192):  # a batch-1 decode (launch-bound), a decode batch, a prefill
        q = torch.randn(tokens, heads, head_dim, dtype=dtype, device="cuda")
        k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2))
        cache = torch.zeros(2, tokens // 16 + 1, 16, kv_heads, head_dim, dtype=dtype, device="cuda")
        positions = torch.randint(0, 8192, (tokens,), device="cuda")
        slots = torch.randperm(tokens, device="cuda")

        def torch_path(rotary: RotaryInputs) -> None:
            qr, kr = reference.norm_and_rotate(q, k, rotary)
            reference.write_kv_cache(kr, v, cache, slots)

        def fused(*norm: Any) -> None:
            rotary_embedding_with_kv_cache(q, k, v, positions, cos_sin, cache[0], cache[1], slots, *norm)

        def three_launches() -> None:
            normed = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
            rotary_embedding_with_kv_cache(*normed, v, positions, cos_sin, cache[0], cache[1], slots)

        shape = f"{tokens}x({heads}+{kv_heads})x{head_dim}"
        nbytes = 2 * tokens * (heads + 2 * kv_heads) * head_dim * size
        plain_torch_ms = time_ms(lambda: torch_path(RotaryInputs(positions, cos_sin)))
        rows.append(_row("rotary_kv", shape, nbytes, time_ms(fused), plain_torch_ms, bandwidth))
        if qk_norm:
            torch_ms = time_ms(lambda: torch_path(RotaryInputs(positions, cos_sin, q_w, k_w, eps)))
            rows.append(_row("rotary_kv + qk_norm fused", shape, nbytes, time_ms(lambda: fused(q_w, k_w, eps)),
                             torch_ms, bandwidth))
            rows.append(_row("rotary_kv + qk_norm 3 launches", shape, nbytes, time_ms(three_launches), torch_ms,
                             bandwidth))
    return rows


def _attention(cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float) -> list[dict[str, Any]]:
    from asyncllm.bench.kernel_steps import attention_step
    from asyncllm.kernels import reference
    from asyncllm.kernels.paged_attention import paged_attention

    rows = []
    cases = {"decode 256 x 1k": [(1024, 1)] * 256, "decode 1 x 4k": [(4096, 1)], "decode 1 x 640": [(640, 1)],
             "prefill 8 x 1k": [(0, 1024)] * 8, "chunk 512 over 3.5k": [(3584, 512)]}
    for name, requests in cases.items():
        step = attention_step(cfg, requests, dtype, random.Random(0))
        md, q, cache = step.metadata, step.query, step.kv_cache
        scale = step.head_dim**-0.5
        rows.append(_row(f"paged_attention {name}", f"{len(requests)} reqs", step.bytes_read,
                         time_ms(lambda: paged_attention(q, cache[0], cache[1], md.query_start_loc, md.seq_lens,
                                                        md.block_tables, scale)),
                         time_ms(lambda: reference.paged_attention(q, cache, md, scale)), bandwidth))
    return rows


def _split_decode(cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float) -> list[dict[str, Any]]:
    """The split-KV decode kernels on the batch-1 decodes the unified kernel leaves SMs idle on."""
    from asyncllm.attention.triton import split_kv_segments
    from asyncllm.bench.kernel_steps import attention_step
    from asyncllm.kernels import reference
    from asyncllm.kernels.paged_decode import paged_decode

    rows, sms = [], torch.cuda.get_device_properties(0).multi_processor_count
    segments = split_kv_segments(1, 1, cfg["num_key_value_heads"], sms)
    for name, context in (("1 x 4k", 4096), ("1 x 640", 640)):
        step = attention_step(cfg, [(context, 1)], dtype, random.Random(0))
        md, q, cache = step.metadata, step.query, step.kv_cache
        scale = step.head_dim**-0.5
        rows.append(_row(f"paged_decode split-KV decode {name}", f"1 req, {segments} segments", step.bytes_read,
                         time_ms(lambda: paged_decode(q, cache[0], cache[1], md.query_start_loc, md.seq_lens,
                                                     md.block_tables, scale, segments)),
                         time_ms(lambda: reference.paged_attention(q, cache, md, scale)), bandwidth))
    return rows


def _decode_linear(
    cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float, device: str = "cuda"
) -> list[dict[str, Any]]:
    """The decode matrix-vector kernel with its prologue fused, against what it would replace: the
    Triton norm or activation kernel, then torch's matmul (cuBLAS); plain products against the matmul alone."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    size, rows = torch.empty((), dtype=dtype).element_size(), []
    products = {  # name: (prologue, input width, output width)
        "qkv (+add_rms_norm)": ("add_rms_norm", hidden, (heads + 2 * kv_heads) * head_dim),
        "gate_up (+add_rms_norm)": ("add_rms_norm", hidden, 2 * inter),
        "down (+silu_and_mul)": ("silu_and_mul", inter, hidden),
        "o_proj": (None, heads * head_dim, hidden),
        "lm_head": (None, hidden, vocab),
    }
    from asyncllm.kernels.decode_linear import FUSED_ROWS

    for num_rows in (1, FUSED_ROWS, 2 * FUSED_ROWS):  # the models' cut: fused up to FUSED_ROWS rows
        for name, (prologue, k, n) in products.items():
            fused, unfused = _linear_pair(prologue, num_rows, k, n, dtype, device)
            nbytes = (n * k + num_rows * (k + n)) * size
            rows.append(_row(f"decode_linear {name} vs cuBLAS", f"{num_rows}x{k}->{n}", nbytes, time_ms(fused),
                             time_ms(unfused), bandwidth))
    return rows


def _linear_pair(prologue: str | None, num_rows: int, k: int, n: int, dtype: torch.dtype,
                 device: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(the fused kernel's call, the unfused calls) on random inputs of one product's shape."""
    import torch.nn.functional as F

    from asyncllm.kernels.decode_linear import decode_linear
    from asyncllm.kernels.rms_norm import fused_add_rms_norm
    from asyncllm.kernels.silu_and_mul import silu_and_mul

    x = torch.randn(num_rows, 2 * k if prologue == "silu_and_mul" else k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) * 0.02
    res, norm_w = torch.randn(num_rows, k, dtype=dtype, device=device), torch.ones(k, dtype=dtype, device=device)
    if prologue == "add_rms_norm":
        return (lambda: decode_linear(x, w, prologue=prologue, residual=res, norm_weight=norm_w),
                lambda: F.linear(fused_add_rms_norm(x, res, norm_w, 1e-6)[0], w))
    if prologue == "silu_and_mul":
        return lambda: decode_linear(x, w, prologue=prologue), lambda: F.linear(silu_and_mul(x), w)
    return lambda: decode_linear(x, w), lambda: F.linear(x, w)


def _block_fp8(cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float, device: str = "cuda") -> list[dict[str, Any]]:
    """A pre-quantized fp8 checkpoint's product (128x128 weight blocks): the per-token-group quantizer plus the
    block-scaled fp8 GEMM, against torch's matmul of the model-dtype weight (cuBLAS) that it replaces; bytes: the
    fp8 weight, its scales and the activations."""
    import torch.nn.functional as F

    from asyncllm.kernels.block_fp8 import per_token_group_quant_fp8, w8a8_block_fp8_matmul

    hidden, inter, size, rows = cfg["hidden_size"], cfg["intermediate_size"], dtype.itemsize, []
    for name, k, n in (("gate_up", hidden, 2 * inter), ("down", inter, hidden)):
        w = torch.randn(n, k, dtype=dtype, device=device) * 0.02
        w_q = w.to(torch.float8_e4m3fn)
        w_s = torch.ones(-(-n // 128), -(-k // 128), device=device)
        for tokens in (1, 16, 256):
            x = torch.randn(tokens, k, dtype=dtype, device=device)

            def fp8(x: torch.Tensor = x) -> torch.Tensor:
                return w8a8_block_fp8_matmul(*per_token_group_quant_fp8(x, 128), w_q, w_s, (128, 128), dtype)

            nbytes = n * k + w_s.numel() * 4 + tokens * (k + n) * size
            rows.append(_row(f"block_fp8 {name} vs cuBLAS {str(dtype)[6:]}", f"{tokens}x{k}->{n}", nbytes, time_ms(fp8),
                             time_ms(lambda x=x, w=w: F.linear(x, w)), bandwidth))
    return rows


def _int8_quant(cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float, device: str = "cuda",
                token_counts: tuple[int, ...] = (16, 8192)) -> list[dict[str, Any]]:
    """W8A8 int8 experts' per-token activation quantizer (one Triton kernel) against the torch function it replaces."""
    from asyncllm.kernels import reference
    from asyncllm.kernels.int8_quant import quantize_int8_per_token

    return _quantizer_rows("quantize_int8_per_token", quantize_int8_per_token, reference.quantize_int8_per_token,
                           cfg, dtype, bandwidth, device, token_counts)


def _static_fp8_quant(cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float, device: str = "cuda",
                      token_counts: tuple[int, ...] = (16, 8192)) -> list[dict[str, Any]]:
    """Static fp8 activation scales' quantizer (per-tensor fp8 experts' inputs; one Triton kernel) against the torch
    function it replaces (a float32 copy of the input)."""
    from asyncllm.kernels import reference
    from asyncllm.kernels.block_fp8 import static_quant_fp8

    scale = torch.tensor(1 / 64, device=device)
    return _quantizer_rows("static_quant_fp8", lambda x: static_quant_fp8(x, scale),
                           lambda x: reference.static_quant_fp8(x, scale), cfg, dtype, bandwidth, device, token_counts)


def _quantizer_rows(name: str, kernel: Callable, torch_fn: Callable, cfg: dict[str, Any], dtype: torch.dtype,
                    bandwidth: float, device: str, token_counts: tuple[int, ...]) -> list[dict[str, Any]]:
    """A per-token activation quantizer's rows at the hidden and intermediate widths; bytes: the input read once,
    the 1-byte values and the float32 scales written."""
    rows = []
    for k in (cfg["hidden_size"], cfg["intermediate_size"]):
        for tokens in token_counts:
            x = torch.randn(tokens, k, dtype=dtype, device=device)
            rows.append(_row(name, f"{tokens}x{k}", tokens * (k * (dtype.itemsize + 1) + 4),
                             time_ms(lambda x=x: kernel(x)), time_ms(lambda x=x: torch_fn(x)), bandwidth))
    return rows


def _w4a16(cfg: dict[str, Any], dtype: torch.dtype, bandwidth: float, device: str = "cuda") -> list[dict[str, Any]]:
    """A pre-quantized AWQ / GPTQ checkpoint's product (4-bit values, groups of 128; in order, and GPTQ's
    act-order g_idx) against torch's matmul of the model-dtype weight (cuBLAS) that it replaces; bytes: the packed
    weight, its float16 scales and zero points, and the activations."""
    import torch.nn.functional as F

    from asyncllm.kernels.w4a16 import w4a16_matmul

    hidden, inter, size, rows = cfg["hidden_size"], cfg["intermediate_size"], dtype.itemsize, []
    if dtype == torch.float32:
        return rows  # the kernel's float32 path is the exact (slow) one: no row against cuBLAS's tf32
    for name, k, n in (("gate_up", hidden, 2 * inter), ("down", inter, hidden)):
        w = torch.randn(n, k, dtype=dtype, device=device) * 0.02
        qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device)
        scales = torch.full((k // 128, n), 0.002, dtype=torch.float16, device=device)
        zeros = torch.full_like(scales, 8.0)
        act_order = (torch.arange(k, device=device) // 128)[torch.randperm(k, device=device)].to(torch.int32)
        for tokens in (1, 16, 256):
            x = torch.randn(tokens, k, dtype=dtype, device=device)
            nbytes = k * n // 2 + 2 * scales.numel() * 2 + tokens * (k + n) * size
            for label, g_idx in (("", None), (" act-order", act_order)):
                def int4(x: torch.Tensor = x, g_idx: torch.Tensor | None = g_idx) -> torch.Tensor:
                    return w4a16_matmul(x, qweight, scales, zeros, g_idx, 4, 128)

                rows.append(_row(f"w4a16{label} {name} vs cuBLAS {str(dtype)[6:]}", f"{tokens}x{k}->{n}", nbytes,
                                 time_ms(int4), time_ms(lambda x=x, w=w: F.linear(x, w)), bandwidth))
    return rows


MOE_SHAPE = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8}
"""Qwen3-30B-A3B's experts (its config.json's keys): the fused-MoE rows' shape, measured once, whatever the
``--preset`` (this command's presets are dense models)."""


def _fused_moe(
    shape: dict[str, int], dtype: torch.dtype, bandwidth: float, device: str = "cuda"
) -> list[dict[str, Any]]:
    """The fused-MoE kernels (alignment, gate_up + SiLU, down, sum over k) against `reference.fused_moe`
    (a loop over the routed experts) at decode batches; bytes: the routed experts' weights plus the
    activations (weights dominate: at 256 tokens nearly every expert is routed to)."""
    from asyncllm.kernels import reference
    from asyncllm.kernels.fused_moe import fused_moe

    hidden, inter = shape["hidden_size"], shape["moe_intermediate_size"]
    experts, k = shape["num_experts"], shape["num_experts_per_tok"]
    size, rows = torch.empty((), dtype=dtype).element_size(), []
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype, device=device, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, dtype=dtype, device=device, generator=gen) * inter**-0.5
    for tokens in (1, 64, 256):
        x = torch.randn(tokens, hidden, dtype=dtype, device=device, generator=gen)
        logits = torch.randn(tokens, experts, device=device, generator=gen)
        topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        routed = int(torch.unique(topk_ids).numel())
        nbytes = (3 * routed * hidden * inter + 2 * tokens * hidden + 3 * tokens * k * inter) * size
        rows.append(_row(f"fused_moe E={experts} k={k} vs torch", f"{tokens}x{hidden}x{inter}", nbytes,
                         time_ms(lambda: fused_moe(x, w13, w2, topk_weights, topk_ids)),
                         time_ms(lambda: reference.fused_moe(x, w13, w2, topk_weights, topk_ids)), bandwidth))
    return rows


GATED_DELTA_HEADS = (48, 128, 128)
"""Qwen3.5-27B's Gated DeltaNet decode state per request: (value heads, key dim, value dim), float32."""
SSD_HEADS = (128, 64, 128)
"""granite-4.0-h-small's Mamba2 decode state per request: (heads, head dim, state), float32."""


def _state_steps(bandwidth: float, device: str = "cuda", gated_delta: tuple[int, int, int] = GATED_DELTA_HEADS,
                 ssd: tuple[int, int, int] = SSD_HEADS) -> list[dict[str, Any]]:
    """The hybrids' decode steps (gated delta rule, Mamba2 scan) against their torch references (a gather, several
    passes, a scatter) at 1, 32 and 128 requests; bytes: each request's state read and written once."""
    from asyncllm.kernels import reference
    from asyncllm.kernels.gated_delta import gated_delta_step
    from asyncllm.kernels.ssd_step import ssd_decode_step

    gen, rows_out = torch.Generator(device=device).manual_seed(0), []

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    for name, (h, d1, d2), kernel, torch_path in (("gated_delta_step", gated_delta, gated_delta_step,
                                                   reference.gated_delta_step),
                                                  ("ssd_decode_step", ssd, ssd_decode_step, reference.ssd_decode_step)):
        for n in (1, 32, 128):
            states, rows = rand(2 * n, h, d1, d2), torch.randperm(2 * n, device=device, generator=gen)[:n]
            if kernel is gated_delta_step:  # q, k [n, h, d1], v [n, h, d2], g, beta [n, h]
                args = (torch.nn.functional.normalize(rand(n, h, d1), dim=-1),
                        torch.nn.functional.normalize(rand(n, h, d1), dim=-1), rand(n, h, d2), -rand(n, h).abs(),
                        rand(n, h).sigmoid())
            else:  # x [n, h, d1], b, c [n, h, d2], dt [n, h], a [h]
                args = (rand(n, h, d1), rand(n, h, d2), rand(n, h, d2), rand(n, h).sigmoid(), -rand(h).abs())
            rows_out.append(_row(f"{name} vs torch", f"{n}x{h}x{d1}x{d2}", 2 * n * h * d1 * d2 * 4,
                                 time_ms(lambda: kernel(states, rows, *args)),
                                 time_ms(lambda: torch_path(states, rows, *args)), bandwidth))
    return rows_out


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        print("asyncllm bench kernels: the kernel micro-benchmarks need a CUDA device, and none is visible; "
              "nothing to measure here (the kernels' correctness tests run on the CPU under TRITON_INTERPRET=1).",
              file=sys.stderr)
        return None
    from asyncllm.bench.roofline import measure_copy_bandwidth

    dtype = getattr(torch, args.dtype)
    bandwidth = measure_copy_bandwidth(torch.device("cuda"))
    print(f"[roofline] measured copy bandwidth {bandwidth / 1e9:,.1f} GB/s (read + write)", flush=True)
    results: dict[str, Any] = {"meta": report.run_metadata(argv), "copy_bandwidth_gb_s": bandwidth / 1e9, "presets": {}}
    for preset in args.preset or ["qwen3-0.6b", "llama3.1-8b"]:
        cfg = preset_config(preset)
        rows = (_elementwise(cfg, dtype, bandwidth) + _rotary(cfg, dtype, bandwidth) + _attention(cfg, dtype, bandwidth)
                + _split_decode(cfg, dtype, bandwidth) + _decode_linear(cfg, dtype, bandwidth)
                + _block_fp8(cfg, dtype, bandwidth) + _int8_quant(cfg, dtype, bandwidth)
                + _static_fp8_quant(cfg, dtype, bandwidth)
                + _w4a16(cfg, dtype, bandwidth))
        results["presets"][preset] = rows
        _print_rows(f"asyncllm bench kernels | {preset} | {args.dtype} | {results['meta']['device']}", rows)
    results["moe"] = _fused_moe(MOE_SHAPE, dtype, bandwidth)
    _print_rows(f"asyncllm bench kernels | Qwen3-30B-A3B experts | {args.dtype} | {results['meta']['device']}",
                results["moe"])
    results["state_steps"] = _state_steps(bandwidth)
    _print_rows(f"asyncllm bench kernels | hybrid decode steps (Qwen3.5-27B, granite-4.0-h-small) | float32 | "
                f"{results['meta']['device']}", results["state_steps"])
    if args.output_json:
        report.write_json(args.output_json, results)
    return results


def _print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    print(f"{'kernel':<44} {'shape':<22} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        print(f"{r['kernel']:<44} {r['shape']:<22} {r['triton_us']:>10.1f} {r['torch_us']:>10.1f} "
              f"{r['speedup']:>8.2f} {r['gb_s']:>8.0f} {r['fraction_of_copy_bw']:>8.1%}", flush=True)
