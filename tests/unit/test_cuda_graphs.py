"""The host-side logic of the decode CUDA graphs (workers/cuda_graphs.py), exactly, on the CPU:
capture sizes, the padded size of a batch, when graphs are off, and the padded inputs.

The padded forward itself (padding changes no real row and writes no KV) runs in
tests/kernels/test_cuda_graph_padding.py; capture and replay in the gpu-marked tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.config import EngineConfig
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.cuda_graphs import (
    CudaGraphRunner, DecodeBuffers, capture_sizes, graphs_off_reason, model_graphs_off_reason,
)
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.model_runner import ModelRunner
from asyncllm.workers.step_staging import padded_size
from model_utils import save_tiny_checkpoint

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only a name here: nothing is allocated on it
GREEDY = SamplingParams(temperature=0.0)


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(17) == [1, 2, 4, 8, 16, 17]
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(1000) == [1, 2, 4] + list(range(8, 513, 8))
    assert capture_sizes(100, cap=20) == [1, 2, 4, 8, 16, 20]


def test_padded_size() -> None:
    sizes = [1, 2, 4, 8, 16, 17]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 17]
    assert padded_size(18, sizes) is None


def test_graphs_off_reason(tmp_path: Path) -> None:
    config = EngineConfig.create(str(tmp_path))
    assert graphs_off_reason(config, CUDA, "triton", 1) is None
    assert "not CUDA" in graphs_off_reason(config, CPU, "triton", 1)
    eager = EngineConfig.create(str(tmp_path), enforce_eager=True)
    assert graphs_off_reason(eager, CUDA, "triton", 1) == "enforce_eager=True"
    assert "torch_sdpa" in graphs_off_reason(config, CUDA, "torch_sdpa", 1)
    assert "tensor_parallel_size" in graphs_off_reason(config, CUDA, "triton", 2)


def test_models_whose_decodes_stay_eager() -> None:
    from types import SimpleNamespace

    from asyncllm.models.llama import LlamaForCausalLM
    from asyncllm.models.qwen3_next import Qwen3NextForCausalLM
    from asyncllm.models.whisper import WhisperForConditionalGeneration

    assert "cross-attention" in model_graphs_off_reason(WhisperForConditionalGeneration, None)
    assert "linear-attention" in model_graphs_off_reason(Qwen3NextForCausalLM, None)
    assert "EAGLE-3" in model_graphs_off_reason(LlamaForCausalLM, SimpleNamespace(reads_layers=True))
    assert model_graphs_off_reason(LlamaForCausalLM, None) is None


def test_experts_on_the_reference_loop_stay_eager() -> None:
    """fp8 experts on a GPU without fp8 compute run `reference.fused_moe` (a host sync per step): no graphs."""
    from asyncllm.kernels import reference
    from asyncllm.models.moe import FusedMoE

    experts = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(experts)
    experts.fused_moe = reference.fused_moe
    model = torch.nn.Sequential(experts)
    assert "per-expert loop" in model_graphs_off_reason(model, None)
    experts.fused_moe = lambda *args, **kwargs: None  # the backend's kernel
    assert model_graphs_off_reason(model, None) is None


def test_a_cpu_runner_captures_nothing(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path, "llama")
    config = EngineConfig.create(str(tmp_path), max_model_len=64, block_size=4, max_num_seqs=4, device="cpu")
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    runner.init_cache(16)
    assert runner.cuda_graphs is None


def _decode_step(batch: InputBatch) -> SchedulerOutput:
    """Three requests prefilled (tokens sampled by hand), then one decode step of all three."""
    prefill = SchedulerOutput(0, [NewRequestData("a", [5, 6, 7], 3, GREEDY, [9], 0),
                                  NewRequestData("b", [8] * 5, 5, GREEDY, [2, 4], 0),
                                  NewRequestData("c", [3], 1, GREEDY, [7], 0)],
                              CachedRequestData(), {"a": 3, "b": 5, "c": 1}, 9)
    batch.update_states(prefill)
    batch.finish_step(batch.prepare_inputs(prefill), prefill, [11, 12, 13])
    decode = SchedulerOutput(1, [], CachedRequestData(["a", "b", "c"], [3, 5, 1], {}), {"a": 1, "b": 1, "c": 1}, 3)
    batch.update_states(decode)
    return decode


def _buffers(batch: InputBatch) -> DecodeBuffers:
    return DecodeBuffers(batch.staging, batch.block_tables, 4)


def test_a_decode_batch_is_laid_out_padded_where_its_graph_reads() -> None:
    batch = InputBatch(max_num_reqs=8, max_num_batched_tokens=16, max_model_len=16, block_size=4, device=CPU)
    decode = _decode_step(batch)
    _buffers(batch).load_warmup(8)  # whatever a capture left behind is overwritten or padded
    batch.graph_sizes = [1, 2, 4, 8]
    inputs = batch.prepare_inputs(decode)
    assert inputs.graph_size == 4
    ids, positions, meta = _buffers(batch).inputs(4)
    assert ids.tolist() == [11, 12, 13, 0] and positions.tolist() == [3, 5, 1, 0]
    assert meta.slot_mapping.tolist() == [39, 17, 29, -1]  # block 9 slot 3, block 4 slot 1, block 7 slot 1, pad
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 3]
    assert meta.seq_lens.tolist() == [4, 6, 2, 0]
    assert meta.block_tables[:3].tolist() == [[9, 0, 0, 0], [2, 4, 0, 0], [7, 0, 0, 0]]
    step = inputs.attn_metadata  # the step's own tensors: the real rows of the same memory
    for mine, graphs in ((inputs.input_ids, ids), (inputs.positions, positions), (step.slot_mapping, meta.slot_mapping),
                         (step.query_start_loc, meta.query_start_loc), (step.seq_lens, meta.seq_lens),
                         (step.block_tables, meta.block_tables)):
        assert mine.data_ptr() == graphs.data_ptr() and mine.shape[0] == graphs.shape[0] - 1
    assert (step.query_start_loc_cpu, step.seq_lens_cpu) == ([0, 1, 2, 3], [4, 6, 2])

    _buffers(batch).load_warmup(8)
    batch.graph_sizes = [2, 8]
    assert batch.prepare_inputs(decode).graph_size == 8
    meta = _buffers(batch).inputs(8)[2]
    assert meta.slot_mapping.tolist() == [39, 17, 29] + [-1] * 5
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert meta.seq_lens.tolist() == [4, 6, 2, 0, 0, 0, 0, 0]
    batch.graph_sizes = [1, 3]  # an exact size: no padding
    assert batch.prepare_inputs(decode).graph_size == 3
    assert _buffers(batch).inputs(3)[2].seq_lens.tolist() == [4, 6, 2]
    batch.graph_sizes = [1, 2]  # past the largest size: eager, unpadded
    inputs = batch.prepare_inputs(decode)
    assert inputs.graph_size is None and inputs.attn_metadata.seq_lens.tolist() == [4, 6, 2]


def test_a_prefill_step_has_no_graph() -> None:
    batch = InputBatch(max_num_reqs=4, max_num_batched_tokens=16, max_model_len=16, block_size=4, device=CPU)
    batch.graph_sizes = [1, 2, 4]
    step = SchedulerOutput(0, [NewRequestData("a", [5, 6, 7], 3, GREEDY, [1], 0)], CachedRequestData(), {"a": 3}, 3)
    batch.update_states(step)
    inputs = batch.prepare_inputs(step)
    assert inputs.graph_size is None and inputs.input_ids.tolist() == [5, 6, 7]
    graphs = CudaGraphRunner(lambda *args: None, _buffers(batch), [1, 2, 4])
    graphs.graphs = {size: None for size in (1, 2, 4)}  # as if captured
    assert not graphs.can_run(inputs)


def test_the_greedy_graphs_take_the_models_head_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from asyncllm.errors import ConfigError
    from asyncllm.workers.cuda_graphs import GREEDY_CAPTURE_MAX, decode_graphs

    batch = InputBatch(max_num_reqs=24, max_num_batched_tokens=64, max_model_len=16, block_size=4, device=CPU)
    model = SimpleNamespace(compute_logits=lambda hidden: hidden)
    runner = SimpleNamespace(model=model, kv_caches=[], input_batch=batch, block_size=4, max_num_seqs=24)
    graphs = decode_graphs(runner)
    assert graphs.head is model.compute_logits and GREEDY_CAPTURE_MAX == 16
    assert graphs.sizes == batch.graph_sizes == [1, 2, 4, 8, 16, 24]  # decode batches are padded from now on
    monkeypatch.setenv("ASYNCLLM_GREEDY_GRAPHS", "0")
    assert decode_graphs(runner).head is None
    monkeypatch.setenv("ASYNCLLM_GREEDY_GRAPHS", "sometimes")
    with pytest.raises(ConfigError, match="ASYNCLLM_GREEDY_GRAPHS"):
        decode_graphs(runner)
