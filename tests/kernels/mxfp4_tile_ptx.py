"""Print the PTX of `fused_moe_tiles.mxfp4_tile` (test_fused_moe_mxfp4.py's tile kernel: float32 tiles, BLOCK_K 64,
the GPU's step) for a CUDA target, no GPU needed. Run as a script (``python mxfp4_tile_ptx.py SM``) by
test_kernels_compile.py, without TRITON_INTERPRET."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from test_fused_moe_mxfp4 import _tile_kernel  # noqa: E402


def main(arch: int) -> int:
    signature = {"w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*fp32", "N": "i32", "K": "i32", "BLOCK_N": "constexpr",
                 "BLOCK_K": "constexpr"}
    src = ASTSource(fn=_tile_kernel, signature=signature, constexprs={"BLOCK_N": 32, "BLOCK_K": 64})
    print(triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4}).asm["ptx"])
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
