"""Eager decode batches run once at start, when no CUDA graph is captured, so Triton compiles their kernels then.

A Triton kernel compiles on its first launch with a new set of constexprs (0.1 to 1 s a kernel on an H200), and
an eager decode batch picks some from its size: the split-KV decode kernels' ``NUM_SEGMENTS`` (a power of two from
the batch, 16 down to 1), the fused decode products (`decode_linear`) at 1 and 2 rows, the MoE, fp8 and int4
products' row blocks. The memory profile runs one large prefill step; with graphs on, their capture runs every
decode size a step can be padded to. With graphs off (``enforce_eager``, ``tensor_parallel_size > 1``) nothing but
the profile ran before serving, so the first small decode batches would compile in the middle of a served step.
`warm_up_decodes` runs the capture's warm-up layout (one-token requests of context 1, writing no KV) eagerly at
`warmup_sizes`, which meet every value those constexprs take (docs/kernels.md, "Compiles at start").
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from asyncllm import envs
from asyncllm.workers.cuda_graphs import DecodeBuffers, attention_backend_name, model_graphs_off_reason

if TYPE_CHECKING:
    from asyncllm.workers.model_runner import ModelRunner

__all__ = ["warm_up_decodes", "warmup_sizes"]

logger = logging.getLogger(__name__)


def warmup_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below ``max_num_seqs``, and ``max_num_seqs``. A choice made from the batch size as a power of
    two of ``ceil(c / size)`` (capped), or of the size itself (clamped), takes at most two values between one power
    of two and the next, the ones at the two ends: these sizes meet every value up to ``max_num_seqs``."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max(1, max_num_seqs)]


def warms_up(runner: ModelRunner) -> bool:
    """Whether `warm_up_decodes` runs: a CUDA device (not Triton's interpreter), the triton backend, no captured
    graphs, one pipeline stage, and a model whose forward takes the capture's decode layout."""
    return (runner.device.type == "cuda" and not envs.TRITON_INTERPRET.get()
            and runner.cuda_graphs is None and runner.config.pipeline_parallel_size == 1
            and attention_backend_name(runner.model) == "triton"
            and model_graphs_off_reason(runner.model, runner.drafter) is None)


def warm_up_decodes(runner: ModelRunner) -> None:
    """Run the eager decode batches of `warmup_sizes` over the runner's KV cache (reading block 0, writing none),
    when `warms_up` says so; every tensor-parallel rank runs the same batches."""
    if not warms_up(runner):
        return
    sizes = warmup_sizes(runner.max_num_seqs)
    batch = runner.input_batch  # its step buffers: the addresses and alignment the served steps have
    buffers = DecodeBuffers(batch.staging, batch.block_tables, runner.block_size)
    start = time.perf_counter()
    with torch.inference_mode():
        for size in sizes:
            ids, positions, metadata = buffers.load_warmup(size)
            runner.model(ids, positions, runner.kv_caches, metadata)
    torch.cuda.synchronize(runner.device)
    logger.info("warmed up eager decode batches of %s requests in %.1f s", sizes, time.perf_counter() - start)
