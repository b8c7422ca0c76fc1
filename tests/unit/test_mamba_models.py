"""Attention-free Mamba models (asyncllm/models/mamba.py) against transformers' forward: Mamba's selective scan,
Falcon Mamba's weightless inner norms, Mamba2's SSD mixer; three requests of 12 to 27 tokens as chunked prefills
mixed with decodes over each request's state rows; every position's float32 logits within 1e-4."""

from __future__ import annotations

import pytest
import torch
from mamba_utils import KINDS, make_tiny_mamba
from model_utils import assert_paged_logits_match_checkpoint
from pipeline_utils import MemoryChannel, Stages, paged_logits, stage_params

from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.mamba import FalconMambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM
from asyncllm.models.pipeline import PipelineStage, StageModel
from asyncllm.models.registry import kv_cache_spec

CLASSES = {"mamba": MambaForCausalLM, "falcon_mamba": FalconMambaForCausalLM, "mamba2": Mamba2ForCausalLM}


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind: str, tmp_path) -> None:
    path = make_tiny_mamba(tmp_path, kind)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    assert type(model) is CLASSES[kind]
    spec = kv_cache_spec(hf_config, 2)  # no attention: one token-sized layer for the block accounting, any TP
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (1, 1, 16)
    assert_paged_logits_match_checkpoint(model, path, [12, 20, 27], [[5, 9, 0], [4, 9, 16], [1, 1, 9], [1, 1, 1],
                                                                     [1, 0, 1]], seed=2)


def test_falcon_mambas_inner_norms_matter(tmp_path) -> None:
    """Falcon Mamba's checkpoint read as plain Mamba (its dt, B, C not normed) no longer matches."""
    path = make_tiny_mamba(tmp_path, "falcon_mamba")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    for layer in model.model.layers:
        layer.mixer.dt_layernorm = layer.mixer.b_layernorm = layer.mixer.c_layernorm = lambda x: x
    with pytest.raises(AssertionError):
        assert_paged_logits_match_checkpoint(model, path, [12, 20], [[5, 9], [4, 11], [3, 0]], seed=2)


class _Stages(Stages):
    """Each stage takes the model's one token-sized cache layer (none reads it)."""

    def __call__(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        for stage in self.stages:
            assert stage.num_kv_layers == len(kv_caches) == 1
            hidden = stage(input_ids, positions, kv_caches, metadata)
        return hidden


@pytest.mark.parametrize(("kind", "dtype"), [("mamba", torch.float32), ("falcon_mamba", torch.float32),
                                             ("mamba2", torch.float32), ("mamba2", torch.bfloat16)])
def test_pipeline_stages_equal_the_unsplit_model(kind: str, dtype: torch.dtype, tmp_path) -> None:
    """Two stages of one layer each hold their parts (Mamba's and Falcon Mamba's embeddings on both: their LM head
    is tied to them) and their layers' states; their logits over the paged, chunked schedule are bit-equal to the unsplit model's, in
    bfloat16 too (the float32 stream crosses as its bytes: twice as wide)."""
    path = make_tiny_mamba(tmp_path, kind)
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2, max_num_seqs=8)
    full = load_model(config, hf_config, torch.device("cpu"), dtype)
    full_names = {name for name, _ in full.named_parameters()}
    channel, stages = MemoryChannel(), []
    for rank in range(2):
        stage = PipelineStage(rank, 2, rank, rank + 1)
        model = load_model(config, hf_config, torch.device("cpu"), dtype, pipeline=stage)
        assert {name for name, _ in model.named_parameters()} == stage_params(full_names, stage, full.tie_word_embeddings)
        stage_model = StageModel(model, stage, channel)
        assert stage_model.keeps_request_states and stage_model.kv_spec(kv_cache_spec(hf_config, 1)).num_layers == 1
        stages.append(stage_model)
    for got, want in zip(paged_logits(_Stages(stages), path), paged_logits(full, path), strict=True):
        assert torch.equal(got, want)
    assert not channel.queue
