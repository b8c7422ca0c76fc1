"""Print the PTX of `asyncllm.kernels._fp8.to_storage` (float32 values stored as fp8) for a CUDA target, no GPU needed,
and of `int8_quant`'s quantizer, which rounds by the same float32 add and subtract.

Run as a script (``python fp8_store_ptx.py SM``) by test_kernels_compile.py, without TRITON_INTERPRET: one
kernel per fp8 type (float8_e4m3fn, then float8_e5m2), the PTX of each after a line ``// fp8 TYPE``, then the
int8 quantizer's (float32 rows of 64 columns) after ``// int8_quant``.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from asyncllm.kernels import int8_quant  # noqa: E402
from asyncllm.kernels._fp8 import to_storage  # noqa: E402


@triton.jit
def _store_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, to_storage(tl.load(x_ptr + offsets), out_ptr.dtype.element_ty))


def main(arch: int) -> int:
    for fp8 in ("fp8e4nv", "fp8e5"):
        src = ASTSource(fn=_store_kernel, signature={"x_ptr": "*fp32", "out_ptr": f"*{fp8}", "BLOCK": "constexpr"},
                        constexprs={"BLOCK": 256})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        print(f"// fp8 {fp8}\n{compiled.asm['ptx']}")
    print(f"// int8_quant\n{_int8_quant_ptx(arch)}")
    return 0


def _int8_quant_ptx(arch: int) -> str:
    consts = int8_quant.quant_config(64)
    num_warps = consts.pop("num_warps")
    signature = {"x_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32", "x_stride": "i32", "q_stride": "i32", "K": "i32"}
    src = ASTSource(fn=int8_quant._quantize_int8_kernel, signature={**signature, **dict.fromkeys(consts, "constexpr")},
                    constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm["ptx"]


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
