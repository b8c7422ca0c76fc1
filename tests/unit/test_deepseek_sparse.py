"""DeepSeek-V3.2 and GLM-5 (asyncllm/models/deepseek_sparse.py) against transformers: float32 logits within 1e-4
at every position over a paged cache, with the tiny models' ``index_topk`` of 6 far below the prompts (chunked
prefills crossing it, decodes beside them, a first step dense); the sparse choice mattering (every key instead, the
worst keys instead, GLM-5's indexer rope half-split); the caches' shapes; what is refused; a sparse step reading
only the chosen latent rows."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models import deepseek_sparse
from asyncllm.models.deepseek_sparse import (
    DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM, chosen_slots, sparse_latent_attention,
)
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [40, 23, 9]
SCHEDULE = [[4, 3, 5], [13, 6, 0], [15, 9, 4], [5, 5, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]]
"""The first step's contexts fit in 6 keys (the backend's dense step); the next ones cross it, by chunks and by
decodes beside them."""


def _model(arch: str) -> torch.nn.Module:
    path = tiny_checkpoint(arch)
    return load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("arch", "cls"), [("deepseek_v32", DeepseekV32ForCausalLM),
                                           ("glm_moe_dsa", GlmMoeDsaForCausalLM)])
def test_logits_match_transformers(arch: str, cls: type) -> None:
    """GLM-5 (glm_moe_dsa): its second layer reuses the first's choice (``indexer_types`` "shared")."""
    model = _model(arch)
    assert type(model) is cls and model.model.layers[0].self_attn.indexer.topk == 6
    assert (model.model.layers[1].self_attn.indexer is None) == (arch == "glm_moe_dsa")
    assert_paged_logits_match_checkpoint(model, tiny_checkpoint(arch), SEQ_LENS, SCHEDULE, seed=len(arch))


@pytest.mark.parametrize("change", ["every key", "worst keys", "indexer rope"])
def test_the_sparse_choice_matters(change: str, monkeypatch) -> None:
    """Attending to every causal key (an ``index_topk`` past the prompts), to the lowest-scored keys, or rotating
    GLM-5's indexer pairs half-split breaks the match (so the test above checks the choice)."""
    arch = "glm_moe_dsa" if change == "indexer rope" else "deepseek_v32"
    model = _model(arch)
    indexers = [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]
    for indexer in indexers:
        if change == "every key":
            indexer.topk = 10**6
        elif change == "indexer rope":
            indexer.interleaved = False
    if change == "worst keys":  # the per-head weights negated: the lowest scores lead
        choose = deepseek_sparse.LightningIndexer._choose
        monkeypatch.setattr(deepseek_sparse.LightningIndexer, "_choose",
                            lambda self, query, weights, *rest: choose(self, query, -weights, *rest))
    with pytest.raises(AssertionError):
        assert_paged_logits_match_checkpoint(model, tiny_checkpoint(arch), SEQ_LENS, SCHEDULE, seed=len(arch))


def test_each_layer_caches_its_latent_and_its_indexer_keys() -> None:
    """DeepSeek-V3.2's shapes: per layer a 576-wide latent row and a 128-wide indexer key a token, one head each
    on any number of ranks, one-part; GLM-5's "shared" layers keep no indexer cache."""
    import transformers

    v32 = transformers.DeepseekV32Config(architectures=["DeepseekV32ForCausalLM"])
    for tp in (1, 8):
        spec = kv_cache_spec(v32, tp)
        assert (spec.kv_parts, spec.num_layers) == (1, 122)
        assert spec.shapes()[:4] == [(1, 576), (1, 128), (1, 576), (1, 128)]
    assert spec.bytes_per_block(16, torch.bfloat16) == 61 * 16 * (576 + 128) * 2
    glm = kv_cache_spec(load_hf_config(tiny_checkpoint("glm_moe_dsa")), 1)
    assert glm.shapes() == [(1, 8 + 32), (1, 16), (1, 8 + 32)]


def test_refused_settings(tmp_path: Path) -> None:
    """A first layer without its own indexer; an fp8 cache's calibrated scales, at load (not on a long request's
    first sparse step: the sparse path reads the latent rows unscaled)."""
    path = tiny_checkpoint("glm_moe_dsa")
    hf_config = load_hf_config(path)
    hf_config.indexer_types = ["shared", "full"]
    with pytest.raises(ConfigError, match="indexer_types"):
        load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    path = tiny_checkpoint("deepseek_v32")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(path) / name).read_bytes())
    save_file({**load_file(tmp_path / "model.safetensors"), "model.layers.1.self_attn.k_scale": torch.tensor(0.5)},
              tmp_path / "model.safetensors")
    config = EngineConfig.create(str(tmp_path), kv_cache_dtype="fp8")
    with pytest.raises(NotBuiltError, match="calibrated KV-cache scales") as info:
        load_model(config, load_hf_config(str(tmp_path)), torch.device("cpu"), torch.float32)
    assert info.value.field == "kv_cache_dtype"


def test_an_adapter_of_the_indexer_is_refused_by_name(tmp_path):
    """The indexer's projections take no adapters: an adapter naming ``wq_b`` is refused, naming the tensor."""
    from lora_utils import make_adapter

    from asyncllm import LoRARequest
    from asyncllm.errors import InvalidRequestError
    from asyncllm.lora_checker import AdapterChecker
    from asyncllm.models.checkpoint import load_hf_config
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint("deepseek_v32")
    adapter = make_adapter(path, str(tmp_path / "adapter"), seed=1, rank=4, alpha=8, targets=["wq_b", "q_a_proj"])
    with pytest.raises(InvalidRequestError, match=r"indexer\.wq_b"):
        AdapterChecker(load_hf_config(path), 16).check(LoRARequest("a", 1, adapter))


class _LargestNewTensor(TorchDispatchMode):
    """The most elements any op's new output (not a view or an in-place result) holds while it is active."""

    most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(ret.alias_info for ret in func._schema.returns):
            self.most = max([self.most, *(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))])
        return out


def _sparse_step(seq_lens: list[int], query_lens: list[int], topk: int, dtype: torch.dtype, seed: int) -> tuple:
    """A random latent cache (5-token blocks, 7 wide) holding each request's context in shuffled blocks among spare
    ones, 3-head queries, and each query's ``topk`` random causal positions (-1 once); None where the context fits."""
    g, size = torch.Generator().manual_seed(seed), 5
    owned = [-(-n // size) for n in seq_lens]
    blocks = torch.randperm(sum(owned) + 3, generator=g).int()
    tables = torch.zeros(len(seq_lens), max(owned) + 1, dtype=torch.int32)
    for request, (start, count) in enumerate(zip([0, *itertools.accumulate(owned)], owned)):
        tables[request, :count] = blocks[start:start + count]
    cache = torch.randn(1, len(blocks), size, 1, 7, generator=g).to(dtype)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, query_lens)])
    starts = [0, *itertools.accumulate(query_lens)]
    selection = [None if n <= topk else torch.stack([torch.randperm(int(p) + 1, generator=g)[:topk] for p in
                                                     positions[a:b]]) for n, a, b in zip(seq_lens, starts, starts[1:])]
    next(ids for ids in selection if ids is not None)[0, -1] = -1
    metadata = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), query_start_loc=torch.tensor(starts),
                                 seq_lens=torch.tensor(seq_lens), block_tables=tables, query_start_loc_cpu=starts,
                                 seq_lens_cpu=seq_lens, block_size=size)
    return torch.randn(len(positions), 3, 7, generator=g), cache, metadata, selection, positions


def _attend_whole_contexts(query, cache, metadata, selection, positions) -> torch.Tensor:
    """The straightforward reference: each request's whole context gathered, then each query's chosen rows."""
    out, starts = [], metadata.query_start_loc_cpu
    for request, (a, b) in enumerate(zip(starts, starts[1:])):
        rows = reference.gather_kv(cache, metadata.block_tables[request], metadata.seq_lens_cpu[request])[0][:, 0]
        for t in range(a, b):
            ids = torch.arange(int(positions[t]) + 1) if selection[request] is None else selection[request][t - a]
            keys = rows[ids[ids >= 0]].float()
            out.append((query[t] @ keys.T * 0.3).softmax(dim=-1) @ keys)
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "fp8"])
def test_a_sparse_step_reads_only_the_chosen_latent_rows(dtype: torch.dtype) -> None:
    """Over an odd paged cache (a request under ``index_topk`` beside two past it): equal to attention over each
    request's whole gathered context (float32: within 1e-5), reading ``[queries, topk]`` rows: no tensor it makes
    grows with the contexts (200 tokens longer), and its largest is one chunk of chosen rows (or their scores)."""
    for topk in (4, 8):
        largest = []
        for extra in (0, 200):
            step = _sparse_step([23 + extra, 3, 17 + extra], [2, 2, 3], topk, dtype, seed=topk)
            with _LargestNewTensor() as seen:
                out = sparse_latent_attention(*step[:4], 0.3, step[4])
            torch.testing.assert_close(out, _attend_whole_contexts(*step), rtol=1e-5, atol=1e-5)
            assert chosen_slots(*step[2:]).shape == (7, topk)
            largest.append(seen.most)
        assert largest[0] == largest[1] == 7 * topk * 7
