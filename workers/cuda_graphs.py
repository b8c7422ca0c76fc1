"""CUDA graphs of the model forward for decode batches (one token per request).

A decode step of a small model is mostly kernel-launch time: hundreds of
small launches per token. `CudaGraphRunner` captures the forward (token ids
-> final hidden states) once per *capture size* (1, 2, 4, then multiples of 8
up to ``min(max_num_seqs, MAX_CAPTURE_SIZE)``, the largest first, all sharing
one memory pool) and replays it. A step qualifies when every scheduled
request runs exactly one token, the model takes no input embeddings, and the
batch fits the largest size; it runs the graph of the smallest size that
holds it, padded. Batches of up to `GREEDY_CAPTURE_MAX` requests whose tokens are
the argmax also have a graph with the LM head and the argmax in it; otherwise
logits and sampling stay eager, as does every other step.

Inputs (`DecodeBuffers`): a graph reads the step where the input batch's one
host-to-device copy put it, at fixed addresses: once graphs are captured,
`InputBatch.prepare_inputs` lays a decode batch out at the smallest capture
size that holds it (workers/step_staging.py), its real requests in the first
rows and `pad_decode`'s padding after them: each padding row a request with an
empty query (``query_start_loc`` repeats the last real offset) and
``seq_len`` 0, its token at slot -1, which the KV write skips. The
paged-attention kernel returns at once for an empty query, so padding reads
and writes no KV. Padding tokens' hidden states are left as garbage and
dropped. No device-to-device copy runs before a replay.

Graphs need the triton backend (torch_sdpa loops over the requests on the
host), a CUDA device, one rank (capturing the tensor-parallel all-reduce and
the pipeline stages' send/recv is not built yet) and a text-only model;
`graphs_off_reason` says which is missing. ``enforce_eager=True`` turns them off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from asyncllm import envs
from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import Attention
from asyncllm.workers.input_types import StepInputs
from asyncllm.workers.step_staging import StepStaging

if TYPE_CHECKING:
    from asyncllm.config import EngineConfig
    from asyncllm.workers.model_runner import ModelRunner

__all__ = [
    "GREEDY_CAPTURE_MAX", "MAX_CAPTURE_SIZE", "CudaGraphRunner", "DecodeBuffers", "capture_decode_graphs",
    "capture_sizes", "captured_host_values", "decode_graphs", "graphs_off_reason", "model_graphs_off_reason",
    "recapture_if_changed",
]

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
"""The largest decode batch with a graph; larger batches run eagerly (launch time matters less there)."""
_SIZE_STEP = 8

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids, positions, metadata) -> hidden states: the model over its KV cache."""
Head = Callable[[torch.Tensor], torch.Tensor]
"""hidden states -> float32 logits: the model's `compute_logits`."""
GREEDY_CAPTURE_MAX = 16
"""Decode batches up to this size also have a graph with the LM head and greedy argmax in it (launching the head,
the cast and the argmax took a fifth of a batch-1 step's host time on an H200; the graph's logits, ``size x vocab``
float32, stay in the graph pool, so larger sizes, where launches weigh less, leave them eager)."""


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Ascending batch sizes to capture: 1, 2, 4, the multiples of 8 below the limit, and the limit
    ``min(max_num_seqs, cap)`` itself, so that every batch up to the limit has a size."""
    limit = min(max_num_seqs, cap)
    sizes = {s for s in (1, 2, 4) if s < limit} | set(range(_SIZE_STEP, limit, _SIZE_STEP)) | {limit}
    return sorted(sizes)


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
    """The fixed-address inputs of the captured forwards: the input batch's decode layout of each capture size
    (workers/step_staging.py: input ids, positions, KV slots, query starts, sequence lengths, each at the same
    address every step) and its block-table buffer. A decode batch's `InputBatch.prepare_inputs` writes them,
    padded to the size (`pad_decode`), so a replay reads the step where its one host-to-device copy put it."""

    def __init__(self, staging: StepStaging, block_tables: torch.Tensor, block_size: int) -> None:
        self.staging = staging
        self.block_tables = block_tables
        self.block_size = block_size

    @property
    def max_size(self) -> int:
        return min(self.staging.max_reqs, self.staging.max_tokens, int(self.block_tables.shape[0]))

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, metadata) of the decode layout of ``size`` one-token requests; the metadata's host
        lists are the capture's (a replayed graph keeps them; the triton backend reads only the tensors)."""
        assert 0 < size <= self.max_size, (size, self.max_size)
        device = self.staging.layout(size, size).device
        metadata = AttentionMetadata(
            slot_mapping=device["slot_mapping"],
            query_start_loc=device["query_start_loc"],
            seq_lens=device["seq_lens"],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
            block_size=self.block_size,
        )
        return device["input_ids"], device["positions"], metadata

    def load_warmup(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`inputs` holding the layout a graph is captured with (written on the device): ``size`` one-token
        requests of context 1, writing no KV, each reading the first block of its row of the block-table buffer (a
        valid block id whatever the row holds: the buffer is zeros or gathered rows; it is left as it is, so the
        input batch's last gather stays valid)."""
        ids, positions, metadata = self.inputs(size)
        ids.zero_()
        positions.zero_()
        metadata.slot_mapping.fill_(-1)
        metadata.query_start_loc.copy_(torch.arange(size + 1, dtype=torch.int32))
        metadata.seq_lens.fill_(1)
        return ids, positions, metadata


class CudaGraphRunner:
    """One captured decode forward per capture size, replayed for qualifying steps; with a ``head`` (the model's
    `compute_logits`), sizes up to `GREEDY_CAPTURE_MAX` also get a graph of the forward, the LM head and the greedy
    argmax, for steps whose tokens are the argmax (`SamplingMetadata.argmax_only`)."""

    def __init__(self, forward: Forward, buffers: DecodeBuffers, sizes: list[int], head: Head | None = None) -> None:
        assert sizes == sorted(sizes) and sizes[-1] <= buffers.max_size, (sizes, buffers.max_size)
        self.forward_eager = forward
        self.head = head
        self.buffers = buffers
        self.sizes = sizes
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """size -> (graph, its static hidden-state output ``[size, hidden]``)."""
        self.greedy_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        """size -> (graph with the LM head and argmax, its hidden states, its token ids ``[size]``)."""
        self.num_replays = 0
        self.num_greedy_replays = 0

    def capture(self, num_warmups: int = 2) -> None:
        """Capture every size, the largest first (its activations set the shared pool's size)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            ids, positions, metadata = self.buffers.load_warmup(size)
            greedy = self.head is not None and size <= GREEDY_CAPTURE_MAX
            for _ in range(num_warmups):  # compiles the Triton kernels for this shape, outside the capture
                self._greedy(ids, positions, metadata) if greedy else self.forward_eager(ids, positions, metadata)
            torch.cuda.synchronize()
            self.graphs[size] = self.capture_one(pool, partial(self.forward_eager, ids, positions, metadata))
            if greedy:
                graph, (hidden, tokens) = self.capture_one(pool, partial(self._greedy, ids, positions, metadata))
                self.greedy_graphs[size] = (graph, hidden, tokens)
        torch.cuda.synchronize()

    @staticmethod
    def capture_one(pool: Any, run: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """(the graph of ``run()``, its outputs): the one place a graph is captured (tests stand in a recording)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = run()
        return graph, out

    def _greedy(self, ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.forward_eager(ids, positions, metadata)
        return hidden, self.head(hidden).argmax(dim=-1)  # type: ignore[misc]

    def can_run(self, inputs: StepInputs) -> bool:
        """A decode batch laid out padded to a captured size (`StepInputs.graph_size`)."""
        return inputs.graph_size in self.graphs

    def forward(self, inputs: StepInputs, positions: torch.Tensor | None = None,
                greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's hidden states ``[num_reqs, hidden]`` and, with ``greedy`` where its size has the graph, its
        greedy token ids ``[num_reqs]`` (else None): views of the graph's outputs, read them before the next replay.
        ``positions``: rotary positions other than the step's own (one row per token), copied in first."""
        assert self.can_run(inputs), (inputs.graph_size, sorted(self.graphs))
        if positions is not None and positions is not inputs.positions:
            inputs.positions.copy_(positions)
        num_reqs, size = len(inputs.req_ids), inputs.graph_size
        self.num_replays += 1
        if greedy and size in self.greedy_graphs:
            graph, hidden, tokens = self.greedy_graphs[size]
            graph.replay()
            self.num_greedy_replays += 1
            return hidden[:num_reqs], tokens[:num_reqs]
        graph, hidden = self.graphs[size]  # type: ignore[index]
        graph.replay()
        return hidden[:num_reqs], None


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


def decode_graphs(runner: ModelRunner) -> CudaGraphRunner:
    """The runner's `CudaGraphRunner` (not captured yet): its model over its KV cache, reading the input batch's
    decode layouts, the model's LM head for the greedy graphs (unless ``ASYNCLLM_GREEDY_GRAPHS=0``); the input batch
    lays decode batches out padded to its capture sizes from now on."""
    model, kv_caches, batch = runner.model, runner.kv_caches, runner.input_batch
    buffers = DecodeBuffers(batch.staging, batch.block_tables, runner.block_size)
    sizes = capture_sizes(runner.max_num_seqs, min(MAX_CAPTURE_SIZE, buffers.max_size))

    def forward(ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> Any:
        return model(ids, positions, kv_caches, metadata)

    batch.graph_sizes = sizes
    return CudaGraphRunner(forward, buffers, sizes, model.compute_logits if envs.GREEDY_GRAPHS.get() else None)


def capture_decode_graphs(runner: ModelRunner) -> CudaGraphRunner | None:
    """Capture the runner's decode graphs over its current KV cache, or None when it stays eager."""
    model = runner.model
    reason = (graphs_off_reason(runner.config, runner.device, attention_backend_name(model), runner.tp_size)
              or model_graphs_off_reason(model, runner.drafter))
    if reason is not None:
        if runner.device.type == "cuda":
            logger.info("CUDA graphs off: %s", reason)
        return None
    free_before = torch.cuda.mem_get_info(runner.device)[0]
    start = time.perf_counter()
    graphs = decode_graphs(runner)
    sizes = graphs.sizes
    with torch.inference_mode():
        graphs.capture()
    torch.cuda.empty_cache()  # the warm-ups' blocks: what stays taken is the graphs' pool
    graph_bytes = free_before - torch.cuda.mem_get_info(runner.device)[0]
    logger.info("captured %d CUDA graphs (decode batches of 1 to %d requests; %d more with the LM head and greedy "
                "argmax) in %.1f s, %.0f MiB of GPU memory", len(sizes), sizes[-1], len(graphs.greedy_graphs),
                time.perf_counter() - start, graph_bytes / 2**20)
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
