"""Zamba2 (asyncllm/models/zamba2.py): Mamba2 layers and shared transformer blocks on the stream concatenated with the
embeddings, with per-invocation adapters. The tiny model has three invocations of two shared blocks (block 0 twice,
with its own adapters each time) between Mamba2 layers: float32 logits equal transformers' within 1e-4 over a paged
run (a 72-token request in 40- and 30-token chunks beside decodes), one KV-cache layer per invocation; without the
adapters, or with zeros in place of the embeddings, they differ.

The tiny Zamba2 amplifies rounding (each Mamba layer reads the shared block's output, about 4x the stream, and its
error grows 3-5x a layer): transformers' own float32 logits differ from its float64 ones by up to ~5e-3 over 72
tokens. So the reference is transformers in float64, and ours must be within 3x transformers' float32 error of it
(and 1e-4 where that error is smaller)."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_reference import hf_logits, model_logits
from model_utils import PagedRun

from asyncllm.config import EngineConfig
from asyncllm.models import zamba2
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 72, 11]
SCHEDULE = [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]


def _model(path: str) -> torch.nn.Module:
    return load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)


@functools.lru_cache(maxsize=None)
def _hf_float64(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def assert_logits_match(model: torch.nn.Module, path: str, seq_lens: list[int], schedule: list[list[int]],
                        seed: int) -> None:
    """Over a paged run by ``schedule``: every position's logits within ``max(1e-4, 3 x transformers' float32
    error)`` of transformers' float64 logits."""
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in seq_lens]
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(path), 1), torch.float32)
    for tokens, logits in zip(sequences, run.run(schedule), strict=True):
        exact = model_logits(_hf_float64(path), tokens)
        assert exact.std() > 0.5
        bound = max(1e-4, 3 * (hf_logits(path, tokens) - exact).abs().max().item())
        error = (logits - exact).abs().max().item()
        assert error <= bound, f"{len(tokens)} tokens: {error:.1e} from float64, allowed {bound:.1e}"


@pytest.mark.parametrize("fields", [{}, {"use_mem_rope": False, "use_shared_attention_adapter": False,
                                         "num_mem_blocks": 1}], ids=["two-blocks", "one-block-no-rope"])
def test_logits_match_transformers(fields: dict) -> None:
    """Two blocks with attention adapters and the rotary; one block (three invocations) with MLP adapters alone and
    no positions."""
    path = tiny_checkpoint("zamba2", **fields)
    spec = kv_cache_spec(load_hf_config(path), 1)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (3, 2, 64)  # an invocation each, 2 x 64 / 2 wide
    model = _model(path)
    assert [layer.invocation for layer in model.model.layers] == [None, 0, None, 1, 2]
    adapters = model.model.shared_blocks[0].feed_forward.gate_up_proj_adapter_list
    assert sorted(adapters) == (["0", "1", "2"] if fields else ["0", "2"])
    assert_logits_match(model, path, SEQ_LENS, SCHEDULE, seed=3)


def _without_adapters(model: torch.nn.Module) -> None:
    for block in model.model.shared_blocks:
        block.self_attn.adapters = False
        for adapter in block.feed_forward.gate_up_proj_adapter_list.values():
            adapter[1].weight.data.zero_()


@pytest.mark.parametrize("disable", ["adapters", "embeddings"])
def test_the_adapters_and_the_embeddings_matter(disable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run fails with the adapters left out, or zeros concatenated in place of the embeddings."""
    path = tiny_checkpoint("zamba2")
    model = _model(path)
    if disable == "adapters":
        _without_adapters(model)
    else:
        forward = zamba2.Zamba2SharedBlock.forward
        monkeypatch.setattr(zamba2.Zamba2SharedBlock, "forward", lambda self, positions, hidden, embeds, *rest:
                            forward(self, positions, hidden, torch.zeros_like(embeds), *rest))
    with pytest.raises(AssertionError):
        assert_logits_match(model, path, SEQ_LENS, SCHEDULE, seed=3)
