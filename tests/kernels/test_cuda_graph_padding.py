"""Padded decode batches (workers/cuda_graphs.py) through a real model on the Triton kernels.

A decode step of 3 requests padded to 4 and 8 rows (empty queries, slot -1) must
give the real rows the hidden states of the unpadded step and write no KV slot
but the real tokens'. On the CPU the kernels run in Triton's interpreter, and a
recorded stand-in for a graph replays the forward on the tensors it was captured
with: the graphs read the input batch's step buffers where `prepare_inputs` put
the step. With a GPU, the gpu-marked test captures the graphs and checks that a
replay gives bit for bit what the same padded forward gives eagerly.

Tolerance: the real rows of a padded step agree with the unpadded step to 1e-5
(float32; a matrix product of 4 or 8 rows may sum in another order than one of 3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import recorded_graphs
import torch
from kernel_testing import DEVICE, HAS_CUDA, requires_gpu
from model_utils import save_tiny_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.cuda_graphs import CudaGraphRunner, DecodeBuffers, capture_sizes
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.input_types import StepInputs

BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 4, 24, 64
PROMPTS = {"a": [5, 17, 33, 2, 9], "b": [40, 41, 42, 43, 44, 45, 46, 47, 48], "c": [70, 71]}
BLOCKS = {"a": [11, 3], "b": [6, 20, 1], "c": [14]}
ATOL = 1e-5


def _model_and_cache(tmp_path: Path, backend: str):
    save_tiny_checkpoint(tmp_path, "qwen3", seed=3)  # per-head q/k norms, head_dim 32, GQA
    hf_config = load_hf_config(str(tmp_path))
    config = EngineConfig.create(str(tmp_path), attention_backend=backend, max_model_len=MAX_MODEL_LEN)
    model = load_model(config, hf_config, DEVICE, torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    return model, [torch.zeros(shape, device=DEVICE) for _ in range(spec.num_layers)]


@torch.inference_mode()
def _decode_batch(model, kv_caches: list[torch.Tensor]) -> tuple[InputBatch, SchedulerOutput]:
    """Prefill the three prompts (KV written), append a token to each: the batch and their decode step."""
    batch = InputBatch(max_num_reqs=8, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN,
                       block_size=BLOCK_SIZE, device=DEVICE)
    greedy = SamplingParams(temperature=0.0)
    new = [NewRequestData(r, p, len(p), greedy, BLOCKS[r], 0) for r, p in PROMPTS.items()]
    prefill = SchedulerOutput(0, new, CachedRequestData(), {r: len(p) for r, p in PROMPTS.items()}, 16)
    batch.update_states(prefill)
    inputs = batch.prepare_inputs(prefill)
    model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn_metadata)
    batch.finish_step(inputs, prefill, [50, 51, 52])
    computed = [len(p) for p in PROMPTS.values()]
    decode = SchedulerOutput(1, [], CachedRequestData(list(PROMPTS), computed, {}), {r: 1 for r in PROMPTS}, 3)
    batch.update_states(decode)
    return batch, decode


def _buffers(batch: InputBatch) -> DecodeBuffers:
    return DecodeBuffers(batch.staging, batch.block_tables, BLOCK_SIZE)


def _real_slots(inputs: StepInputs) -> torch.Tensor:
    mask = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    mask[inputs.attn_metadata.slot_mapping.long()] = True
    return mask


def _assert_same_kv_but_real_slots(actual: list[torch.Tensor], expected: list[torch.Tensor], real: torch.Tensor) -> None:
    for a, e in zip(actual, expected):
        a, e = a.flatten(1, 2), e.flatten(1, 2)  # [2, slots, heads, dim]
        assert torch.equal(a[:, ~real], e[:, ~real]), "a padding token wrote the KV cache"
        torch.testing.assert_close(a[:, real], e[:, real], atol=ATOL, rtol=0)


# the interpreter computes padding tokens' attention rows from uninitialised memory (never read back)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["triton", "torch_sdpa"])
@torch.inference_mode()
def test_padded_decode_equals_the_unpadded_step(tmp_path: Path, backend: str) -> None:
    model, kv_caches = _model_and_cache(tmp_path, backend)
    batch, decode = _decode_batch(model, kv_caches)
    inputs = batch.prepare_inputs(decode)  # no graph sizes: laid out unpadded
    assert inputs.graph_size is None
    before = [kv.clone() for kv in kv_caches]
    expected = model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn_metadata)
    real = _real_slots(inputs)
    for size in (4, 8):
        padded_kv = [kv.clone() for kv in before]
        _buffers(batch).load_warmup(8)  # stale rows from another layout must not matter
        batch.graph_sizes = [size]
        assert batch.prepare_inputs(decode).graph_size == size
        ids, positions, meta = _buffers(batch).inputs(size)
        if backend == "torch_sdpa":  # it reads the host lists, which a captured graph would keep from its capture
            meta.query_start_loc_cpu, meta.seq_lens_cpu = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        hidden = model(ids, positions, padded_kv, meta)
        torch.testing.assert_close(hidden[:3], expected, atol=ATOL, rtol=0)
        _assert_same_kv_but_real_slots(padded_kv, kv_caches, real)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@torch.inference_mode()
def test_a_replay_reads_the_step_where_prepare_inputs_put_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs read the input batch's own step buffers (no copy before a replay): graphs captured first, then a
    decode step of 3 requests prepared, padded to 4, replays to the eager unpadded step's hidden states and KV. On
    the CPU the graph is recorded (tests/kernels/recorded_graphs.py), which holds the runner to the graphs'
    contract."""
    if HAS_CUDA:
        pytest.skip("the CPU stand-in for a graph (the GPU test captures real ones)")
    model, kv_caches = _model_and_cache(tmp_path, "triton")
    batch, decode = _decode_batch(model, kv_caches)
    before = [kv.clone() for kv in kv_caches]
    eager_inputs = batch.prepare_inputs(decode)
    expected = model(eager_inputs.input_ids, eager_inputs.positions, kv_caches, eager_inputs.attn_metadata).clone()

    graph_kv = [kv.clone() for kv in before]

    def forward(ids, positions, meta):
        return model(ids, positions, graph_kv, meta)

    recorded_graphs.install(monkeypatch)
    graphs = CudaGraphRunner(forward, _buffers(batch), capture_sizes(8))
    graphs.capture(num_warmups=0)
    for kv, b in zip(graph_kv, before):
        kv.copy_(b)
    batch.graph_sizes = graphs.sizes
    batch.staging.device.fill_(5)  # stale values (slot 5 is request b's) where the padding row goes
    inputs = batch.prepare_inputs(decode)
    assert inputs.graph_size == 4 and graphs.can_run(inputs)
    replayed, greedy = graphs.forward(inputs)
    assert graphs.num_replays == 1 and replayed.shape[0] == 3 and greedy is None
    torch.testing.assert_close(replayed, expected, atol=ATOL, rtol=0)
    _assert_same_kv_but_real_slots(graph_kv, kv_caches, _real_slots(inputs))


@pytest.mark.gpu
@requires_gpu
@torch.inference_mode()
def test_graph_replay_equals_the_eager_padded_forward(tmp_path: Path) -> None:
    model, kv_caches = _model_and_cache(tmp_path, "triton")
    batch, decode = _decode_batch(model, kv_caches)
    before = [kv.clone() for kv in kv_caches]
    graph_kv = [kv.clone() for kv in before]  # the graphs bake in these addresses

    def forward(ids, positions, meta):
        return model(ids, positions, graph_kv, meta)

    sizes = capture_sizes(8)
    graphs = CudaGraphRunner(forward, _buffers(batch), sizes)
    graphs.capture()
    assert sorted(graphs.graphs) == sizes == [1, 2, 4, 8]
    for kv, b in zip(graph_kv, before):
        kv.copy_(b)  # capture's warm-up wrote nothing, but start from the prefilled state regardless
    batch.graph_sizes = sizes
    inputs = batch.prepare_inputs(decode)
    assert graphs.can_run(inputs) and inputs.graph_size == 4
    replayed = graphs.forward(inputs)[0].clone()
    assert graphs.num_replays == 1 and replayed.shape[0] == 3

    eager_kv = [kv.clone() for kv in before]
    ids, positions, meta = _buffers(batch).inputs(4)  # 3 requests replay the graph of size 4
    eager = model(ids, positions, eager_kv, meta)[:3]
    assert torch.equal(replayed, eager), (replayed - eager).abs().max()
    for g, e in zip(graph_kv, eager_kv):
        assert torch.equal(g, e)
