"""Granite, OLMo 2 / 3, SmolLM3, EXAONE 4, GLM / GLM-4 / GLM-4.5 (MoE), ERNIE 4.5 (dense, MoE), Seed-OSS, Arcee,
Command R / R7B, Ministral / Ministral 3, Granite MoE (and shared), OLMoE, FlexOlmo, MiniMax-M2, dots.llm1, EXAONE
MoE, StarCoder2, Hunyuan, Helium, VaultGemma, Phi, StableLM, Nemotron and GPT-NeoX (asyncllm/models/: granite.py,
olmo2.py, smollm3.py, exaone4.py, glm4.py, glm4_moe.py, ernie_seed_arcee.py, cohere.py, ministral3.py, granitemoe.py,
olmoe.py, minimax_m2.py, starcoder2.py, hunyuan.py, exaone_moe.py, helium.py, gemma2.py, phi.py, stablelm.py,
nemotron.py, gpt_neox.py) against
transformers' forward over a paged KV cache, alone and over two tensor-parallel ranks.

The tiny Granite (asyncllm.tiny "granite") has every multiplier far from 1 (embeddings x12, residual x0.22,
attention scale 1/64 instead of 1/4, logits / 8) and tied embeddings; the tiny OLMo 2 has post-sublayer norms
and q/k norms over the whole projections with random weights. Requests run as chunked prefills mixed with
decodes, and every position's float32 logits must match transformers' within 1e-4. Over two ranks each holds
half the heads, so OLMo 2's q/k norms need the other rank's heads (`WholeProjectionRMSNorm`); with one KV head
both ranks hold the same k head."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_logits
from model_utils import PagedRun, free_port, spawn_ranks, tp_worker

from asyncllm.config import EngineConfig
from asyncllm.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from asyncllm.models.dots1 import Dots1ForCausalLM
from asyncllm.models.ernie_seed_arcee import (
    ArceeForCausalLM, Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM, SeedOssForCausalLM,
)
from asyncllm.models.exaone4 import Exaone4ForCausalLM
from asyncllm.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from asyncllm.models.apertus import ApertusForCausalLM
from asyncllm.models.glm4_moe import Glm4MoeForCausalLM, SolarOpenForCausalLM
from asyncllm.models.granite import GraniteForCausalLM
from asyncllm.models.granitemoe import GraniteMoeForCausalLM
from asyncllm.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from asyncllm.models.layers import TensorParallel
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.minimax_m2 import MiniMaxM2ForCausalLM
from asyncllm.models.ministral3 import Ministral3ForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.exaone_moe import ExaoneMoeForCausalLM
from asyncllm.models.gemma2 import VaultGemmaForCausalLM
from asyncllm.models.granitemoe import GraniteMoeSharedForCausalLM
from asyncllm.models.gpt2 import GPT2LMHeadModel, GPTBigCodeForCausalLM
from asyncllm.models.gpt_neox import GPTNeoXForCausalLM
from asyncllm.models.falcon import FalconForCausalLM
from asyncllm.models.gptj import GPTJForCausalLM
from asyncllm.models.jais2 import Jais2ForCausalLM
from asyncllm.models.olmo import OlmoForCausalLM
from asyncllm.models.phimoe import PhimoeForCausalLM
from asyncllm.models.opt import OPTForCausalLM
from asyncllm.models.helium import HeliumForCausalLM
from asyncllm.models.nemotron import NemotronForCausalLM
from asyncllm.models.phi import PhiForCausalLM
from asyncllm.models.stablelm import StableLmForCausalLM
from asyncllm.models.olmoe import FlexOlmoForCausalLM
from asyncllm.models.olmoe import OlmoeForCausalLM
from asyncllm.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM, WholeProjectionRMSNorm, olmo2_rms_norm
from asyncllm.models.registry import kv_cache_spec
from asyncllm.models.smollm3 import SmolLM3ForCausalLM
from asyncllm.models.starcoder2 import Starcoder2ForCausalLM
from asyncllm.tiny import tiny_checkpoint

ATOL = 1e-4
MODEL_CLASSES = {"granite": GraniteForCausalLM, "olmo2": Olmo2ForCausalLM, "olmo3": Olmo3ForCausalLM,
                 "smollm3": SmolLM3ForCausalLM, "exaone4": Exaone4ForCausalLM, "glm": GlmForCausalLM,
                 "glm4": Glm4ForCausalLM, "ernie4_5": Ernie4_5ForCausalLM, "seed_oss": SeedOssForCausalLM,
                 "arcee": ArceeForCausalLM, "cohere": CohereForCausalLM, "cohere2": Cohere2ForCausalLM,
                 "ministral": LlamaForCausalLM, "ministral3": Ministral3ForCausalLM, "granitemoe": GraniteMoeForCausalLM,
                 "olmoe": OlmoeForCausalLM, "starcoder2": Starcoder2ForCausalLM,
                 "hunyuan_v1_dense": HunYuanDenseV1ForCausalLM, "glm4_moe": Glm4MoeForCausalLM,
                 "minimax_m2": MiniMaxM2ForCausalLM, "ernie4_5_moe": Ernie4_5_MoeForCausalLM,
                 "hunyuan_v1_moe": HunYuanMoEV1ForCausalLM, "dots1": Dots1ForCausalLM, "apertus": ApertusForCausalLM,
                 "solar_open": SolarOpenForCausalLM, "sarvam_moe": Glm4MoeForCausalLM,
                 "exaone_moe": ExaoneMoeForCausalLM, "helium": HeliumForCausalLM, "vaultgemma": VaultGemmaForCausalLM,
                 "granitemoeshared": GraniteMoeSharedForCausalLM, "flex_olmo": FlexOlmoForCausalLM,
                 "phi": PhiForCausalLM, "stablelm": StableLmForCausalLM, "nemotron": NemotronForCausalLM,
                 "gpt_neox": GPTNeoXForCausalLM, "gpt2": GPT2LMHeadModel, "gpt_bigcode": GPTBigCodeForCausalLM,
                 "opt": OPTForCausalLM, "gptj": GPTJForCausalLM, "falcon": FalconForCausalLM,
                 "olmo": OlmoForCausalLM, "jais2": Jais2ForCausalLM, "cwm": LlamaForCausalLM,
                 "phimoe": PhimoeForCausalLM}
SEQ_LENS = [12, 20, 11]
SCHEDULE = [[5, 9, 0], [4, 9, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]
"""Prefill chunks beside decodes, then decode-only steps."""


def _sequences(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 512, (n,), generator=gen).tolist() for n in SEQ_LENS]


def _assert_match_transformers(path: str, sequences: list[list[int]], all_logits: list[torch.Tensor]) -> None:
    for tokens, logits in zip(sequences, all_logits, strict=True):
        expected = hf_logits(path, tokens)
        assert expected.std() > 0.15  # far from uniform (Granite's are divided by 8): matching means something
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("arch", sorted(MODEL_CLASSES))
def test_logits_match_transformers(arch: str) -> None:
    _check_logits(arch, tiny_checkpoint(arch))


@pytest.mark.parametrize("arch, overrides", [("stablelm", {"use_parallel_residual": True}),
                                             ("gpt_neox", {"use_parallel_residual": False}),
                                             ("gpt_neox", {"num_key_value_heads": 2}),  # stray: no GQA
                                             ("gpt_bigcode", {"multi_query": False}),
                                             ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
                                             ("falcon", {"new_decoder_architecture": False, "multi_query": True}),
                                             ("cohere", {"use_qk_norm": True}),
                                             ("stablelm", {"use_parallel_residual": True, "qk_layernorm": True}),
                                             ("falcon", {"new_decoder_architecture": False, "multi_query": False,
                                                         "num_kv_heads": 4, "parallel_attn": False})])
def test_the_other_residual_layout_matches_transformers(arch: str, overrides: dict) -> None:
    """StableLM's parallel layers, with its per-head q/k LayerNorms (stablelm-2-12b's layout), GPT-NeoX's sequential
    ones and a stray num_key_value_heads it ignores (as transformers' GPT-NeoX does), GPTBigCode with a KV head
    per head (each head's q, k, v together in c_attn), OPT after opt-350m (post-norm layers, a narrower embedding
    projected in and out), Falcon-7B's multi-query parallel layers and the sequential Falcon layers, Command R+'s
    per-head q/k LayerNorms (their columns reordered with the interleaved rotary's rows)."""
    _check_logits(arch, tiny_checkpoint(arch, **overrides))


def _check_logits(arch: str, path: str) -> None:
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    assert type(model) is MODEL_CLASSES[arch]
    spec = kv_cache_spec(hf_config, 1)
    sequences = _sequences(len(arch))
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    _assert_match_transformers(path, sequences, run.run(SCHEDULE))


def test_olmo2_qk_norms_span_the_projection_and_skip_the_backends_per_head_norm() -> None:
    """The backend's fused q/k norm is per head (Qwen3): OLMo 2's norms must never be handed to it."""
    path = tiny_checkpoint("olmo2")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    attn = model.model.layers[0].self_attn
    assert (attn.q_norm.weight.shape, attn.k_norm.weight.shape) == ((64,), (32,))  # 4 and 2 heads of 16
    assert attn._rotary_inputs(torch.zeros(1, dtype=torch.long)).q_norm_weight is None


@pytest.mark.slow
def test_tp2_logits_match_transformers(tmp_path) -> None:
    """Two gloo ranks, each holding half the heads: every rank's logits equal transformers'."""
    paths = [tiny_checkpoint("granite"), tiny_checkpoint("olmo2"), tiny_checkpoint("olmo2", num_kv_heads=1),
             tiny_checkpoint("glm4"),  # GLM-4: its reordered q/k rows and fused gate_up cut per rank
             tiny_checkpoint("granitemoe"),  # Granite MoE: its fused experts split, then each rank's slice
             tiny_checkpoint("olmoe"),  # OLMoE: whole-projection q/k norms (Llama's rounding) and experts
             tiny_checkpoint("minimax_m2"),  # MiniMax-M2: the same norms, a partial rotary, corrected sigmoid routing
             tiny_checkpoint("gpt_neox"),  # GPT-NeoX: its per-head fused q/k/v cut, then each rank's heads
             tiny_checkpoint("phi"),  # Phi: the LM head's bias split by vocabulary
             tiny_checkpoint("falcon"),  # Falcon: each KV head's group cut from the fused q/k/v, one group a rank
             tiny_checkpoint("gpt_bigcode"),  # GPTBigCode: one KV head, replicated on both ranks
             tiny_checkpoint("cohere", use_qk_norm=True),  # Command R+: each rank its heads' q/k norms
             tiny_checkpoint("stablelm", qk_layernorm=True)]  # stablelm-2-12b's: per-head norms stacked at load
    sequences = _sequences(2)
    spawn_ranks(tp_worker, (2, free_port(), paths, str(tmp_path), sequences, SCHEDULE))
    for index, path in enumerate(paths):
        for rank in range(2):
            _assert_match_transformers(path, sequences, torch.load(tmp_path / f"rank{rank}_{index}.pt"))


def test_olmo2_norm_rounds_as_transformers_in_bfloat16() -> None:
    """transformers multiplies OLMo 2's norm weight in float32 and rounds once (Llama's norm rounds first): in
    bfloat16 the two differ, and only the first keeps greedy outputs equal on a GPU."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm as HFOlmo2RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    hf_norm = HFOlmo2RMSNorm(48, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf_norm.weight.copy_(1 + torch.randn(48, generator=gen))
        expected = hf_norm(x)
    ours = WholeProjectionRMSNorm(3, 3, 0, 16, 1e-6, torch.bfloat16, TensorParallel())
    ours.weight.weight_loader(ours.weight, hf_norm.weight.detach())
    assert torch.equal(olmo2_rms_norm(x, hf_norm.weight, 1e-6), expected)
    assert torch.equal(ours(x.view(64, 3, 16)).view(64, 48), expected)


@pytest.mark.parametrize("arch", ["glm4", "ernie4_5", "cohere"])
def test_prequantized_checkpoints_of_families_reordered_at_load_are_refused(arch: str) -> None:
    """Their q/k rows are reordered at load, where packed int4 values and scales would not be."""
    from asyncllm.errors import NotBuiltError

    hf_config = load_hf_config(tiny_checkpoint(arch))
    hf_config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 32}
    with pytest.raises(NotBuiltError, match="pre-quantized"):
        load_model(EngineConfig.create(tiny_checkpoint(arch)), hf_config, torch.device("cpu"), torch.float32)


def test_granitemoe_checkpoints_of_transformers_5_names_load_the_same(tmp_path) -> None:
    """Granite MoE checkpoints name the router ``router.layer`` and the fused experts ``input_linear`` /
    ``output_linear`` (what transformers writes, and the tiny checkpoint has); transformers 5 calls them
    ``router`` and ``experts.gate_up_proj`` / ``experts.down_proj`` in memory, which a converted checkpoint may
    carry: both give transformers' logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("granitemoe")
    old = tmp_path / "granitemoe-5x"
    shutil.copytree(src, old)
    renames = {".router.layer.weight": ".router.weight", ".input_linear.weight": ".experts.gate_up_proj",
               ".output_linear.weight": ".experts.down_proj"}
    tensors = load_file(old / "model.safetensors")
    renamed = {next((k.replace(a, b) for a, b in renames.items() if k.endswith(a)), k): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, old / "model.safetensors", metadata={"format": "pt"})
    hf_config = load_hf_config(str(old))
    model = load_model(EngineConfig.create(str(old)), hf_config, torch.device("cpu"), torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    sequences = _sequences(3)
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    _assert_match_transformers(src, sequences, run.run(SCHEDULE))


def test_exaone_moe_leaves_the_multi_token_prediction_block_unread() -> None:
    """K-EXAONE ships an ``mtp.*`` block (transformers ignores it): loading skips it, other unknown names raise."""
    from asyncllm.errors import ConfigError

    path = tiny_checkpoint("exaone_moe")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    extra = torch.ones(4, 4)
    assert model.load_weights([("mtp.layers.0.input_layernorm.weight", extra)]) == set()
    with pytest.raises(ConfigError, match="model.mtp_head.weight"):
        model.load_weights([("model.mtp_head.weight", extra)])


def test_phimoe_longrope_scales_by_its_short_mscale_within_the_original_length() -> None:
    """Phi-3.5-MoE's LongRoPE: within ``original_max_position_embeddings`` (max_model_len 64) transformers rotates
    with the short factors and scales cos and sin by ``short_mscale``; asyncllm the same."""
    rope = {"rope_type": "longrope", "rope_theta": 10_000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], "long_factor": [2.0] * 8,
            "short_mscale": 1.25, "long_mscale": 1.4}
    path = tiny_checkpoint("phimoe", rope_parameters=rope)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, max_model_len=64), hf_config, torch.device("cpu"), torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    sequences = _sequences(7)
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    _assert_match_transformers(path, sequences, run.run(SCHEDULE))
    cache = model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    assert cache[0, 0].item() == pytest.approx(1.25)  # position 0: cos 1 times the short mscale
