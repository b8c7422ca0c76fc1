"""Pipeline stages of the decoders that run a stage themselves (``run_stage``: Gemma 4, Gemma 3n, Zamba2), in one
process, what crosses a boundary passed in memory: each stage holds exactly its parts (Gemma's per-layer tables
and AltUp projections in, on the first stage, AltUp's projections out on the last; Zamba2's shared blocks on each
stage that invokes them, with those invocations' adapters only), reads only its checkpoint tensors, and the
stages' logits are bit-equal to the unsplit model's over a paged, chunked schedule. KV sharing: a split that puts
a sharing layer apart from the layer whose cache it reads is a `ConfigError` on the host and on the worker.
Through the engine: tests/engine/test_pipeline_parallel_own_stages_engine.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from pipeline_utils import MemoryChannel, ReadSpy, Stages, paged_logits

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.loader import checkpoint_files, iterate_safetensors, load_hf_config, load_model
from asyncllm.models.pipeline import PipelineStage, StageModel
from asyncllm.models.registry import kv_cache_spec
from asyncllm.pipeline_parallel import check_pipeline_model, get_pp_indices
from asyncllm.tiny import tiny_checkpoint

CPU = torch.device("cpu")
_TYPES = ["sliding_attention", "full_attention"]
CHECKPOINTS = {
    # 6 layers, the last two sharing layers 2's and 3's caches
    "gemma4": dict(num_hidden_layers=6, layer_types=_TYPES * 3),
    "gemma4_moe": {},  # no per-layer inputs, no sharing: nothing crosses beside the stream
    "gemma3n": dict(num_kv_shared_layers=1),  # 4 layers, the last sharing layer 1's cache
    "zamba2": {},  # Mamba2, hybrid (block 0), Mamba2, hybrid (block 1), hybrid (block 0 again)
}
CASES = [("gemma4", "2,4"), ("gemma4", "1,1,4"), ("gemma4_moe", "1,1"), ("gemma3n", "1,3"),
         ("zamba2", "3,2"), ("zamba2", "2,2,1")]

_FIRST = ("model.embed_tokens_per_layer.", "model.per_layer_model_projection.", "model.per_layer_projection_norm.",
          "model.altup_projections.")
_LAST = ("model.norm.", "model.altup_unembed_projections.", "lm_head.")


def _path(arch: str) -> str:
    return tiny_checkpoint(arch, **CHECKPOINTS[arch])


def _stages(arch: str, partition: str) -> list[PipelineStage]:
    pp = partition.count(",") + 1
    layers = load_hf_config(_path(arch)).num_hidden_layers
    return [PipelineStage(rank, pp, *get_pp_indices(layers, rank, pp, partition)) for rank in range(pp)]


def _config(arch: str, pp: int) -> EngineConfig:
    return EngineConfig.create(_path(arch), max_model_len=128, pipeline_parallel_size=pp, max_num_seqs=8)


def _expected(full: set[str], stage: PipelineStage, invocations: set[int]) -> set[str]:
    """The unsplit model's parameters ``stage`` should hold (Zamba2's: by its invocations)."""
    def held(name: str) -> bool:
        if (layer := re.match(r"model\.layers\.(\d+)\.", name)) is not None:
            return stage.owns_layer(int(layer.group(1)))
        if name.startswith("model.embed_tokens."):  # the LM head is tied to it
            return stage.is_first or stage.is_last
        if name.startswith(_FIRST):
            return stage.is_first
        if name.startswith(_LAST):
            return stage.is_last
        block = re.match(r"model\.shared_blocks\.(\d+)\.", name)
        assert block is not None, name
        adapter = re.search(r"_adapter_list\.(\d+)\.", name)
        if adapter is not None:
            return int(adapter.group(1)) in invocations
        return any(i % 2 == int(block.group(1)) for i in invocations)

    return {name for name in full if held(name)}


@pytest.mark.parametrize(("arch", "partition"), CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_stages_hold_their_parts_and_equal_the_unsplit_model(arch: str, partition: str) -> None:
    path, stages = _path(arch), _stages(arch, partition)
    hf_config = load_hf_config(path)
    config = _config(arch, len(stages))
    full = load_model(config, hf_config, CPU, torch.float32)
    full_names = {name for name, _ in full.named_parameters()}
    hybrid_ids = [i for i, kind in enumerate(getattr(hf_config, "layers_block_type", [])) if kind == "hybrid"]
    channel, models = MemoryChannel(), []
    for stage in stages:
        model = load_model(config, hf_config, CPU, torch.float32, pipeline=stage)
        invocations = {i for i, layer in enumerate(hybrid_ids) if stage.owns_layer(layer)}
        assert {name for name, _ in model.named_parameters()} == _expected(full_names, stage, invocations)
        models.append(StageModel(model, stage, channel))
    assert sum(m.num_kv_layers for m in models) == len(kv_cache_spec(hf_config, 1).shapes())
    for got, want in zip(paged_logits(Stages(models), path), paged_logits(full, path), strict=True):
        assert torch.equal(got, want)
    assert not channel.queue


def test_gemma4_stages_cut_the_kv_cache_shapes_and_carry_the_later_layers_inputs() -> None:
    """Sliding (2 heads x 16) and global (1 x 32) caches: each stage's spec is its own caches' shapes, in order;
    a boundary carries the stream and the per-layer inputs of the layers after it (8 wide each)."""
    path, stages = _path("gemma4"), _stages("gemma4", "1,1,4")
    hf_config = load_hf_config(path)
    spec = kv_cache_spec(hf_config, 1)
    shapes = spec.shapes()
    assert len(set(shapes)) == 2 and len(shapes) == 4  # layers 4 and 5 have none of their own
    models = [StageModel(load_model(_config("gemma4", 3), hf_config, CPU, torch.float32, pipeline=stage), stage,
                         MemoryChannel()) for stage in stages]
    assert [m.kv_spec(spec).shapes() for m in models] == [shapes[:1], shapes[1:2], shapes[2:]]
    decoder = models[1].causal_lm.model
    assert [decoder.stage_widths(stage) for stage in stages[1:]] == [(64, 5 * 8), (64, 4 * 8)]


@pytest.mark.parametrize(("arch", "stage", "layers"), [("gemma4_moe", 1, {"1"}), ("gemma4", 1, {"2", "3", "4", "5"}),
                                                       ("zamba2", 1, {"3", "4"})])
def test_a_stage_reads_only_its_checkpoint_tensors(arch: str, stage: int, layers: set[str]) -> None:
    """The later stage reads its layers (Gemma 4 26B-A4B-style: its fused experts only), the tied embeddings and
    the norm (Zamba2: both shared blocks, which its layers invoke), nothing of the per-layer tables."""
    partition = {"gemma4_moe": "1,1", "gemma4": "2,4", "zamba2": "3,2"}[arch]
    part = _stages(arch, partition)[stage]
    model = load_model(_config(arch, 2), load_hf_config(_path(arch)), CPU, torch.float32, pipeline=part)
    read: set[str] = set()
    model.load_weights((n, ReadSpy(n, w, read)) for n, w in iterate_safetensors(checkpoint_files(_path(arch))))
    shared = {n for n in read if ".shared_transformer." in n}  # Zamba2's blocks, saved under a layer of each
    assert {m.group(1) for n in read - shared if (m := re.match(r"model\.layers\.(\d+)\.", n))} == layers
    others = {n for n in read if not n.startswith("model.layers.")}
    assert others - {"model.embed_tokens.weight"} == ({"model.final_layernorm.weight"} if arch == "zamba2"
                                                      else {"model.norm.weight"})
    assert bool(shared) == (arch == "zamba2")


@pytest.mark.parametrize(("arch", "partition", "message"), [
    ("gemma4", "3,3", "layer 4 reads layer 2's, on another stage): layers 2 to 5 on one stage, e.g. "
                      "ASYNCLLM_PP_LAYER_PARTITION=2,4"),
    ("gemma3n", "2,2", "layer 3 reads layer 1's, on another stage): layers 1 to 3 on one stage, e.g. "
                       "ASYNCLLM_PP_LAYER_PARTITION=1,3"),
])
def test_a_split_apart_from_the_shared_kv_cache_is_refused(arch: str, partition: str, message: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """On the host before anything is spawned, and on a worker handed such a stage."""
    hf_config = load_hf_config(_path(arch))
    config = _config(arch, 2)
    monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", partition)
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        check_pipeline_model(config, hf_config.architectures[0], hf_config)
    assert info.value.field == "ASYNCLLM_PP_LAYER_PARTITION"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_model(config, hf_config, CPU, torch.float32, pipeline=_stages(arch, partition)[1])


def test_a_default_split_that_parts_the_sharing_layers_is_refused_with_a_partition_that_works() -> None:
    """35 layers, the last 20 sharing layers 13's and 14's caches: vLLM's 18 + 17 parts them; the message names a
    split that keeps them together."""
    cfg = SimpleNamespace(num_hidden_layers=35, num_kv_shared_layers=20, layer_types=(["sliding_attention"] * 4 +
                          ["full_attention"]) * 7, num_key_value_heads=1, head_dim=256)
    with pytest.raises(ConfigError, match="layers 13 to 34 on one stage, e.g. ASYNCLLM_PP_LAYER_PARTITION=13,22"):
        check_pipeline_model(EngineConfig.create("m", pipeline_parallel_size=2), "Gemma4ForCausalLM", cfg)


def test_a_zamba2_stage_without_a_hybrid_layer_is_refused() -> None:
    """Layer 0 alone is a Mamba2 layer: no shared block, no KV cache on that stage."""
    stage = _stages("zamba2", "1,4")[0]
    model = load_model(_config("zamba2", 2), load_hf_config(_path("zamba2")), CPU, torch.float32, pipeline=stage)
    with pytest.raises(ConfigError, match="ASYNCLLM_PP_LAYER_PARTITION"):
        StageModel(model, stage, MemoryChannel())


def test_an_image_text_checkpoint_serving_text_alone_runs_in_stages(tmp_path) -> None:
    """Gemma 4's image-text checkpoint under ``limit_mm_per_prompt`` of 0 (its text-only class, as Gemma 3n's
    image-text checkpoints are served): 1 + 3 stages equal the unsplit text-only model (with images:
    tests/engine/test_pipeline_parallel_own_stages_engine.py)."""
    from gemma4_mm_utils import make_tiny_gemma4_mm

    from asyncllm.models.gemma4 import Gemma4TextOnly

    path = make_tiny_gemma4_mm(tmp_path / "gemma4", num_kv_shared_layers=1)
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2, limit_mm_per_prompt={"image": 0})
    full = load_model(config, hf_config, CPU, torch.float32)
    assert type(full) is Gemma4TextOnly
    channel = MemoryChannel()
    stages = [StageModel(load_model(config, hf_config, CPU, torch.float32, pipeline=stage), stage, channel)
              for stage in (PipelineStage(r, 2, *get_pp_indices(4, r, 2, "1,3")) for r in range(2))]
    for got, want in zip(paged_logits(Stages(stages), path), paged_logits(full, path), strict=True):
        assert torch.equal(got, want)
