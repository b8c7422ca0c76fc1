"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention, asyncllm/models/deepseek_sparse.py) in pipeline stages, in
one process, (hidden, residual) passed in memory: each stage holds exactly its layers, its KV-cache spec is its
layers' latent and indexer caches (the bytes of the stages' blocks add up to the unsplit model's), the stages'
logits over a paged, chunked schedule past ``index_topk`` are bit-equal to the unsplit model's, and their greedy
choices are transformers' tokens; a split that starts a stage on GLM-5's "shared" layer is refused on the host and
on the worker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hf_reference import hf_greedy
from model_utils import PagedRun
from pipeline_utils import MemoryChannel, Stages, paged_logits, stage_params

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.deepseek_sparse_config import check_indexer_split
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.pipeline import PipelineStage, StageModel
from asyncllm.models.registry import kv_cache_spec
from asyncllm.pipeline_parallel import check_pipeline_model, get_pp_indices
from asyncllm.tiny import tiny_checkpoint

CPU = torch.device("cpu")
_F, _S = "full", "shared"
CHECKPOINTS = {
    "deepseek_v32": {},  # 2 layers, each with its indexer: split 1 + 1
    # 4 layers, the second reusing the first's choice: split 2 + 2, the caches [latent, indexer, latent | latent,
    # indexer, latent, indexer]
    "glm_moe_dsa": dict(num_layers=4, indexer_types=[_F, _S, _F, _F], mlp_layer_types=["dense"] + ["sparse"] * 3),
}


def _path(arch: str) -> str:
    return tiny_checkpoint(arch, **CHECKPOINTS[arch])


def _config(path: str) -> EngineConfig:
    return EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2)


@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
def test_stages_hold_their_layers_and_caches_and_equal_the_unsplit_model(arch: str) -> None:
    path = _path(arch)
    hf_config = load_hf_config(path)
    config, layers = _config(path), hf_config.num_hidden_layers
    check_pipeline_model(config, hf_config.architectures[0], hf_config)
    full = load_model(config, hf_config, CPU, torch.float32)
    names = {name for name, _ in full.named_parameters()}
    full_spec = kv_cache_spec(hf_config, 1)
    channel, stages = MemoryChannel(), []
    for rank in range(2):
        stage = PipelineStage(rank, 2, *get_pp_indices(layers, rank, 2))
        model = StageModel(load_model(config, hf_config, CPU, torch.float32, pipeline=stage), stage, channel)
        assert {name for name, _ in model.named_parameters()} == {f"causal_lm.{name}" for name in
                                                                     stage_params(names, stage, False)}
        stages.append(model)
    specs = [stage.kv_spec(full_spec) for stage in stages]
    assert [spec.shapes() for spec in specs] == _expected_shapes(hf_config, [s.stage for s in stages])
    assert [spec.num_layers for spec in specs] == [stage.num_kv_layers for stage in stages]
    assert sum(spec.bytes_per_block(16, torch.float32) for spec in specs) == \
        full_spec.bytes_per_block(16, torch.float32)
    for got, want in zip(paged_logits(Stages(stages), path), paged_logits(full, path), strict=True):
        assert torch.equal(got, want)
    assert not channel.queue
    _assert_greedy_choices_are_transformers(Stages(stages), path)


def _expected_shapes(hf_config: object, stages: list[PipelineStage]) -> list[list[tuple[int, int]]]:
    """Per stage: each of its layers' latent cache, then its indexer's where the layer has an indexer."""
    latent = (1, hf_config.qk_rope_head_dim + hf_config.kv_lora_rank)
    types = getattr(hf_config, "indexer_types", None) or [_F] * hf_config.num_hidden_layers
    return [[shape for i in range(s.start_layer, s.end_layer)
             for shape in ([latent, (1, hf_config.index_head_dim)] if types[i] == _F else [latent])]
            for s in stages]


def _assert_greedy_choices_are_transformers(stages: Stages, path: str) -> None:
    """transformers' greedy continuations, fed back as prompt chunks of 8 then one token a step: the stages' argmax
    at each position is the token transformers chose there (so their greedy run makes the same tokens)."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in (13, 21)]
    continuations = [hf_greedy(path, prompt, 8, eos_token_id=None) for prompt in prompts]  # past an EOS too
    assert list(map(len, continuations)) == [8, 8]
    run = PagedRun(stages, [p + c for p, c in zip(prompts, continuations)])
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(path), 1), torch.float32)
    prefill = [[max(0, min(8, len(p) - 8 * step)) for p in prompts] for step in range(3)]
    logits = run.run(prefill + [[1, 1]] * 8)
    for prompt, tokens, got in zip(prompts, continuations, logits, strict=True):
        assert got[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens


def test_a_stage_starting_on_a_shared_layer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-5's "shared" layer 1 reuses layer 0's choice: a stage starting there is refused on the host (naming the
    partition) and on the worker; the hint moves the boundary back to a layer with its own indexer."""
    path = _path("glm_moe_dsa")
    hf_config = load_hf_config(path)
    monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", "1,3")
    with pytest.raises(ConfigError, match="layer 1 reuses the choice") as info:
        check_pipeline_model(_config(path), hf_config.architectures[0], hf_config)
    assert (info.value.field, info.value.value) == ("ASYNCLLM_PP_LAYER_PARTITION", "1,3")
    with pytest.raises(ConfigError, match="layer 1 reuses the choice"):
        load_model(_config(path), hf_config, CPU, torch.float32, pipeline=PipelineStage(1, 2, 1, 4))
    shared_third = SimpleNamespace(indexer_types=[_F, _F, _S, _F])
    with pytest.raises(ConfigError, match="e.g. ASYNCLLM_PP_LAYER_PARTITION=1,3$"):
        check_indexer_split(shared_third, [2, 2])
    check_indexer_split(shared_third, [1, 3])
    check_indexer_split(SimpleNamespace(), [2, 2])  # DeepSeek-V3.2: no "shared" layers
