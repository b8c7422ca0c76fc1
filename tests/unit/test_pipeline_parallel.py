"""Pipeline parallelism without processes: vLLM's layer split, every refusal, and each family's stages built
through the real loader, in one process, passing (hidden, residual) in memory: each stage holds exactly its
parts, reads only its checkpoint tensors, and the stages' logits are bit-equal to the unsplit model's over a
paged, chunked schedule. The engine over real worker processes: tests/engine/test_pipeline_parallel_engine.py."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pipeline_utils import MemoryChannel, ReadSpy, Stages, paged_logits, stage_params

from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import prepare
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.loader import checkpoint_files, iterate_safetensors, load_hf_config, load_model
from asyncllm.models.pipeline import PipelineStage, StageModel
from asyncllm.pipeline_parallel import check_pipeline_model, get_pp_indices, layer_partition
from asyncllm.tiny import tiny_checkpoint

CPU = torch.device("cpu")


@pytest.mark.parametrize(("num_layers", "pp", "counts"), [
    (4, 1, [4]), (4, 2, [2, 2]), (3, 2, [2, 1]), (5, 2, [3, 2]), (9, 3, [3, 3, 3]), (6, 4, [1, 2, 2, 1]),
    (7, 4, [2, 2, 2, 1]), (10, 4, [2, 3, 3, 2]), (2, 2, [1, 1]), (80, 3, [27, 27, 26]),
])
def test_layer_partition_is_vllms(num_layers: int, pp: int, counts: list[int]) -> None:
    """vLLM's get_pp_indices: even, the remainder one each to the stages before the last, backwards."""
    assert layer_partition(num_layers, pp) == counts
    bounds = [get_pp_indices(num_layers, rank, pp) for rank in range(pp)]
    assert [end - start for start, end in bounds] == counts
    assert [start for start, _ in bounds] == [0] + [end for _, end in bounds[:-1]] and bounds[-1][1] == num_layers


def test_layer_partition_override() -> None:
    assert [get_pp_indices(5, rank, 2, "1,4") for rank in range(2)] == [(0, 1), (1, 5)]
    for bad in ("2,2", "1,2,2", "5,0", "a,b"):
        with pytest.raises(ConfigError) as info:
            layer_partition(5, 2, bad)
        assert info.value.field == "ASYNCLLM_PP_LAYER_PARTITION"


@pytest.mark.parametrize(("field", "value"), [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
])
def test_config_refuses_unbuilt_combinations(field: str, value: Any) -> None:
    EngineConfig.create("m", **{field: value})  # fine alone
    with pytest.raises(NotBuiltError, match="pipeline_parallel_size=2") as info:
        EngineConfig.create("m", pipeline_parallel_size=2, **{field: value})
    assert info.value.field == field
    assert EngineConfig.create("m", pipeline_parallel_size=2).parallel_config.world_size == 2
    with pytest.raises(ConfigError):
        EngineConfig.create("m", pipeline_parallel_size=0)


@pytest.mark.parametrize("arch", ["LlamaModel", "Qwen3ForSequenceClassification", "WhisperForConditionalGeneration"])
def test_host_refuses_architectures_not_built(arch: str) -> None:
    with pytest.raises(NotBuiltError, match=arch) as info:
        check_pipeline_model(EngineConfig.create("m", pipeline_parallel_size=2), arch,
                             SimpleNamespace(num_hidden_layers=4))
    assert info.value.field == "pipeline_parallel_size"


def test_host_refuses_a_partition_that_does_not_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """(Pre-quantized checkpoints are not refused: tests/unit/test_pipeline_parallel_quantized.py runs each in stages.)"""
    config = EngineConfig.create("m", pipeline_parallel_size=2)
    monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", "3,2")
    with pytest.raises(ConfigError, match="adding up to the model's 4 layers"):
        check_pipeline_model(config, "LlamaForCausalLM", SimpleNamespace(num_hidden_layers=4))


def test_one_stage_checks_the_partition_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """As vLLM: with pipeline_parallel_size=1 a partition is checked, never ignored (the layer count itself passes),
    unless the config has no layer count to check it against."""
    config, hf_config = EngineConfig.create("m"), SimpleNamespace(num_hidden_layers=4)
    monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", "4")
    check_pipeline_model(config, "LlamaForCausalLM", hf_config)
    monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", "2,2")
    with pytest.raises(ConfigError, match=r"one positive layer count per stage \(pipeline_parallel_size=1\)") as info:
        check_pipeline_model(config, "LlamaForCausalLM", hf_config)
    assert info.value.field == "ASYNCLLM_PP_LAYER_PARTITION"
    check_pipeline_model(config, "LlamaForCausalLM", SimpleNamespace())  # a config without a layer count: unchecked


def test_more_stages_than_layers_is_a_config_error_at_start() -> None:
    """Through the host's `prepare`, before anything is spawned: the message names both numbers."""
    with pytest.raises(ConfigError, match=r"num_hidden_layers \(2\): 3 stages") as info:
        prepare(EngineConfig.create(tiny_checkpoint("llama"), pipeline_parallel_size=3))
    assert (info.value.field, info.value.value) == ("pipeline_parallel_size", 3)


CASES = [("llama", 3, 2), ("llama", 3, 3), ("llama", 5, 2), ("mistral", 2, 2), ("qwen2", 2, 2), ("qwen3", 2, 2),
         ("granite", 2, 2), ("olmo2", 2, 2), ("gemma2", 2, 2), ("gemma3", 2, 2), ("phi3", 2, 2), ("mixtral", 2, 2),
         ("qwen3_moe", 2, 2), ("gpt_oss", 2, 2),
         *((arch, 2, 2) for arch in (
             "gemma", "ernie4_5", "exaone4", "glm", "glm4", "helium", "hunyuan_v1_dense", "seed_oss", "smollm3",
             "starcoder2", "olmo3", "ministral", "ministral3", "arcee", "apertus", "cwm", "vaultgemma", "nemotron",
             "olmo", "jais2", "stablelm", "phi", "gpt_neox", "gptj", "falcon", "granitemoe", "olmoe", "flex_olmo",
             "phimoe", "dbrx", "dots1", "glm4_moe", "minimax_m2", "exaone_moe", "ernie4_5_moe", "hunyuan_v1_moe", "solar_open",
             "sarvam_moe", "llama4", "deepseek_v2", "deepseek_v3", "granitemoeshared", "youtu", "minicpm3", "mistral4",
             "glm4_moe_lite", "cohere", "cohere2", "gpt2", "gpt_bigcode", "opt", "bloom", "mpt", "afmoe"))]
"""(family, layers, stages): the odd splits on Llama, every family of PIPELINE_ARCHITECTURES (Granite and Gemma
tie their LM head to the embeddings, the MoE families load per-expert tensors, DeepSeek's latent attention keeps a
one-part cache per stage); Qwen2-MoE as Qwen3-MoE."""


@pytest.mark.parametrize(("arch", "num_layers", "pp"), CASES, ids=[f"{a}-{n}L-pp{p}" for a, n, p in CASES])
def test_stages_hold_their_parts_and_equal_the_unsplit_model(arch: str, num_layers: int, pp: int) -> None:
    path = tiny_checkpoint(arch, num_layers=num_layers) if num_layers != 2 else tiny_checkpoint(arch)
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=pp)
    full = load_model(config, hf_config, CPU, torch.float32)
    full_names = {name for name, _ in full.named_parameters()}
    channel, stages = MemoryChannel(), []
    for rank in range(pp):
        stage = PipelineStage(rank, pp, *get_pp_indices(num_layers, rank, pp))
        model = load_model(config, hf_config, CPU, torch.float32, pipeline=stage)
        held = {name for name, _ in model.named_parameters()}
        assert held == stage_params(full_names, stage, full.tie_word_embeddings)
        stages.append(StageModel(model, stage, channel))
    for got, want in zip(paged_logits(Stages(stages), path), paged_logits(full, path), strict=True):
        assert torch.equal(got, want)
    assert not channel.queue


_LIN, _FULL = "linear_attention", "full_attention"
HYBRIDS = {
    "qwen3_5": {}, "qwen3_5_moe": {}, "qwen3_next": {}, "jamba": {}, "falcon_h1": {},
    "granitemoehybrid": {"layer_types": [_LIN, _FULL, _LIN, _FULL]},
    "bamba": {"attn_layer_indices": [1, 3]},
    "lfm2": {"layer_types": ["conv", _FULL, "conv", _FULL]},
    "lfm2_moe": {"layer_types": ["conv", _FULL, "conv", _FULL]},
    "minimax": {"layer_types": [_LIN, _FULL, _LIN, _FULL]},
    "nemotron_h": {"num_layers": 5, "layers_block_type": [_LIN, _FULL, "moe", "mlp", _FULL]},
    "kimi_linear": {"num_hidden_layers": 4, "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                           "kda_layers": [1, 3], "full_attn_layers": [2, 4]}},
}
"""Hybrids of 4 layers (Nemotron-H: 5, split 3 + 2) whose every stage holds a state layer or an MLP-only layer
beside an attention layer (Falcon-H1's layers hold both)."""


@pytest.mark.parametrize("arch", sorted(HYBRIDS))
def test_hybrid_stages_keep_their_states_and_equal_the_unsplit_model(arch: str) -> None:
    """Each stage holds its layers' states (rows and checkpoint slots) and its attention layers' KV caches only;
    the stages' logits over the paged, chunked schedule (states carried from chunk to chunk) equal the unsplit
    model's."""
    from asyncllm.models.row_states import RowStates

    kwargs = {"num_layers": 4, **HYBRIDS[arch]}
    path = tiny_checkpoint(arch, **kwargs)
    hf_config = load_hf_config(path)
    num_layers = hf_config.num_hidden_layers
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2, max_num_seqs=8)
    full = load_model(config, hf_config, CPU, torch.float32)
    channel, stages = MemoryChannel(), []
    for rank in range(2):
        stage = PipelineStage(rank, 2, *get_pp_indices(num_layers, rank, 2))
        stage_model = StageModel(load_model(config, hf_config, CPU, torch.float32, pipeline=stage), stage, channel)
        assert stage_model.keeps_request_states and stage_model.checkpoint_slots == full.checkpoint_slots
        assert 0 < stage_model.num_kv_layers < stage.num_layers or arch == "falcon_h1"
        stages.append(stage_model)

    def states(model: torch.nn.Module) -> int:
        return sum(isinstance(getattr(m, "states", None), RowStates) for m in model.modules())

    assert [states(s) for s in stages] != [0, 0] and sum(states(s) for s in stages) == states(full)
    assert sum(s.num_kv_layers for s in stages) == full.kv_cache_layers(hf_config)
    for got, want in zip(paged_logits(Stages(stages), path), paged_logits(full, path), strict=True):
        assert torch.equal(got, want)
    assert not channel.queue


def test_a_stage_without_attention_layers_is_refused() -> None:
    """A hybrid split so that one stage holds only state layers: refused, naming the partition to change."""
    path = tiny_checkpoint("bamba", num_layers=4)  # attention in layer 1 only
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2)
    stage = PipelineStage(1, 2, 2, 4)
    model = load_model(config, load_hf_config(path), CPU, torch.float32, pipeline=stage)
    with pytest.raises(ConfigError, match="ASYNCLLM_PP_LAYER_PARTITION") as info:
        StageModel(model, stage, MemoryChannel())
    assert "stage 1 holds layers 2 to 3" in str(info.value)


def test_an_image_text_checkpoint_serving_text_alone_runs_in_stages(tmp_path) -> None:
    """Gemma 3's image-text checkpoint under ``limit_mm_per_prompt`` of 0 (its text-only class): the stages equal
    the unsplit text-only model."""
    from gemma3_mm_utils import make_tiny_gemma3_mm

    path = make_tiny_gemma3_mm(tmp_path / "gemma3")
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2,
                                 limit_mm_per_prompt={"image": 0, "video": 0})
    _assert_two_stages_equal_the_unsplit_model(config, load_hf_config(path), 2)


@pytest.mark.parametrize("maker", ["mm_utils:make_tiny_llava", "llava_next_video_utils:make_tiny_llava_next_video",
                                   "lighton_ocr_utils:make_tiny_lighton_ocr"])
def test_an_image_text_model_keeps_its_encoder_on_the_first_stage(tmp_path, maker) -> None:
    """LLaVA (and LLaVA-NeXT-Video) over two stages: the first holds the vision tower and projector with its layer,
    the second only its layer, the norm and the LM head, and reads none of the tower's tensors (the first stage's
    hidden states carry the images; through the engine: tests/engine/test_pipeline_parallel_engine.py). LLaVA-NeXT's
    ``image_newline``, a parameter rather than a module, stays on every stage (one vector)."""
    import importlib

    module, name = maker.split(":")
    path = getattr(importlib.import_module(module), name)(tmp_path / "llava")
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2)
    check_pipeline_model(config, hf_config.architectures[0], hf_config.text_config)  # the host runs it in stages
    full = {name for name, _ in load_model(config, hf_config, CPU, torch.float32).named_parameters()}
    encoder = {name for name in full if not name.startswith(("language_model.", "image_newline"))}
    assert encoder
    held = []
    for rank in range(2):
        stage = PipelineStage(rank, 2, *get_pp_indices(2, rank, 2))
        model = load_model(config, hf_config, CPU, torch.float32, pipeline=stage)
        held.append({name for name, _ in model.named_parameters()})
        read: set[str] = set()
        model.load_weights((n, ReadSpy(n, w, read)) for n, w in iterate_safetensors(checkpoint_files(path)))
        assert any("vision_tower" in n or "vision_encoder" in n for n in read) == (rank == 0)  # LightOnOCR's
    assert encoder <= held[0] and not encoder & held[1]
    assert held[0] | held[1] == full


def test_opt_350m_shape_post_norm_layers_and_projections_run_in_stages() -> None:
    """OPT-350m's shape: post-norm layers (the stream leaves each layer joined, so a zero residual crosses the
    stage boundary) and embeddings narrower than the layers (projected in on the first stage, out on the last)."""
    path = tiny_checkpoint("opt", num_layers=3, do_layer_norm_before=False, word_embed_proj_dim=32)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2)
    _assert_two_stages_equal_the_unsplit_model(config, load_hf_config(path), 3)


def test_a_stage_reads_only_its_checkpoint_tensors() -> None:
    path = tiny_checkpoint("llama", num_layers=5)
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, load_format="dummy", pipeline_parallel_size=2)
    stage = PipelineStage(1, 2, *get_pp_indices(5, 1, 2))  # layers 3 and 4, the norm, the LM head
    model = load_model(config, hf_config, CPU, torch.float32, pipeline=stage)
    read: set[str] = set()
    loaded = model.load_weights((n, ReadSpy(n, w, read)) for n, w in iterate_safetensors(checkpoint_files(path)))
    assert loaded == read == model.checkpoint_weight_names()
    assert {re.match(r"model\.layers\.(\d+)\.", n).group(1) for n in read if n.startswith("model.layers.")} == \
        {"3", "4"}
    assert {n for n in read if not n.startswith("model.layers.")} == {"model.norm.weight", "lm_head.weight"}


def test_a_gpt2_stage_reads_only_its_layers() -> None:
    """GPT-2's Conv1D matrices are transposed and its fused q/k/v cut when read: a stage drops the other stages'
    layers before that, and its first stage alone reads the learned positions."""
    path = tiny_checkpoint("gpt2", num_layers=5)
    config = EngineConfig.create(path, max_model_len=128, load_format="dummy", pipeline_parallel_size=2)
    reads = []
    for rank in range(2):
        stage = PipelineStage(rank, 2, *get_pp_indices(5, rank, 2))
        model = load_model(config, load_hf_config(path), CPU, torch.float32, pipeline=stage)
        read: set[str] = set()
        model.load_weights((n, ReadSpy(n, w, read)) for n, w in iterate_safetensors(checkpoint_files(path)))
        reads.append(read)
    layers = [{int(m.group(1)) for n in read if (m := re.search(r"\bh\.(\d+)\.", n))} for read in reads]
    assert layers == [{0, 1, 2}, {3, 4}]
    assert [any("wpe" in n for n in read) for read in reads] == [True, False]


def test_online_fp8_stages_equal_the_unsplit_model() -> None:
    path = tiny_checkpoint("llama", num_layers=3)
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, quantization="fp8", pipeline_parallel_size=2)
    _assert_two_stages_equal_the_unsplit_model(config, hf_config, 3)


def _assert_two_stages_equal_the_unsplit_model(config: EngineConfig, hf_config: Any, num_layers: int) -> None:
    full = load_model(config, hf_config, CPU, torch.float32)
    channel = MemoryChannel()
    stages = [StageModel(load_model(config, hf_config, CPU, torch.float32, pipeline=stage), stage, channel)
              for stage in (PipelineStage(r, 2, *get_pp_indices(num_layers, r, 2)) for r in range(2))]
    for got, want in zip(paged_logits(Stages(stages), config.model), paged_logits(full, config.model), strict=True):
        assert torch.equal(got, want)


MM_STAGES = {
    "paligemma": ("paligemma_utils", "make_tiny_paligemma", {"generation": 1}),
    "paligemma2": ("paligemma_utils", "make_tiny_paligemma", {"generation": 2}),
    "qwen2_5_omni": ("qwen2_5_omni_utils", "make_tiny_qwen2_5_omni", {}),
    "granite_speech": ("test_pipeline_parallel", "_tiny_granite_speech", {}),
    "aya_vision": ("aya_vision_utils", "make_tiny_aya_vision", {}),
    "cohere2_vision": ("cohere2_vision_utils", "make_tiny_cohere2_vision", {}),
    "paddleocr_vl": ("paddleocr_vl_utils", "make_tiny_paddleocr_vl", {}),
    "hunyuan_vl": ("hunyuan_vl_utils", "make_tiny_hunyuan_vl", {}),  # XD-RoPE's four-axis positions
    "aria": ("aria_utils", "make_tiny_aria", {}),  # stacked experts cut per expert on each stage
    "qwen3_omni": ("test_pipeline_parallel", "_tiny_qwen3_omni", {}),
    "gemma3n": ("gemma3n_audio_utils", "make_tiny_gemma3n_audio", {"num_kv_shared_layers": 0}),  # any split
}
"""Image- and audio-text families whose decoders run in stages beside an encoder on the first stage: PaliGemma's
Gemma / Gemma 2 at positions from 1 on every stage, Qwen2.5-Omni's M-RoPE Qwen2, Granite Speech's Granite, Aya
Vision's and Command A Vision's Cohere2 (sliding and global layers), Qwen3-Omni's M-RoPE Qwen3-MoE (its audio and vision towers, deepstack
mergers among them, on the first stage), Gemma 3n's own stages with its audio tower and embedders on the first,
and ERNIE 4.5 VL's (tests/unit/test_ernie_vl_stages.py: its modality experts routed on every stage)."""


@pytest.mark.parametrize("family", sorted(MM_STAGES))
def test_image_and_audio_text_stages_equal_the_unsplit_model(family: str, tmp_path) -> None:
    """The second stage holds the decoder's parts alone; the stages' logits equal the unsplit model's (text
    tokens: the first stage's embeddings carry any image or audio rows, as tests/engine/test_pipeline_parallel_engine.py
    runs them)."""
    import importlib

    from asyncllm.models.vision_language import text_config_of

    module, make, kwargs = MM_STAGES[family]
    path = getattr(importlib.import_module(module), make)(tmp_path / family, **kwargs)
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2)
    check_pipeline_model(config, hf_config.architectures[0], text_config_of(hf_config))
    num_layers = text_config_of(hf_config).num_hidden_layers
    later = load_model(config, hf_config, CPU, torch.float32,
                       pipeline=PipelineStage(1, 2, *get_pp_indices(num_layers, 1, 2)))
    assert all(name.startswith("language_model.") for name, _ in later.named_parameters())
    _assert_two_stages_equal_the_unsplit_model(config, hf_config, num_layers)


def _tiny_qwen3_omni(path: Any) -> str:
    """The tiny Qwen3-Omni thinker with 3 decoder layers: the first stage holds the 2 its deepstack rows join."""
    from qwen3_omni_utils import _TOKENS, _thinker_config
    from qwen2_5_omni_utils import save_tiny_thinker
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    def three_layers(tokenizer: Any) -> Any:
        config = _thinker_config(tokenizer)
        config.text_config.num_hidden_layers = 3
        return config

    return save_tiny_thinker(path, Qwen3OmniMoeThinkerForConditionalGeneration, three_layers, _TOKENS, 0, 16)


def test_stages_of_qwen3_omni_report_its_audio_in_video_pieces(tmp_path) -> None:
    """Each stage's `WorkerReady` carries the whole model's piece merge and audio window (a `StageModel` has neither:
    the core would refuse every ``use_audio_in_video`` request)."""
    from asyncllm.workers.worker import mm_piece_fields

    path = _tiny_qwen3_omni(tmp_path / "qwen3_omni")
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2)
    expected = (hf_config.vision_config.spatial_merge_size, hf_config.audio_config.n_window)
    assert all(expected) and mm_piece_fields(load_model(config, hf_config, CPU, torch.float32)) == expected
    for stage in (PipelineStage(r, 2, *get_pp_indices(3, r, 2)) for r in range(2)):
        model = StageModel(load_model(config, hf_config, CPU, torch.float32, pipeline=stage), stage, MemoryChannel())
        assert mm_piece_fields(model) == expected
    assert mm_piece_fields(None) == (0, 0)


def _tiny_granite_speech(path: Any) -> str:
    from granite_speech_utils import tiny_granite_speech_model

    tiny_granite_speech_model(512, 511, seed=3).save_pretrained(path)
    return str(path)
