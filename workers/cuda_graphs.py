"""CUDA graphs of the model forward for decode batches (one token per request).

A decode step of a small model is mostly kernel-launch time: hundreds of
small launches per token. `CudaGraphRunner` captures the forward (token ids
-> final hidden states) once per *capture size* (1, 2, 4, then multiples of 8
up to ``min(max_num_seqs, MAX_CAPTURE_SIZE)``, the largest first, all sharing
one memory pool) and replays it. A step qualifies when every scheduled
request runs exactly one token, the model takes no input embeddings, and the
batch fits the largest size; it runs the graph of the smallest size that
holds it, padded. Logits, sampling and every other step stay eager.

Padding (`DecodeBuffers.load`): the real requests fill the first rows of the
fixed-address buffers; each padding row is a request with an empty query
(``query_start_loc`` repeats the last real offset) and ``seq_len`` 0, and each
padding token has slot -1, which the KV write skips. The paged-attention
kernel returns at once for an empty query, so padding reads and writes no KV.
Padding tokens' hidden states are left as garbage and dropped.

Graphs need the triton backend (torch_sdpa loops over the requests on the
host), a CUDA device, one rank (capturing the tensor-parallel all-reduce and
the pipeline stages' send/recv is not built yet) and a text-only model;
`graphs_off_reason` says which is missing. ``enforce_eager=True`` turns them off.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import Attention
from asyncllm.workers.input_types import StepInputs

if TYPE_CHECKING:
    from asyncllm.config import EngineConfig
    from asyncllm.workers.model_runner import ModelRunner

__all__ = [
    "MAX_CAPTURE_SIZE", "CudaGraphRunner", "DecodeBuffers", "capture_decode_graphs", "capture_sizes",
    "captured_host_values", "graphs_off_reason", "model_graphs_off_reason", "padded_size", "recapture_if_changed",
]

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
"""The largest decode batch with a graph; larger batches run eagerly (launch time matters less there)."""
_SIZE_STEP = 8

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids, positions, metadata) -> hidden states: the model over its KV cache."""


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Ascending batch sizes to capture: 1, 2, 4, the multiples of 8 below the limit, and the limit
    ``min(max_num_seqs, cap)`` itself, so that every batch up to the limit has a size."""
    limit = min(max_num_seqs, cap)
    sizes = {s for s in (1, 2, 4) if s < limit} | set(range(_SIZE_STEP, limit, _SIZE_STEP)) | {limit}
    return sorted(sizes)


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``num_reqs`` requests; None past the largest."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def graphs_off_reason(config: EngineConfig, device: torch.device, backend_name: str | None, tp_size: int) -> str | None:
    """Why this runner must stay eager, or None when decode graphs can be captured."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if config.enforce_eager:
        return "enforce_eager=True"
    if config.pipeline_parallel_size > 1:
        return "pipeline_parallel_size > 1 (stages run eagerly: capturing their send/recv is not built)"
    if backend_name != "triton":
        return f"the {backend_name} attention backend reads host-side metadata (graphs need 'triton')"
    if tp_size > 1:
        return "tensor_parallel_size > 1 (capturing the all-reduce is not built yet)"
    return None


def attention_backend_name(model: torch.nn.Module) -> str | None:
    """The backend the model's attention layers run (None for a model without `Attention` layers)."""
    for module in model.modules():
        if isinstance(module, Attention):
            return module.backend.name
    return None


class DecodeBuffers:
    """Fixed-address inputs of the captured forwards, sized for the largest capture size.

    A graph of size S reads the first S rows; `load` writes a step into them, padded to S.
    """

    def __init__(self, max_size: int, max_blocks_per_req: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_size, max_blocks_per_req), dtype=torch.int32, device=device)

    @property
    def max_size(self) -> int:
        return int(self.seq_lens.shape[0])

    def load(self, inputs: StepInputs, size: int) -> AttentionMetadata:
        """Copy a decode step (one token per request) into the first ``size`` rows, padded (`write`). Returns
        the padded metadata, whose host lists describe the padded batch exactly."""
        self.write(inputs, size)
        meta = inputs.attn_metadata
        n = meta.num_reqs
        pad = size - n
        return self._metadata(size, meta.query_start_loc_cpu + [n] * pad, meta.seq_lens_cpu + [0] * pad)

    def write(self, inputs: StepInputs, size: int) -> None:
        """Copy a decode step into the first ``size`` rows, padded: device-to-device copies and fills only (no host
        sync). A replay reads these buffers only, so the step's metadata is not built (`load` builds it)."""
        meta = inputs.attn_metadata
        n = meta.num_reqs
        assert inputs.num_tokens == n <= size <= self.max_size, (inputs.num_tokens, n, size)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.query_start_loc[: n + 1].copy_(meta.query_start_loc)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if n < size:  # padding: empty queries with no context, tokens that write no KV
            self.slot_mapping[n:size].fill_(-1)
            self.query_start_loc[n + 1 : size + 1].fill_(n)
            self.seq_lens[n:size].fill_(0)

    def load_warmup(self, size: int) -> AttentionMetadata:
        """The layout a graph is captured with: ``size`` one-token requests of context 1, writing no KV."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slot_mapping[:size].fill_(-1)
        self.query_start_loc[: size + 1].copy_(torch.arange(size + 1, dtype=torch.int32))
        self.seq_lens[:size].fill_(1)
        self.block_tables[:size].zero_()
        return self._metadata(size, list(range(size + 1)), [1] * size)

    def _metadata(self, size: int, query_start_loc_cpu: list[int], seq_lens_cpu: list[int]) -> AttentionMetadata:
        # A replayed graph keeps the host lists of its capture; the triton backend reads only the tensors.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
            block_size=self.block_size,
        )


class CudaGraphRunner:
    """One captured decode forward per capture size, replayed for qualifying steps."""

    def __init__(self, forward: Forward, buffers: DecodeBuffers, sizes: list[int]) -> None:
        assert sizes == sorted(sizes) and sizes[-1] <= buffers.max_size, (sizes, buffers.max_size)
        self.forward_eager = forward
        self.buffers = buffers
        self.sizes = sizes
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """size -> (graph, its static hidden-state output ``[size, hidden]``)."""
        self.num_replays = 0

    def capture(self, num_warmups: int = 2) -> None:
        """Capture every size, the largest first (its activations set the shared pool's size)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            metadata = self.buffers.load_warmup(size)
            ids, positions = self.buffers.input_ids[:size], self.buffers.positions[:size]
            for _ in range(num_warmups):  # compiles the Triton kernels for this shape, outside the capture
                self.forward_eager(ids, positions, metadata)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                hidden = self.forward_eager(ids, positions, metadata)
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()

    def can_run(self, inputs: StepInputs) -> bool:
        """Every request runs one token, and a captured size holds them all."""
        num_reqs = len(inputs.req_ids)
        return inputs.num_tokens == num_reqs and num_reqs <= self.sizes[-1]

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The step's hidden states ``[num_reqs, hidden]`` (a view of the graph's output: read it
        before the next replay)."""
        num_reqs = len(inputs.req_ids)
        size = padded_size(num_reqs, self.sizes)
        assert size is not None and self.can_run(inputs), (num_reqs, inputs.num_tokens)
        self.buffers.write(inputs, size)
        graph, hidden = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return hidden[:num_reqs]


def model_graphs_off_reason(model: Any, drafter: Any) -> str | None:
    """Why this model (and drafter) cannot run captured decodes, or None."""
    if getattr(model, "cuda_graphs_off", None):  # Whisper's cross-attention states
        return model.cuda_graphs_off
    if getattr(model, "keeps_request_states", False):
        return "the model keeps per-request linear-attention states (capturing them is not built)"
    if getattr(drafter, "reads_layers", False):
        return "an EAGLE-3 head reads the decoder's layer inputs of every step (capturing them is not built)"
    if _reference_experts(model):
        return ("the experts run the reference's per-expert loop, which syncs with the host (pre-quantized fp8 "
                "experts on a GPU without fp8 compute, int8 ones before Ampere: asyncllm/models/fp8_experts.py)")
    return None


def _reference_experts(model: Any) -> bool:
    """Whether a mixture of experts computes through `reference.fused_moe` (on a GPU with the triton backend: fp8
    experts before Ada)."""
    from asyncllm.kernels import reference
    from asyncllm.models.moe import FusedMoE

    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return any(isinstance(m, FusedMoE) and m.fused_moe is reference.fused_moe for m in modules)


def capture_decode_graphs(runner: ModelRunner) -> CudaGraphRunner | None:
    """Capture the runner's decode graphs over its current KV cache, or None when it stays eager."""
    model = runner.model
    reason = (graphs_off_reason(runner.config, runner.device, attention_backend_name(model), runner.tp_size)
              or model_graphs_off_reason(model, runner.drafter))
    if reason is not None:
        if runner.device.type == "cuda":
            logger.info("CUDA graphs off: %s", reason)
        return None
    kv_caches = runner.kv_caches
    sizes = capture_sizes(runner.max_num_seqs)
    max_blocks = -(-runner.max_model_len // runner.block_size)
    buffers = DecodeBuffers(sizes[-1], max_blocks, runner.block_size, runner.device)

    def forward(ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> Any:
        return model(ids, positions, kv_caches, metadata)

    graphs = CudaGraphRunner(forward, buffers, sizes)
    free_before = torch.cuda.mem_get_info(runner.device)[0]
    start = time.perf_counter()
    with torch.inference_mode():
        graphs.capture()
    torch.cuda.empty_cache()  # the warm-ups' blocks: what stays taken is the graphs' pool
    graph_bytes = free_before - torch.cuda.mem_get_info(runner.device)[0]
    logger.info("captured %d CUDA graphs (decode batches of 1 to %d requests) in %.1f s, %.0f MiB of GPU memory",
                len(sizes), sizes[-1], time.perf_counter() - start, graph_bytes / 2**20)
    return graphs


def captured_host_values(model: Any) -> list[tuple[float, float]]:
    """The host values a captured decode forward bakes in, unlike the tensors it reads at their addresses: each
    `Attention`'s fp8 KV-cache scales (``k_scale``, ``v_scale``: Python floats that `Attention.forward` branches on
    and passes to the kernels as arguments; asyncllm/models/kv_scales.py)."""
    return [(m.k_scale, m.v_scale) for m in model.modules() if isinstance(m, Attention)]


def recapture_if_changed(runner: ModelRunner, before: list[tuple[float, float]]) -> bool:
    """Capture the runner's decode graphs again when its `captured_host_values` are no longer ``before`` (a weight
    update brought other KV-cache scales): replays would run the old ones. True when it did; nothing to do for a
    runner without graphs (eager, or asleep: the wake-up captures them)."""
    if getattr(runner, "cuda_graphs", None) is None or captured_host_values(runner.model) == before:
        return False
    logger.info("the fp8 KV-cache scales changed: capturing the decode graphs again")
    runner.cuda_graphs = None  # the old graphs' memory pool goes before the new capture takes one
    runner.cuda_graphs = capture_decode_graphs(runner)
    return True
