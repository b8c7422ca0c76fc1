"""Every kernel compiles for a Hopper GPU (sm_90) through Triton's real pipeline, without a GPU.

The interpreter runs the kernels' arithmetic on the CPU but not the compiler's
checks (types of loop-carried values, dot shapes, shared-memory use), so a
subprocess without TRITON_INTERPRET lowers each one to a cubin (compile_for_gpu.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    proc = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 74 and all(line.startswith("ok sm_90") for line in lines), proc.stdout
