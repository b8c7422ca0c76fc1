"""Tensor parallelism: each rank's shard (no processes needed), then 2 gloo ranks end to end."""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedRun, free_port, save_tiny_checkpoint, spawn_ranks, tp_worker

from asyncllm.config import EngineConfig
from asyncllm.models.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncllm.models.layers import TensorParallel
from asyncllm.models.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint


def _rows(n: int, width: int) -> torch.Tensor:
    """Row r is filled with r: which checkpoint rows landed where is then readable."""
    return torch.arange(n, dtype=torch.float32)[:, None].expand(n, width).contiguous()


def _row_ids(param: torch.Tensor) -> list[int]:
    return param[:, 0].to(torch.int64).tolist()


@pytest.mark.parametrize(
    ("tp_size", "rank", "total_kv", "q_rows", "kv_rows"),
    [
        (2, 1, 2, list(range(4, 8)), [2, 3]),  # 4 q heads / 2 kv heads (head_dim 2) split in two
        (4, 3, 2, [6, 7], [2, 3]),  # fewer kv heads than ranks: ranks 2 and 3 share kv head 1
        (4, 1, 2, [2, 3], [0, 1]),
        (4, 2, 4, [4, 5], [4, 5]),
    ],
)
def test_qkv_shard(tp_size, rank, total_kv, q_rows, kv_rows):
    layer = QKVParallelLinear(3, 2, 4, total_kv, True, TensorParallel(rank, tp_size), torch.float32)
    for shard_id, rows in (("q", 8), ("k", 2 * total_kv), ("v", 2 * total_kv)):
        layer.weight.weight_loader(layer.weight, _rows(rows, 3) + (100 if shard_id == "v" else 0), shard_id)
        layer.bias.weight_loader(layer.bias, torch.arange(rows, dtype=torch.float32), shard_id)
    assert _row_ids(layer.weight) == q_rows + kv_rows + [100 + r for r in kv_rows]
    assert layer.bias.tolist() == q_rows + kv_rows + kv_rows
    assert (layer.num_heads, layer.num_kv_heads) == (4 // tp_size, max(1, total_kv // tp_size))


def test_merged_column_shard():
    layer = MergedColumnParallelLinear(3, [6, 6], False, TensorParallel(1, 2), torch.float32)
    layer.weight.weight_loader(layer.weight, _rows(6, 3), 0)
    layer.weight.weight_loader(layer.weight, _rows(6, 3) + 10, 1)
    assert _row_ids(layer.weight) == [3, 4, 5, 13, 14, 15]


def test_row_parallel_shard_keeps_the_whole_bias():
    layer = RowParallelLinear(6, 2, True, TensorParallel(1, 3), torch.float32)
    layer.weight.weight_loader(layer.weight, torch.arange(12, dtype=torch.float32).view(2, 6))
    layer.bias.weight_loader(layer.bias, torch.tensor([7.0, 8.0]))
    assert layer.weight.tolist() == [[2.0, 3.0], [8.0, 9.0]]
    assert layer.bias.tolist() == [7.0, 8.0]


def test_vocab_parallel_padding_rows_are_zero():
    embed = VocabParallelEmbedding(101, 2, TensorParallel(1, 2), torch.float32)
    embed.weight.fill_(-1.0)
    embed.weight.weight_loader(embed.weight, _rows(101, 2))
    assert _row_ids(embed.weight) == list(range(51, 101)) + [0]
    head = ParallelLMHead(101, 2, TensorParallel(1, 2), torch.float32, tied_to=embed)
    assert head.weight is embed.weight and head.vocab_start == 51


SEQUENCES = [[3, 99, 14, 15, 92, 65, 35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71]]
SCHEDULE = [[5, 9], [1, 5], [1, 0], [1, 0]]
TP_CASES = {  # family -> overrides: replicated KV heads with biases, a tied vocab split, q/k norm
    "llama_bias": {"num_key_value_heads": 1},
    "qwen2": {},
    "qwen3": {},
}
TINY_TP_ARCHS = ("gemma2", "phi3", "gpt_oss")
"""asyncllm.tiny checkpoints too: Gemma 2 (scaled tied embeddings, capped scores, an 8-token window), Phi-3 (the
checkpoint's stacked qkv_proj / gate_up_proj cut into each rank's shards, partial rotary, LongRoPE), gpt-oss (each
rank's heads' sinks; its slice of every expert's interleaved gate/up, their biases, the down bias added once)."""


@pytest.mark.slow
def test_tp2_logits_equal_tp1(tmp_path):
    paths = []
    for family, overrides in TP_CASES.items():
        path = tmp_path / family
        save_tiny_checkpoint(path, family, **overrides)
        paths.append(str(path))
    paths += [tiny_checkpoint(arch) for arch in TINY_TP_ARCHS]
    args = (2, free_port(), paths, str(tmp_path), SEQUENCES, SCHEDULE)
    spawn_ranks(tp_worker, args)
    for index, path in enumerate(paths):
        hf_config = load_hf_config(path)
        model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
        spec = kv_cache_spec(hf_config, 1)
        run = PagedRun(model, [list(s) for s in SEQUENCES])
        run.new_kv_caches_for(spec, torch.float32)
        expected = run.run(SCHEDULE)
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}_{index}.pt")
            for logits, ref in zip(got, expected):
                assert logits.shape == ref.shape == (ref.shape[0], hf_config.vocab_size)
                # float32 sums in a different order (all_reduce of partial matmuls): ~1e-6 relative
                torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
