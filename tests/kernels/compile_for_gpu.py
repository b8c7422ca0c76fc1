"""Compile every Triton kernel ahead of time for a CUDA target, with no GPU and no interpreter.

Run as a script (``python compile_for_gpu.py [SM ...]``) by test_kernels_compile.py: the
interpreter accepts code the real compiler rejects (and the reverse), so this lowers each
kernel through Triton's whole NVIDIA pipeline down to a cubin (the wheel ships ptxas), at
the real models' constexprs. Prints one line per kernel; exits 1 on the first failure.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from asyncllm.kernels import block_fp8, decode_linear, fused_moe, gated_delta, int8_quant, kv_write, paged_attention, paged_decode, rms_norm, rotary_kv, silu_and_mul, ssd_step, w4a16  # noqa: E402,E501


def _compile(kernel, pointers: dict[str, str], floats: tuple[str, ...], consts: dict, target: GPUTarget, warps: int,
             divisible: tuple[str, ...] = (), stages: int | None = None):
    """``divisible``: the arguments Triton's launcher specializes as multiples of 16 at the real shapes
    (it does so for any such pointer or integer; a kernel whose loads vectorize, and so pipeline, only
    then is compiled as it runs). ``stages``: num_stages, when the launcher sets it."""
    signature = {}
    for name in kernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=target, options=options)


def cases(dtype: str):
    """Every kernel at the real models' constexprs (fp32 differs only in the dot precision: GPU tests cover it)."""
    p = f"*{dtype}"
    for gemma in (False, True):  # Gemma 2 / 3's norm: (1 + weight), one rounding
        yield (f"rms_norm gemma={gemma}", rms_norm._rms_norm_kernel,
               dict(x_ptr=p, residual_ptr=p, weight_ptr=p, out_ptr=p, residual_out_ptr=p), ("eps",),
               dict(HAS_RESIDUAL=True, BLOCK=4096, GEMMA=gemma), 16)
    for gelu in (False, True):  # SiLU; Gemma's GeGLU
        yield (f"silu_and_mul gelu_tanh={gelu}", silu_and_mul._silu_and_mul_kernel, dict(x_ptr=p, out_ptr=p), (),
               dict(BLOCK=1024, GELU_TANH=gelu), 4)
    # Llama-3.1-8B; Qwen3-0.6B with its q/k norm fused in; a Gemma 4 global layer (D 512, 32 heads, 4 KV heads)
    for heads, kv_heads, head_dim, norm in ((32, 8, 128, False), (16, 8, 128, True), (32, 4, 512, False)):
        yield (f"rotary_kv qk_norm={norm} head_dim={head_dim}", rotary_kv._rotary_kv_kernel,
               dict(q_ptr=p, k_ptr=p, v_ptr=p, q_out_ptr=p, k_cache_ptr=p, v_cache_ptr=p, positions_ptr="*i64",
                    cos_sin_ptr="*fp32", slot_mapping_ptr="*i64", q_norm_ptr=p, k_norm_ptr=p), ("norm_eps",),
               dict(Q_HEADS=heads, KV_HEADS=kv_heads, HALF=head_dim // 2, HEAD_DIM=head_dim, HAS_NORM=norm), 4)
    for head_dim, values in ((128, True), (1024, False)):  # BLOOM's ALiBi layers; DeepSeek-V3's 576-wide latent row
        yield (f"kv_write head_dim={head_dim} values={values}", kv_write._kv_write_kernel,
               dict(k_ptr=p, v_ptr=p, k_cache_ptr=p, v_cache_ptr=p, slot_mapping_ptr="*i64"), (),
               dict(HEAD_DIM=head_dim, HAS_VALUE=values), 4)
    # Llama (no window), Mistral (window), Gemma 2's sliding layers (window + score cap: 8 heads, 4 KV heads, D 256),
    # gpt-oss's sliding layers (window + sinks: 64 heads, 8 KV heads, D 64), Gemma 3's sliding layers with image
    # tokens, Llama 4 Scout's chunked local layers (40 heads, 8 KV heads: 5 queries per KV head, D 128), a Gemma 4
    # global layer (32 heads, 4 KV heads, D 512), DeepSeek-V3's latent cache at TP 8 (16 heads over its one 576-wide
    # row, padded to 1024)
    for window, softcap, sinks, limit, chunk, queries_per_kv, head_dim, tile_n in (
            (False, False, False, False, False, 4, 128, 64), (True, False, False, False, False, 4, 128, 64),
            (True, True, False, False, False, 2, 256, 32), (True, False, True, False, False, 8, 64, 64),
            (True, True, False, True, False, 2, 256, 32), (False, False, False, False, True, 5, 128, 64),
            (False, False, False, False, False, 8, 512, 32), (False, False, False, False, False, 16, 1024, 32)):
        block_q = 16 // queries_per_kv
        yield (f"paged_attention window={window} softcap={softcap} sinks={sinks} attend_limit={limit} chunk={chunk} "
               f"head_dim={head_dim}",
               paged_attention._paged_attention_kernel,
               dict(out_ptr=p, q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                    query_start_loc_ptr="*i32", sinks_ptr=p, attend_limit_ptr="*i32", alibi_ptr="*fp32"), ("scale", "softcap"),
               dict(QUERIES_PER_KV=queries_per_kv, BLOCK_Q=block_q, BLOCK_M=16, TILE_N=tile_n, HEAD_DIM=head_dim,
                    USE_WINDOW=window, USE_SOFTCAP=softcap, USE_SINKS=sinks, USE_LIMIT=limit, USE_CHUNK=chunk,
                    USE_ALIBI=False, DOT_PRECISION="tf32"), 8)
    # BLOOM-176B's ALiBi (112 heads, each its own KV head: one query per KV head, D 128) in both attention kernels
    yield ("paged_attention alibi", paged_attention._paged_attention_kernel,
           dict(out_ptr=p, q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                query_start_loc_ptr="*i32", sinks_ptr=p, attend_limit_ptr="*i32", alibi_ptr="*fp32"),
           ("scale", "softcap"),
           dict(QUERIES_PER_KV=1, BLOCK_Q=16, BLOCK_M=16, TILE_N=64, HEAD_DIM=128, USE_WINDOW=False, USE_SOFTCAP=False,
                USE_SINKS=False, USE_LIMIT=False, USE_CHUNK=False, USE_ALIBI=True, DOT_PRECISION="tf32"), 8)
    decode = dict(TILE_N=64, HEAD_DIM=128, NUM_SEGMENTS=16)
    yield ("paged_decode segment alibi", paged_decode._decode_segment_kernel,
           dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", q_ptr=p, k_cache_ptr=p, v_cache_ptr=p,
                block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", alibi_ptr="*fp32"),
           ("scale", "softcap"), dict(QUERIES_PER_KV=1, BLOCK_M=16, USE_WINDOW=False, USE_SOFTCAP=False,
                                      USE_CHUNK=False, USE_ALIBI=True, DOT_PRECISION="tf32", **decode), 4)
    for window, softcap, chunk in ((False, False, False), (True, False, False), (True, True, False),
                                   (False, False, True)):
        yield (f"paged_decode segment window={window} softcap={softcap} chunk={chunk}",
               paged_decode._decode_segment_kernel,
               dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", q_ptr=p, k_cache_ptr=p, v_cache_ptr=p,
                    block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", alibi_ptr="*fp32"),
               ("scale", "softcap"),
               dict(QUERIES_PER_KV=4, BLOCK_M=16, USE_WINDOW=window, USE_SOFTCAP=softcap, USE_CHUNK=chunk,
                    USE_ALIBI=False, DOT_PRECISION="tf32", **decode), 4)
    for queries_per_kv, head_dim in ((8, 512), (16, 1024)):  # Gemma 4's global layers; DeepSeek-V3's latent cache
        yield (f"paged_decode segment head_dim={head_dim}", paged_decode._decode_segment_kernel,
               dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", q_ptr=p, k_cache_ptr=p, v_cache_ptr=p,
                    block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", alibi_ptr="*fp32"),
               ("scale", "softcap"),
               dict(QUERIES_PER_KV=queries_per_kv, BLOCK_M=16, USE_WINDOW=False, USE_SOFTCAP=False, USE_CHUNK=False,
                    USE_ALIBI=False, DOT_PRECISION="tf32", TILE_N=32, HEAD_DIM=head_dim, NUM_SEGMENTS=16), 4)
    for prologue, block_n, block_k in ((0, 64, 128), (1, 16, 512), (2, 4, 512)):  # LM head, QKV, down projection
        yield (f"decode_linear prologue={prologue}", decode_linear._decode_linear_kernel,
               dict(x_ptr=p, residual_ptr=p, norm_w_ptr=p, weight_ptr=p, bias_ptr=p, out_ptr=p, residual_out_ptr=p),
               ("eps",), dict(PROLOGUE=prologue, HAS_BIAS=prologue == 0, BLOCK_N=block_n, BLOCK_K=block_k), 4)
    for window, sinks, chunk in ((True, False, False), (True, True, False), (False, False, True)):  # gpt-oss: sinks
        yield (f"paged_decode combine window={window} sinks={sinks} chunk={chunk}", paged_decode._decode_combine_kernel,
               dict(out_ptr=p, max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", seq_lens_ptr="*i32",
                    query_start_loc_ptr="*i32", sinks_ptr=p), (),
               dict(USE_WINDOW=window, USE_SINKS=sinks, USE_CHUNK=chunk, **decode), 4)
    yield from fp8_cache_cases(p, decode)
    yield from moe_cases(p)
    yield from block_fp8_cases(p)
    yield from w4a16_cases(p)
    # Qwen3.5's Gated DeltaNet decode step: Dk = Dv = 128, 32 value columns per program
    f32 = "*fp32"
    yield ("gated_delta step", gated_delta._gated_delta_step_kernel,
           dict(states_ptr=f32, rows_ptr="*i64", q_ptr=f32, k_ptr=f32, v_ptr=f32, g_ptr=f32, beta_ptr=f32,
                out_ptr=f32), (), dict(BLOCK_K=128, BLOCK_V=32), 4)
    # Granite 4.0 / Nemotron-H's Mamba2 decode step: head dim 64, state 128, 16 head-dim rows per program
    yield ("ssd step", ssd_step._ssd_step_kernel,
           dict(states_ptr=f32, rows_ptr="*i64", x_ptr=f32, b_ptr=f32, c_ptr=f32, dt_ptr=f32, a_ptr=f32, out_ptr=f32),
           (), dict(BLOCK_P=16, BLOCK_S=128), 4)


def fp8_cache_cases(p: str, decode: dict):
    """The kernels that write or read the KV cache, over an fp8 cache (kv_cache_dtype='fp8' / 'fp8_e5m2')."""
    for fp8 in ("fp8e4nv", "fp8e5"):
        c = f"*{fp8}"
        yield (f"rotary_kv {fp8} cache", rotary_kv._rotary_kv_kernel,
               dict(q_ptr=p, k_ptr=p, v_ptr=p, q_out_ptr=p, k_cache_ptr=c, v_cache_ptr=c, positions_ptr="*i64",
                    cos_sin_ptr="*fp32", slot_mapping_ptr="*i64", q_norm_ptr=p, k_norm_ptr=p), ("norm_eps",),
               dict(Q_HEADS=16, KV_HEADS=8, HALF=64, HEAD_DIM=128, HAS_NORM=True), 4)
        yield (f"kv_write {fp8} cache", kv_write._kv_write_kernel,
               dict(k_ptr=p, v_ptr=p, k_cache_ptr=c, v_cache_ptr=c, slot_mapping_ptr="*i64"), (),
               dict(HEAD_DIM=128, HAS_VALUE=True), 4)
    c = "*fp8e4nv"
    yield ("paged_attention fp8e4nv cache", paged_attention._paged_attention_kernel,
           dict(out_ptr=p, q_ptr=p, k_cache_ptr=c, v_cache_ptr=c, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                query_start_loc_ptr="*i32", sinks_ptr=p, attend_limit_ptr="*i32", alibi_ptr="*fp32"), ("scale", "softcap"),
           dict(QUERIES_PER_KV=4, BLOCK_Q=4, BLOCK_M=16, TILE_N=64, HEAD_DIM=128, USE_WINDOW=False,
                USE_SOFTCAP=False, USE_SINKS=False, USE_LIMIT=False, USE_CHUNK=False, USE_ALIBI=False, DOT_PRECISION="tf32"), 8)
    yield ("paged_decode segment fp8e4nv cache", paged_decode._decode_segment_kernel,
           dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", q_ptr=p, k_cache_ptr=c, v_cache_ptr=c,
                block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", alibi_ptr="*fp32"),
               ("scale", "softcap"),
           dict(QUERIES_PER_KV=4, BLOCK_M=16, USE_WINDOW=False, USE_SOFTCAP=False, USE_CHUNK=False,
                USE_ALIBI=False, DOT_PRECISION="tf32", **decode), 4)


def moe_cases(p: str):
    """The fused-MoE grouped products at both block configurations `moe_config` picks on a GPU (decode,
    prefill), with the real shapes' multiples of 16 (H 2048, I 768, contiguous weights), as launched."""
    aligned = dict(sorted_pairs_ptr="*i32", block_experts_ptr="*i32", total_rows_ptr="*i64", bias_ptr=p,
                   a_s_ptr=p, w_s_ptr=p, w_z_ptr=p, g_idx_ptr=p)
    fp8 = dict(a_s_ptr="*fp32", w_s_ptr="*fp32")
    ints = dict(w_s_ptr="*fp32", w_z_ptr="*fp32", g_idx_ptr="*i32")
    mxfp4_scales = dict(w_s_ptr="*u8")  # e8m0 exponents; no zero points (w_z_ptr unread)
    # Qwen3-30B-A3B (E=128, k=8): 1 token, 8192 tokens; gpt-oss-20b (E=32, k=4, biases, clamped SwiGLU): 1 token;
    # Nemotron-3-Nano (E=128, k=6, no gate: relu2): 8192 tokens; DeepSeek-V3 (E=256, k=8, block fp8): 1, 8192;
    # Gemma 4's GELU-tanh experts (E=128, k=8): 8192 tokens; Qwen3-30B-A3B-GPTQ-Int4 (int4 experts, groups of 128): 1,
    # 8192; Qwen3-30B-A3B-FP8-dynamic (per-row fp8 experts: one scale group of all of K, 2048): 1 token; gpt-oss-20b's
    # and gpt-oss-120b's MXFP4 experts kept packed (E=32 and 128, k=4, biases, clamped SwiGLU): 1 token, 8192 tokens;
    # Qwen3-30B-A3B-quantized.w8a8 (int8 experts, one scale per row and per token: the fp8 path on int8): 1, 8192;
    # a GPTQ act-order Qwen3-30B-A3B (int4 experts with each matrix's g_idx: G_IDX): 1, 8192 tokens
    for num_pairs, experts, top_k, gpt_oss, gated, fp8_group, gelu, bits, mxfp4, int8, g_idx in (
            (8, 128, 8, False, True, 0, False, 0, False, False, False),
            (65536, 128, 8, False, True, 0, False, 0, False, False, False),
            (4, 32, 4, True, True, 0, False, 0, False, False, False),
            (49152, 128, 6, False, False, 0, False, 0, False, False, False),
            (8, 256, 8, False, True, 128, False, 0, False, False, False),
            (65536, 256, 8, False, True, 128, False, 0, False, False, False),
            (65536, 128, 8, False, True, 0, True, 0, False, False, False),
            (8, 128, 8, False, True, 0, False, 4, False, False, False),
            (65536, 128, 8, False, True, 0, False, 4, False, False, False),
            (8, 128, 8, False, True, 2048, False, 0, False, False, False),
            (4, 32, 4, True, True, 0, False, 0, True, False, False),
            (32768, 128, 4, True, True, 0, False, 0, True, False, False),
            (8, 128, 8, False, True, 2048, False, 0, False, True, False),
            (65536, 128, 8, False, True, 2048, False, 0, False, True, False),
            (8, 128, 8, False, True, 0, False, 4, False, False, True),
            (65536, 128, 8, False, True, 0, False, 4, False, False, True)):
        is_fp8 = fp8_group > 0
        cfg = fused_moe.launch_config(num_pairs, experts, torch.bfloat16, True, fp8_group if is_fp8 else None,
                                      bool(bits or mxfp4), g_idx)  # as launched
        blocks = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="tf32",
                      HAS_BIAS=gpt_oss, FP8=is_fp8, GROUP_N=(128 if fp8_group == 128 else 1) if is_fp8 else 1,
                      UPCAST=False, INT_BITS=bits, MXFP4=mxfp4, G_IDX=g_idx, INT8=int8,
                      GROUP_K=128 if bits else fp8_group or (32 if mxfp4 else 1))
        w = ("*i8" if int8 else "*fp8e4nv") if is_fp8 else "*i32" if bits else "*u8" if mxfp4 else p
        packed = bits or mxfp4  # the activations stay in the dtype
        for name, kernel, pointers, consts in (
            ("gate_up", fused_moe._gate_up_kernel, dict(hidden_ptr=p if packed else w, w13_ptr=w, act_ptr=p),
             dict(TOP_K=top_k, SWIGLU=gpt_oss, GATED=gated, GELU_TANH=gelu)),
            ("down", fused_moe._down_kernel, dict(act_ptr=p if packed else w, w2_ptr=w, out_ptr=p,
                                                  topk_weights_ptr="*fp32"), {}),
        ):
            consts = {**consts, **blocks}
            floats = tuple(n for n in ("alpha", "limit") if n in kernel.arg_names)
            # scale rows of K / group entries (MXFP4's 90 or 45 a row, int4's 6 for I 768, per-row fp8 / int8: 1), the
            # per-token scales' stride 1: not multiples of 16 as launched
            odd = ("w_s_stride_n", "a_s_stride") if mxfp4 or bits or fp8_group == 2048 else ()
            divisible = tuple(n for n in kernel.arg_names
                              if n not in consts and n not in ("num_pairs", *floats, *odd))
            yield (f"fused_moe {name} BLOCK_M={cfg.block_m} gpt_oss={gpt_oss} gated={gated} fp8={fp8_group} "
                   f"gelu={gelu} int{bits}{' mxfp4' if mxfp4 else ''}{' int8' if int8 else ''}"
                   f"{' g_idx' if g_idx else ''}", kernel,
                   {**aligned, **(fp8 if is_fp8 else ints if bits else mxfp4_scales if mxfp4 else {}), **pointers},
                   floats, consts, cfg.num_warps, dict(divisible=divisible, stages=cfg.num_stages))
    # int8 experts' per-token activation quantizer: Qwen3-30B-A3B's H 2048 (one block), Mixtral's I 14336 (4 blocks)
    for k in (2048, 14336):
        consts = int8_quant.quant_config(k)  # as launched
        warps = consts.pop("num_warps")
        yield (f"int8_quant BLOCK={consts['BLOCK']}", int8_quant._quantize_int8_kernel,
               dict(x_ptr=p, q_ptr="*i8", s_ptr="*fp32"), (), consts, warps,
               dict(divisible=("x_ptr", "q_ptr", "x_stride", "q_stride", "K")))


def block_fp8_cases(p: str):
    """Pre-quantized fp8 checkpoints (128x128 weight blocks): the activation quantizer (and its static-scale variant),
    and the GEMM on fp8 tensor cores at a decode and a prefill tile, as `block_fp8.matmul_config` launches them on a
    GPU."""
    fp8 = "*fp8e4nv"
    quant = dict(x_ptr=p, q_ptr=fp8, s_ptr="*fp32", static_ptr="*fp32")
    yield ("block_fp8 group_quant", block_fp8._group_quant_kernel, quant, (),
           dict(GROUP=128, BLOCK=128, FP8_MAX=448.0, MIN_SCALE=1.0 / (448.0 * 512.0), STATIC=False), 4)
    # static activation scales (per-tensor fp8 experts' inputs), as `block_fp8.static_quant_fp8` launches it
    yield ("block_fp8 static_quant", block_fp8._group_quant_kernel, quant, (),
           dict(GROUP=block_fp8.STATIC_BLOCK, BLOCK=block_fp8.STATIC_BLOCK, FP8_MAX=448.0,
                MIN_SCALE=1.0 / (448.0 * 512.0), STATIC=True), 4,
           dict(divisible=("x_ptr", "q_ptr", "x_stride", "q_stride", "K")))
    for rows in (1, 4096):
        cfg = block_fp8.matmul_config(rows, 4096, on_gpu=True)
        consts = dict(GROUP_N=128, GROUP_K=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=128,
                      UPCAST=False)
        pointers = dict(a_ptr=fp8, a_s_ptr="*fp32", b_ptr=fp8, b_s_ptr="*fp32", out_ptr=p)
        divisible = ("a_ptr", "b_ptr", "out_ptr", "a_stride", "b_stride", "out_stride", "K", "N")
        yield (f"block_fp8 matmul BLOCK_M={cfg['BLOCK_M']}", block_fp8._block_fp8_matmul_kernel, pointers, (), consts,
               cfg["num_warps"], dict(divisible=divisible, stages=cfg["num_stages"]))


def w4a16_cases(p: str):
    """Pre-quantized AWQ / GPTQ checkpoints (groups of 128): the int4 GEMM at a decode and a prefill tile, as
    `w4a16.matmul_config` launches it on a GPU, with groups in order and with GPTQ's act-order g_idx, and GPTQ's
    8-bit values."""
    pointers = dict(a_ptr=p, qw_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16", g_ptr="*i32", out_ptr=p)
    divisible = ("a_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "a_stride", "qw_stride", "s_stride", "out_stride",
                 "K", "N")
    for rows, bits, act_order in ((1, 4, False), (4096, 4, False), (4096, 4, True), (16, 8, False)):
        cfg = w4a16.matmul_config(rows, 4096, 128, act_order, on_gpu=True)
        consts = dict(BITS=bits, GROUP=128, HAS_G_IDX=act_order, TILE_IN_GROUP=not act_order,
                      BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], UPCAST=False)
        yield (f"w4a16 matmul bits={bits} act_order={act_order} BLOCK_M={cfg['BLOCK_M']}", w4a16._w4a16_matmul_kernel,
               pointers, (), consts, cfg["num_warps"], dict(divisible=divisible, stages=cfg["num_stages"]))


def main(archs: list[int]) -> int:
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for dtype in ("bf16",):
            for name, kernel, pointers, floats, consts, warps, *extra in cases(dtype):
                start = time.perf_counter()
                try:
                    options = extra[0] if extra else {}
                    compiled = _compile(kernel, pointers, floats, consts, target, warps, **options)
                except Exception as exc:  # noqa: BLE001 - report which kernel failed, then fail
                    print(f"FAIL sm_{arch} {dtype} {name}: {type(exc).__name__}: {exc}")
                    return 1
                shared = compiled.metadata.shared
                print(f"ok sm_{arch} {dtype} {name}: {time.perf_counter() - start:.1f}s, {shared} B shared memory")
    return 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
