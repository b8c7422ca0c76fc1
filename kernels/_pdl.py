"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (internal).

A decode step at batch 1 is some 200 small kernels back to back (a CUDA graph
replays them): each one's launch and ramp-up waits for the previous kernel to
end, a microsecond or two of idle device per kernel. On Hopper and later, a
kernel launched with PDL (``launch_pdl=True``) may be scheduled while the
kernel before it still runs; it then waits in `pdl_enter` (``griddepcontrol.wait``:
the previous kernel complete, its writes visible) before it reads anything a
kernel before it wrote, and lets the next kernel be scheduled in turn
(``griddepcontrol.launch_dependents``). Loads of data no kernel writes (weights)
may come before `pdl_enter`, so they overlap the previous kernel's end.

The rule that keeps the stream's order: a kernel launched with PDL calls
`pdl_enter` before any early return, so it never completes before the kernel
before it (and, by induction, every kernel before that) has. Kernels launched
without it (cuBLAS, torch's) wait for full completion as always.

On by default on NVIDIA GPUs of compute capability 9.0 and later (ASYNCLLM_PDL); never under
Triton's CPU interpreter or on ROCm, whose kernels get ``PDL=False`` and no launch flag.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from asyncllm import envs

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - an older Triton: PDL stays off
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["pdl_enter", "pdl_launch"]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel (complete, writes visible), then let the next one be scheduled: first in a PDL
    kernel, before any early return and any load of what an earlier kernel wrote."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a PDL kernel on ``device``: ``{"PDL": True, "launch_pdl": True}`` where PDL is on,
    else ``{"PDL": False}``."""
    if device.type == "cuda" and _enabled(device.index if device.index is not None else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _enabled(index: int) -> bool:
    if not _HAS_GDC or envs.TRITON_INTERPRET.get() or not envs.PDL.get() or torch.version.hip is not None:
        return False  # (ROCm's "cuda" devices report gfx9 as capability 9.x; griddepcontrol is NVIDIA's)
    return torch.cuda.get_device_capability(index)[0] >= 9
