"""Print the sm_90 PTX of the fused decode product (QKV: the norm prologue) and of the split-KV segment kernel, each
with ``PDL`` on and off, between ``// <name> PDL=<on>`` lines; no GPU needed. Run as a script (``python pdl_ptx.py
SM``) by test_kernels_compile.py, without TRITON_INTERPRET."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

from triton.backends.compiler import GPUTarget  # noqa: E402

from compile_for_gpu import _compile  # noqa: E402

from asyncllm.kernels import decode_linear, paged_decode  # noqa: E402


def main(arch: int) -> int:
    p = "*bf16"
    target = GPUTarget("cuda", arch, 32)
    for pdl in (True, False):
        kernel = _compile(decode_linear._decode_linear_kernel,
                          dict(x_ptr=p, residual_ptr=p, norm_w_ptr=p, weight_ptr=p, bias_ptr=p, out_ptr=p,
                               residual_out_ptr=p), ("eps",),
                          dict(PROLOGUE=1, HAS_BIAS=False, BLOCK_N=8, BLOCK_K=1024, PDL=pdl), target, 4)
        print(f"// decode_linear PDL={pdl}\n{kernel.asm['ptx']}")
        kernel = _compile(paged_decode._decode_segment_kernel,
                          dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", q_ptr=p, k_cache_ptr=p,
                               v_cache_ptr=p, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                               query_start_loc_ptr="*i32", alibi_ptr="*fp32"), ("scale", "softcap"),
                          dict(QUERIES_PER_KV=2, BLOCK_M=16, USE_WINDOW=False, USE_SOFTCAP=False, USE_CHUNK=False,
                               USE_ALIBI=False, DOT_PRECISION="tf32", TILE_N=64, HEAD_DIM=128, NUM_SEGMENTS=16,
                               PDL=pdl), target, 4)
        print(f"// paged_decode PDL={pdl}\n{kernel.asm['ptx']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
