"""Every kernel compiles for a Hopper GPU (sm_90) through Triton's real pipeline, without a GPU.

The interpreter runs the kernels' arithmetic on the CPU but not the compiler's
checks (types of loop-carried values, dot shapes, shared-memory use), so a
subprocess without TRITON_INTERPRET lowers each one to a cubin (compile_for_gpu.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    proc = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 81 and all(line.startswith("ok sm_90") for line in lines), proc.stdout


def test_fp8_store_ptx_rounds_in_float32_and_sets_the_sign_by_bits() -> None:
    """`_fp8.to_storage` for sm_90: the rounding's float32 add and subtract are kept, the sign is or-ed in as a bit
    (Triton 3.6 compiles a float ``-x`` as ``0.0 - x``, which is +0.0 for 0.0: a negative value that rounds to zero,
    -0.0 among them, was stored as 0x00 where torch stores 0x80), and one conversion from float32, no float16 step.
    With it, one more small compile: `int8_quant`'s rounding by the same trick, and its IEEE divisions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("fp8_store_ptx.py")
    proc = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fp8_ptx, int8_ptx = proc.stdout.split("// int8_quant\n")
    for fp8, ptx in zip(("e4m3", "e5m2"), fp8_ptx.split("// fp8 ")[1:], strict=True):
        assert f"cvt.rn.satfinite.{fp8}x2.f32" in ptx and "cvt.rn.f16.f32" not in ptx, ptx
        assert re.search(r"\badd(\.rn)?\.f32", ptx) and re.search(r"\bsub(\.rn)?\.f32", ptx), ptx
        assert re.search(r"\band\.b32\s+%r\d+, %r\d+, -2147483648;", ptx), ptx
        assert "neg.f32" not in ptx and "0f00000000" not in ptx, ptx  # no float negation, as fneg or as 0.0 - x
    _assert_int8_quant_rounds_by_the_magic_constant(int8_ptx)


def _assert_int8_quant_rounds_by_the_magic_constant(ptx: str) -> None:
    """`int8_quant`'s ``(v + 1.5 * 2**23) - 1.5 * 2**23`` (0f4B400000) kept as two float32 additions, the second on the
    first's result (the subtraction as an addition of 0fCB400000, or a ``sub``), and its divisions IEEE
    (``div.rn.f32``: the scale and the quotient), none approximate."""
    rounded = re.search(r"\badd(?:\.rn)?\.f32\s+(%r\d+), %r\d+, 0f4B400000;", ptx)
    assert rounded, ptx
    back = rf"\b(add(\.rn)?\.f32\s+%r\d+, {rounded[1]}, 0fCB400000|sub(\.rn)?\.f32\s+%r\d+, {rounded[1]}, 0f4B400000);"
    assert re.search(back, ptx), ptx
    assert ptx.count("div.rn.f32") == 2 and not re.search(r"\bdiv\.(approx|full)\.f32|\brcp\.approx", ptx), ptx


def test_mxfp4_tile_ptx_sets_the_sign_by_bits() -> None:
    """`fused_moe_tiles.mxfp4_tile` for sm_90: a nibble's sign bit or-ed in as float32's (``and.b32`` with the sign
    mask), no float negation. Triton 3.6 compiled the former ``-value`` as ``0.0 - value``, contracted to
    ``fma.rn.f32 v, twice, -0.5, 0.0``: +0.0 for the nibble 0x8, whose -0.0 the H200 run of 2026-11-30 missed
    (`test_kernel_tiles_are_the_dequantized_weights`, all 4 cases); 3.9 emits ``neg.f32``, which keeps it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("mxfp4_tile_ptx.py")
    proc = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ptx = proc.stdout
    assert re.search(r"\band\.b32\s+%r\d+, %r\d+, -2147483648;", ptx), ptx
    assert "neg.f32" not in ptx and not re.search(r"\b(add|sub|fma)(\.rn)?\.f32\s.*0f00000000;", ptx), ptx


def test_pdl_kernels_wait_before_reading_what_earlier_kernels_wrote() -> None:
    """kernels/_pdl.py for sm_90: with ``PDL`` a kernel waits once (``griddepcontrol.wait``) then lets the next be
    scheduled, before any store; the split-KV segment kernel loads nothing before the wait (its padding rows return
    early, after it), the fused decode product only its first weight tile (loads issued, none stored); without
    ``PDL`` neither instruction is emitted."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("pdl_ptx.py")
    proc = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sections = dict(re.findall(r"// (\w+ PDL=\w+)\n(.*?)(?=\n// \w+ PDL=|\Z)", proc.stdout, re.S))
    assert len(sections) == 4, list(sections)
    for name in ("decode_linear", "paged_decode"):
        on, off = sections[f"{name} PDL=True"], sections[f"{name} PDL=False"]
        assert "griddepcontrol" not in off, name
        assert on.count("griddepcontrol.wait") == 1 and on.count("griddepcontrol.launch_dependents") == 1, name
        before = on[:on.index("griddepcontrol.wait")]
        assert on.index("griddepcontrol.wait") < on.index("griddepcontrol.launch_dependents"), name
        assert "st.global" not in before and "ret;" not in before, name
        loads = before.count("ld.global")
        assert loads > 0 if name == "decode_linear" else loads == 0, (name, loads)
