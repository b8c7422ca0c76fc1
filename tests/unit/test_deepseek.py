"""DeepSeek-V2 and V3, and GLM-4.7-Flash on V3's layers (asyncllm/models/deepseek.py) against transformers:
float32 logits within 1e-4 at every position over a paged cache (chunked prefills mixed with decodes), for V2's full-rank queries, interleaved rope and
group-limited softmax routing, and V3's low-rank queries, YaRN (its softmax mscale) and grouped sigmoid routing with
the score correction and renormalized weights; over two tensor-parallel ranks; and what is refused. MiniCPM3
(asyncllm/models/minicpm3.py): V2's latent attention with a half-split LongRoPE and muP's three scalars, each of
them mattering."""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint, free_port, spawn_ranks, tp_worker

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    Glm4MoeLiteForCausalLM,
    Mistral4ForCausalLM,
    YoutuForCausalLM,
    pairs_to_halves,
)
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.minicpm3 import MiniCPM3ForCausalLM
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 20, 11]
SCHEDULE = [[5, 9, 0], [4, 9, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]


def _model(arch: str, **fields) -> torch.nn.Module:
    path = tiny_checkpoint(arch)
    return load_model(EngineConfig.create(path, **fields), load_hf_config(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("arch", "cls"), [("deepseek_v2", DeepseekV2ForCausalLM),
                                           ("deepseek_v3", DeepseekV3ForCausalLM),
                                           ("glm4_moe_lite", Glm4MoeLiteForCausalLM),
                                           ("mistral4", Mistral4ForCausalLM),
                                           ("youtu", YoutuForCausalLM)])
def test_logits_match_transformers(arch: str, cls: type) -> None:
    """GLM-4.7-Flash (glm4_moe_lite): V3's layers, its dense layer by ``mlp_layer_types``, values as wide as keys;
    Youtu-LLM: V3's attention over dense MLPs only."""
    model = _model(arch)
    assert type(model) is cls
    spec = kv_cache_spec(load_hf_config(tiny_checkpoint(arch)), 1)
    assert (spec.kv_parts, spec.num_kv_heads, spec.head_dim) == (1, 1, 8 + 32)  # the rotary key and the latent
    assert_paged_logits_match_checkpoint(model, tiny_checkpoint(arch), SEQ_LENS, SCHEDULE, seed=len(arch))


@pytest.mark.parametrize("change", ["rope pairs", "yarn mscale", "score correction", "renormalize"])
def test_each_deepseek_detail_matters(change: str) -> None:
    """Leaving out any one of V3's details breaks the match (so the test above checks them)."""
    model = _model("deepseek_v3")
    attns, gate = [layer.self_attn for layer in model.model.layers], model.model.layers[1].mlp.gate
    if change == "rope pairs":
        for attn in attns:
            attn.interleaved = False
    elif change == "yarn mscale":
        for attn in attns:
            attn.attn.scale = attn.head_dim**-0.5
    elif change == "score correction":
        gate.e_score_correction_bias.data.zero_()
    else:
        gate.renormalize = False
    with pytest.raises(AssertionError):
        assert_paged_logits_match_checkpoint(model, tiny_checkpoint("deepseek_v3"), SEQ_LENS, SCHEDULE, seed=11)


@pytest.mark.parametrize("change", ["temperature", "renormalize"])
def test_each_mistral4_detail_matters(change: str) -> None:
    """Mistral 4's query temperature past ``original_max_position_embeddings`` and its renormalized softmax
    routing: dropping either breaks the match."""
    model = _model("mistral4")
    for layer in model.model.layers:
        if change == "temperature":
            layer.self_attn.beta = 0.0
        elif hasattr(layer.mlp, "gate"):
            layer.mlp.gate.renormalize = False
    with pytest.raises(AssertionError):
        assert_paged_logits_match_checkpoint(model, tiny_checkpoint("mistral4"), SEQ_LENS, SCHEDULE, seed=11)


MINICPM3_CASES = {  # name: (max_model_len, sequence lengths, schedule)
    "short_factors": (64, SEQ_LENS, SCHEDULE),  # within the 64 pretrained positions: transformers' short factors
    "long_factors": (None, [70, 66, 81], [[33, 40, 16], [36, 25, 32], [1, 1, 32], [0, 0, 1]]),  # past them: long
}


@pytest.mark.parametrize("case", sorted(MINICPM3_CASES))
def test_minicpm3_logits_match_transformers(case: str) -> None:
    """MiniCPM3: DeepSeek-V2's latent attention with a half-split LongRoPE (its cos/sin scaled by LongRoPE's
    attention factor), dense MLPs, the tied LM head, and muP's embedding, residual and logits scalars."""
    max_model_len, seq_lens, schedule = MINICPM3_CASES[case]
    model = _model("minicpm3", max_model_len=max_model_len)
    assert type(model) is MiniCPM3ForCausalLM and model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.model.layers[0].self_attn.interleaved
    spec = kv_cache_spec(load_hf_config(tiny_checkpoint("minicpm3")), 1)
    assert (spec.kv_parts, spec.num_kv_heads, spec.head_dim) == (1, 1, 8 + 32)
    assert_paged_logits_match_checkpoint(model, tiny_checkpoint("minicpm3"), seq_lens, schedule, seed=len(case))


@pytest.mark.parametrize("change", ["embedding scale", "residual scale", "logits scaling", "rope pairs",
                                    "long factors"])
def test_each_minicpm3_detail_matters(change: str) -> None:
    """Leaving out any one of MiniCPM3's multipliers, rotating interleaved pairs as DeepSeek does, or taking
    LongRoPE's long factors for sequences within the pretrained positions breaks the match."""
    model = _model("minicpm3", max_model_len=None if change == "long factors" else 64)
    if change == "embedding scale":
        model.model.embed_tokens.multiplier = 1.0
    elif change == "logits scaling":
        model.logits_scaling = 1.0
    for layer in model.model.layers:
        if change == "residual scale":
            layer.residual_multiplier = 1.0
        elif change == "rope pairs":
            layer.self_attn.interleaved = True
    with pytest.raises(AssertionError):
        assert_paged_logits_match_checkpoint(model, tiny_checkpoint("minicpm3"), SEQ_LENS, SCHEDULE, seed=11)


def test_pairs_to_halves() -> None:
    assert pairs_to_halves(torch.arange(8.0)).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.slow
def test_tp2_logits_match_transformers(tmp_path) -> None:
    """Two gloo ranks: each holds half the heads (q, kv_b and o split; the latent projections whole) and half of
    every expert's width; every rank's logits equal transformers'."""
    from hf_reference import hf_logits

    paths = [tiny_checkpoint("deepseek_v2"), tiny_checkpoint("deepseek_v3")]
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in SEQ_LENS]
    spawn_ranks(tp_worker, (2, free_port(), paths, str(tmp_path), sequences, SCHEDULE))
    for index, path in enumerate(paths):
        for rank in range(2):
            for tokens, logits in zip(sequences, torch.load(tmp_path / f"rank{rank}_{index}.pt")):
                torch.testing.assert_close(logits, hf_logits(path, tokens), atol=1e-4, rtol=0)


def test_refused_variants() -> None:
    # block fp8, AWQ and GPTQ (act-order experts too) are served: test_fp8_checkpoint.py, test_int4_checkpoint.py
    hf_config = load_hf_config(tiny_checkpoint("deepseek_v2"))
    hf_config.topk_method = "noaux_tc"
    with pytest.raises(NotBuiltError, match="topk_method"):
        load_model(EngineConfig.create(tiny_checkpoint("deepseek_v2")), hf_config, torch.device("cpu"), torch.float32)


def test_the_cache_holds_one_latent_row_per_token() -> None:
    """The paged cache holds ``[rotary key, normed latent]`` once per token (a one-part cache: keys are values):
    DeepSeek-V3's shapes store 576 values a token and layer where the expanded keys and values of its 128 heads
    took 2 * 128 * 192 (85 times more); the same on every tensor-parallel rank."""
    import transformers

    v3 = transformers.DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"])
    for tp in (1, 8):
        spec = kv_cache_spec(v3, tp)
        assert (spec.kv_parts, spec.num_kv_heads, spec.head_dim, spec.num_layers) == (1, 1, 576, 61)
    assert spec.bytes_per_block(16, torch.bfloat16) == 61 * 16 * 576 * 2
    assert (2 * 128 * 192) // 576 == 85
    path = tiny_checkpoint("deepseek_v3")
    (cache, *_) = kv_cache_spec(load_hf_config(path), 1).allocate(5, 4, torch.float32, torch.device("cpu"))
    assert cache.shape == (1, 5, 4, 1, 8 + 32)
    model = _model("deepseek_v3")
    attn = model.model.layers[0].self_attn
    w_uk, w_uv = attn.expansions()
    dense = attn.kv_b_proj.weight.view(attn.num_heads, 16 + 12, 32)  # per head: no-rope key rows, then value rows
    assert torch.equal(w_uk, dense[:, :16]) and torch.equal(w_uv, dense[:, 16:])
