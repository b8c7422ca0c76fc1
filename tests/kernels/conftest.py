"""Kernel tests run the Triton kernels in Triton's interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it
is set here, before any test module of this folder imports `asyncllm.kernels`.
With a GPU the same tests compile the kernels for it (and the ``gpu``-marked
variants at real shapes run too).
"""

from __future__ import annotations

import os

import interpreter_calls
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

interpreter_calls.install()
