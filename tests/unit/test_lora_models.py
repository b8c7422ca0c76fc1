"""LoRA in process on every family that takes adapters beyond Llama's and Qwen's (Gemma 1-3, Phi-3, Granite, OLMo 1-2,
ERNIE 4.5, Command R, Helium, GLM, GLM-4, Arcee, Apertus, VaultGemma, Nemotron, Jais 2, StableLM, CWM; the
attention of gpt-oss, Llama 4 and the other mixtures of experts, DBRX's fused ``Wqkv``; latent attention's every
projection: DeepSeek-V2 / V3, GLM-4.7-Flash, Mistral 4, Youtu, MiniCPM3; Kimi-Linear's every matrix, its KDA layers'
too; MiniMax's lightning and softmax attention and experts; every image-text family's decoder, Qwen3-Omni's
experts too): every position's logits equal PEFT's (fp32, 1e-4), for a
sequence with the adapter batched with one without it; Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` adapters
split per part over two tensor-parallel ranks; the host's check of fused and separate module names.
Through the whole engine: tests/engine/test_lora_engine.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hf_reference import HF_AYA_VISION_SCALES_LOGITS, hf_logits
from lora_utils import EXPERTS, make_adapter, peft_logits
from model_utils import MaskedRun
from safetensors.torch import load_file

from asyncllm import InvalidRequestError, LoRARequest
from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import _expert_layers, prepare
from asyncllm.lora import read_adapter
from asyncllm.lora_checker import AdapterChecker
from asyncllm.models.layers import TensorParallel
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.lora import LoRAContext, attach_lora_layers, load_adapter_tensors
from asyncllm.models.phi3 import Phi3ForCausalLM
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

ATOL = 1e-4
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LATENT = r".*\.(self_attn\.(q|q_a|q_b|kv_a|kv_b|o)_proj(_with_mqa)?|mlp\.(gate|up|down)_proj)"
"""Latent attention's projections (DeepSeek's) and the MLPs'."""
KIMI_LINEAR = (r".*\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|forget_gate\.f_[ab]_proj|b_proj|g_[ab]_proj|"
               r"kv_a_proj_with_mqa|kv_b_proj)|mlp\.(shared_experts\.)?(gate|up|down)_proj)")
"""Kimi-Linear's KDA and latent-attention projections, its dense MLP's and its shared experts'."""
MINIMAX = r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|output_gate|out_proj)"
"""MiniMax's lightning and softmax attention projections."""
SLOTS, MAX_RANK, SLOT = 2, 8, 1
"""The adapter goes in slot 1 of 2 (slot 0 stays empty)."""
ADAPTERS = {  # arch: make_adapter arguments (Gemma: every projection, separate; Phi-3: the fused ones)
    "gemma2": dict(seed=21, rank=8, alpha=16),
    "gemma3": dict(seed=22, rank=4, alpha=8, use_rslora=True),
    "phi3": dict(seed=23, rank=8, alpha=16, targets=PHI3_TARGETS, alpha_pattern={"qkv_proj": 32}),
    "granite": dict(seed=24, rank=8, alpha=16),  # Granite and OLMo 2 map as Llama: separate projections
    "olmo2": dict(seed=25, rank=4, alpha=8),
    # interleaved rotaries: the q/k rows, and so their B rows, reordered at load
    "ernie4_5": dict(seed=26, rank=4, alpha=8), "cohere": dict(seed=27, rank=8, alpha=16),
    "helium": dict(seed=28, rank=4, alpha=8),
    # every linear projection PEFT finds (fused gate_up in GLM's; no gate in Arcee's, Nemotron's, Jais 2's, ...)
    **{arch: dict(seed=30 + i, rank=4, alpha=4, targets="all-linear") for i, arch in enumerate(
        ("gemma", "arcee", "apertus", "vaultgemma", "nemotron", "olmo", "jais2", "glm", "glm4", "stablelm", "cwm", "phi",
         "starcoder2", "gptj", "opt", "gpt_neox", "gpt2", "gpt_bigcode", "falcon", "bloom", "mpt"))},
    # mixtures of experts: the attention's projections (their experts and routers take none)
    **{arch: dict(seed=50 + i, rank=4, alpha=8, targets=ATTENTION) for i, arch in enumerate(
        ("gpt_oss", "llama4", "phimoe", "glm4_moe", "flex_olmo", "dots1", "minimax_m2", "exaone_moe", "ernie4_5_moe",
         "solar_open", "sarvam_moe", "afmoe"))},
    "granitemoeshared": dict(seed=70, rank=8, alpha=32, targets=ATTENTION),
    # hybrids: the attention layers' projections (their state layers take none; Qwen3.5's: tests/unit/test_lora.py)
    "bamba": dict(seed=80, rank=4, alpha=8, targets=[*ATTENTION, "gate_proj", "up_proj", "down_proj"]),
    "qwen3_next": dict(seed=81, rank=4, alpha=8, targets=ATTENTION),
    "granitemoehybrid": dict(seed=82, rank=8, alpha=64, targets=ATTENTION),  # Granite's multipliers damp it
    "jamba": dict(seed=84, rank=4, alpha=8, targets=ATTENTION),  # its Mamba layers' linears take no LoRA layer
    # LFM2's names: self_attn.out_proj, feed_forward.w1 / w3 / w2 (its conv layers take none)
    "lfm2": dict(seed=85, rank=4, alpha=8, targets=r".*\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|feed_forward\.w\d)"),
    "nemotron_h": dict(seed=88, rank=4, alpha=8, targets=r".*mixer\.(q_proj|k_proj|v_proj|o_proj|up_proj|down_proj)"),
    "falcon_h1": dict(seed=87, rank=4, alpha=8, targets=[*ATTENTION, "gate_proj", "up_proj", "down_proj"]),  # muP
    # latent attention: every projection (kv_b_proj's adapters through the absorbed expansions), the dense MLPs
    # (PEFT turns gate / up / down on a mixture of experts into its experts' stacked parameters)
    **{arch: dict(seed=90 + i, rank=4, alpha=8, targets=LATENT) for i, arch in enumerate(
        ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4", "youtu", "minicpm3"))},
    # sparse attention: the latent attention's (the indexer reads q_a_proj's adapted latent; its own take none)
    **{arch: dict(seed=99 + i, rank=4, alpha=8, targets=LATENT)
       for i, arch in enumerate(("deepseek_v32", "glm_moe_dsa"))},
    "gemma3n": dict(seed=96, rank=4, alpha=8, targets=[*ATTENTION, "gate_proj", "up_proj", "down_proj"]),  # no AltUp
    "lfm2_moe": dict(seed=86, rank=4, alpha=8, targets=r".*\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|0\.feed_forward\.w\d)"),
    "dbrx": dict(seed=97, rank=8, alpha=16, targets=["Wqkv", "out_proj"]),  # the fused Wqkv's B cut into q, k, v
    # Kimi-Linear: its KDA layers', latent attention's, dense MLP's, shared experts' and experts' every matrix
    "kimi_linear": dict(seed=98, rank=4, alpha=8, targets=KIMI_LINEAR, target_parameters=EXPERTS),
    # MiniMax: its lightning layer's fused-per-head qkv_proj, output gate and out_proj, its softmax attention's, the
    # experts of both
    "minimax": dict(seed=79, rank=4, alpha=8, targets=MINIMAX, target_parameters=EXPERTS),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {arch: make_adapter(tiny_checkpoint(arch), str(tmp_path_factory.mktemp(f"lora_{arch}")), **kwargs)
            for arch, kwargs in ADAPTERS.items()}


def _with_adapter(model: torch.nn.Module, adapter: str) -> LoRAContext:
    """Attach LoRA layers to the model and put the adapter in `SLOT`; the context's mask is left to the caller."""
    context = LoRAContext()
    layers = attach_lora_layers(model, SLOTS, MAX_RANK, context)
    for module_name, part, lora_a, lora_b, scaling in load_adapter_tensors(read_adapter(adapter), model):
        layers[module_name].set(SLOT, part, lora_a, lora_b, scaling)
    return context


@pytest.mark.parametrize("arch", sorted(ADAPTERS))
def test_logits_equal_peft_with_the_base_model_in_the_same_batch(arch: str, adapters: dict[str, str]) -> None:
    _assert_logits_equal_peft(tiny_checkpoint(arch), adapters[arch], len(arch))


def test_a_multi_head_gptbigcode_adapter_is_cut_head_by_head(tmp_path) -> None:
    """GPTBigCode without multi-query attention fuses each head's q, k and v rows together in ``c_attn``: its
    adapter's B is cut the same way (`lora_b_rows`)."""
    path = tiny_checkpoint("gpt_bigcode", multi_query=False)
    _assert_logits_equal_peft(path, make_adapter(path, str(tmp_path / "mha"), seed=5, rank=4, alpha=8,
                                                 targets="all-linear"), 11)


def test_falcon_7bs_multi_query_layout_is_cut_as_its_weight(tmp_path) -> None:
    """Falcon-7B's multi-query ``query_key_value`` (the queries, then one key and one value): the adapter's B is cut
    as the weight is (Falcon-40B's per-KV-head groups: the tiny model's own, in the test above)."""
    path = tiny_checkpoint("falcon", new_decoder_architecture=False, multi_query=True)
    _assert_logits_equal_peft(path, make_adapter(path, str(tmp_path / "f"), seed=6, rank=4, alpha=8,
                                                 targets="all-linear"), 13)


def masked_logits(path: str, adapter: str, seed: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Two random sequences over a paged run in chunks and one-token steps, the first with the adapter in `SLOT`,
    the second on the base model: (the sequences, the first's logits, the second's)."""
    model = load_model(EngineConfig.create(path, max_model_len=64), load_hf_config(path), torch.device("cpu"),
                       torch.float32)
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in (23, 19)]
    run = MaskedRun(model, sequences, block_size=4)
    run.context, run.slots, run.num_slots = _with_adapter(model, adapter), [SLOT, -1], SLOTS
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(path), 1), torch.float32)
    return sequences, *run.run([[9, 7], [6, 1], [1, 1], [1, 9], [6, 1]])


def _assert_logits_equal_peft(path: str, adapter: str, seed: int) -> None:
    sequences, with_adapter, base = masked_logits(path, adapter, seed)
    expected = peft_logits(path, adapter, sequences[0])
    assert (expected - hf_logits(path, sequences[0])).abs().max() > 0.5  # the adapter changes the logits
    torch.testing.assert_close(with_adapter, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(base, hf_logits(path, sequences[1]), atol=ATOL, rtol=0)


MAMBA = {"mamba": ["in_proj", "x_proj", "dt_proj"], "mamba2": ["in_proj"]}
"""The Mamba mixers' projections PEFT adapts (it refuses ``out_proj`` on Mamba models, whose CUDA kernels read the
weight directly; the tests add one by hand: `_with_out_proj`)."""


def _with_out_proj(adapter: str, folder: str, path: str, seed: int) -> dict[str, torch.Tensor]:
    """A copy of ``adapter`` in ``folder`` with random rank-4 ``out_proj`` matrices on every layer; the products
    they add (alpha / r = 2 times B A) by transformers' parameter name."""
    import json
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(adapter, folder)
    tensors, config = load_file(f"{adapter}/adapter_model.safetensors"), load_hf_config(path)
    inner = config.intermediate_size if config.model_type == "mamba" else config.num_heads * config.head_dim
    gen, added = torch.Generator().manual_seed(seed), {}
    for i in range(config.num_hidden_layers):
        key = f"base_model.model.backbone.layers.{i}.mixer.out_proj"
        a, b = (torch.randn(shape, generator=gen) * 0.3 for shape in ((4, inner), (config.hidden_size, 4)))
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
        added[f"backbone.layers.{i}.mixer.out_proj.weight"] = 2.0 * b @ a
    save_file(tensors, f"{folder}/adapter_model.safetensors")
    with open(f"{folder}/adapter_config.json") as f:
        assert json.load(f)["lora_alpha"] / 4 == 2.0
    return added


@pytest.mark.parametrize("kind", sorted(MAMBA))
def test_mamba_mixer_adapters_equal_the_merged_weights(kind: str, tmp_path) -> None:
    """Every projection vLLM adapts on the mixers (Mamba's ``x_proj`` / ``dt_proj`` run request by request: each
    chunk's tokens, each decode position's, with the step's mask rows of those tokens): the logits equal
    transformers' with the adapter merged into the weights (float64; within 3 times transformers' own float32
    error), the base model's sequence untouched."""
    from lora_utils import merged_logits
    from mamba_utils import make_tiny_mamba

    path = make_tiny_mamba(tmp_path / "base", kind)
    peft = make_adapter(path, str(tmp_path / "peft"), seed=len(kind), rank=4, alpha=8, targets=MAMBA[kind])
    added = _with_out_proj(peft, str(tmp_path / "lora"), path, len(kind))
    AdapterChecker(load_hf_config(path), MAX_RANK).check(LoRARequest("m", 1, str(tmp_path / "lora")))  # the host's
    sequences, with_adapter, base = masked_logits(path, str(tmp_path / "lora"), len(kind))
    exact = merged_logits(path, peft, sequences[0], added, torch.float64)
    assert (exact.float() - merged_logits(path, peft, sequences[0])).abs().max() > 0.5  # out_proj's adapter matters
    assert (exact.float() - hf_logits(path, sequences[0])).abs().max() > 0.5  # the adapter changes the logits
    bound = 3 * (merged_logits(path, peft, sequences[0], added).double() - exact).abs().max().item()
    assert (with_adapter.double() - exact).abs().max().item() <= max(ATOL, bound)
    torch.testing.assert_close(base, hf_logits(path, sequences[1]), atol=ATOL, rtol=0)


def test_phi3_fused_adapters_split_per_part_over_two_ranks(adapters: dict[str, str]) -> None:
    """Each rank's column-parallel LoRA output is its rows of q, of k and of v (gate, up) of the whole product;
    the row-parallel ranks' partial products add up to it."""
    path = tiny_checkpoint("phi3")
    hf_config = load_hf_config(path)
    backend = get_attention_backend("torch_sdpa", torch.device("cpu"), torch.float32)
    ranks = []
    for rank in range(2):
        model = Phi3ForCausalLM(hf_config, dtype=torch.float32, tp=TensorParallel(rank, 2), attn_backend=backend,
                                max_position=64)
        context = _with_adapter(model, adapters["phi3"])
        context.mask = torch.tensor([[0.0, 1.0]] * 3)
        ranks.append(model.model.layers[1])
    read = read_adapter(adapters["phi3"])
    tensors = load_file(read.weights_path)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))

    def full(module: str, width: int) -> torch.Tensor:
        key = f"base_model.model.model.layers.1.{module}"
        a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
        return x[:, :width] @ a.T @ b.T * read.modules[f"model.layers.1.{module}"].scaling

    q, k, v = full("self_attn.qkv_proj", 64).split([64, 32, 32], dim=1)  # 4 q heads, 2 KV heads of 16 dims
    gate, up = full("mlp.gate_up_proj", 64).split([128, 128], dim=1)
    for rank, layer in enumerate(ranks):
        def rows(t: torch.Tensor, n: int, rank: int = rank) -> torch.Tensor:  # this rank's n features of a part
            return t[:, n * rank:n * (rank + 1)]

        qkv_out = layer.self_attn.qkv_proj.lora(x[:, :64], torch.zeros(3, 64))
        torch.testing.assert_close(qkv_out, torch.cat([rows(q, 32), rows(k, 16), rows(v, 16)], dim=1))
        gate_up_out = layer.mlp.gate_up_proj.lora(x[:, :64], torch.zeros(3, 128))
        torch.testing.assert_close(gate_up_out, torch.cat([rows(gate, 64), rows(up, 64)], dim=1))
    for block, name, width in [("self_attn", "o_proj", 64), ("mlp", "down_proj", 128)]:  # row-parallel
        half = width // 2
        partials = [getattr(getattr(layer, block), name).lora(x[:, half * r:half * (r + 1)], torch.zeros(3, 64))
                    for r, layer in enumerate(ranks)]
        torch.testing.assert_close(partials[0] + partials[1], full(f"{block}.{name}", width))


def test_the_host_checks_fused_and_separate_module_names(adapters: dict[str, str], tiny_llama: str,
                                                          tmp_path) -> None:
    phi3 = AdapterChecker(load_hf_config(tiny_checkpoint("phi3")), max_lora_rank=8)
    assert phi3.check(LoRARequest("p", 1, adapters["phi3"])).lora_path == adapters["phi3"]
    llama_adapter = make_adapter(tiny_llama, str(tmp_path / "llama"), seed=4, rank=4, targets=["q_proj"])
    with pytest.raises(InvalidRequestError, match="Phi3ForCausalLM has no q_proj to adapt .* fuses q, k, v"):
        phi3.check(LoRARequest("l", 2, llama_adapter))
    llama = AdapterChecker(load_hf_config(tiny_llama), max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="LlamaForCausalLM has no (qkv|gate_up)_proj to adapt .* fused checkpoint"):
        llama.check(LoRARequest("p", 1, adapters["phi3"]))
    gemma = AdapterChecker(load_hf_config(tiny_checkpoint("gemma2")), max_lora_rank=8)
    assert gemma.check(LoRARequest("g", 1, adapters["gemma2"])).lora_path == adapters["gemma2"]
    # every family's adapter passes the host's shape check (GLM-4's checkpoint's gate_up_proj fused, q, k, v apart)
    for arch in ADAPTERS:  # a mixture of experts' checker knows its layers (latent attention's adapters have experts)
        config = load_hf_config(tiny_checkpoint(arch))
        checker = AdapterChecker(config, 8, *_expert_layers(config, config, None))
        assert checker.check(LoRARequest(arch, 1, adapters[arch])).lora_path == adapters[arch]
    with pytest.raises(InvalidRequestError, match="Glm4ForCausalLM has no gate_proj to adapt"):
        AdapterChecker(load_hf_config(tiny_checkpoint("glm4")), max_lora_rank=8).check(LoRARequest("g", 1, adapters["gemma2"]))


DECODER_LINEARS = r"model\.(language_model\.|text_model\.)?layers\.\d+\.(self_attn|mlp)\.\w+_proj"
"""An image-text model's decoder projections, as transformers names them (its towers' left out)."""
OLDER = ("model.language_model.", "language_model.model.")
"""transformers 5's names of an image-text model's decoder and the older ones."""
IMAGE_TEXT = {  # family: (its tests' module, maker, maker's kwargs, transformers' class, (new, older) layout prefixes)
    "paligemma": ("paligemma_utils", "make_tiny_paligemma", {"generation": 2}, "PaliGemma", OLDER),
    "qwen2_5_omni": ("qwen2_5_omni_utils", "make_tiny_qwen2_5_omni", {}, "Qwen2_5OmniThinker",
                     ("model.", "thinker.model.")),  # the full model's names
    "llava": ("mm_utils", "make_tiny_llava", {}, "Llava", OLDER),
    "llava_next": ("mm_utils", "make_tiny_llava_next", {}, "LlavaNext", OLDER),
    "llava_next_video": ("llava_next_video_utils", "make_tiny_llava_next_video", {}, "LlavaNextVideo", OLDER),
    "llava_onevision": ("mm_utils", "make_tiny_llava_onevision", {}, "LlavaOnevision", OLDER),
    "idefics3": ("mm_utils", "make_tiny_idefics3", {}, "Idefics3", None),
    "smolvlm": ("mm_utils", "make_tiny_smolvlm", {}, "SmolVLM", None),
    "internvl": ("internvl_utils", "make_tiny_internvl", {}, "InternVL", OLDER),
    "aya_vision": ("aya_vision_utils", "make_tiny_aya_vision", {}, "AyaVision", OLDER),
    "cohere2_vision": ("cohere2_vision_utils", "make_tiny_cohere2_vision", {}, "Cohere2Vision", OLDER),
    "gemma3": ("gemma3_mm_utils", "make_tiny_gemma3_mm", {}, "Gemma3", OLDER),
    "mistral3": ("mistral3_utils", "make_tiny_mistral3", {}, "Mistral3", OLDER),
    "lighton_ocr": ("lighton_ocr_utils", "make_tiny_lighton_ocr", {}, "LightOnOcr", None),  # Qwen3's decoder
    "gemma4": ("gemma4_mm_utils", "make_tiny_gemma4_mm", {}, "Gemma4", None),
    "qwen3_omni": ("qwen3_omni_utils", "make_tiny_qwen3_omni", {}, "Qwen3OmniMoeThinker",
                   ("model.language_model.", "thinker.model.")),  # the released checkpoints' layout
    "gemma3n": ("gemma3n_audio_utils", "make_tiny_gemma3n_audio", {}, "Gemma3n", OLDER),  # audio-text
    "ernie4_5_vl": ("ernie_vl_utils", "make_tiny_ernie_vl", {}, "Ernie4_5_VLMoe", None),  # its dense MLP's too
    "paddleocr_vl": ("paddleocr_vl_utils", "make_tiny_paddleocr_vl", {}, "PaddleOCRVL",
                     ("model.language_model.", "model.")),  # the released checkpoints' decoder names
    "hunyuan_vl": ("hunyuan_vl_utils", "make_tiny_hunyuan_vl", {}, "HunYuanVL",
                   ("model.language_model.", "model.")),  # the released checkpoints' decoder names
    "phi4_multimodal": ("phi4_mm_utils", "make_tiny_phi4_mm", {}, "Phi4MultimodalForCausalLM", None),  # Phi-3's fused
    "mllama": ("mllama_utils", "make_tiny_mllama", {}, "Mllama", OLDER),  # self-attention and MLPs
    "aria": ("aria_utils", "make_tiny_aria", {}, "Aria", OLDER),  # its attention (its MLPs are experts)
}
"""Idefics3's and SmolVLM's decoder is ``model.text_model`` in either layout; Gemma 4 has transformers 5's alone."""


@pytest.mark.parametrize("family", sorted(IMAGE_TEXT))
def test_an_image_text_decoder_takes_adapters_as_peft(family: str, tmp_path, request) -> None:
    """Each image-text family's decoder (PaliGemma 2's Gemma 2 at positions from 1, its text prompts causal here so
    that transformers' text-only forward is the one run; Qwen2.5-Omni's and Qwen3-Omni's thinkers, Qwen3-Omni's experts
    too; Aya Vision's interleaved rotary rows): logits equal PEFT's on transformers' image-text class, the base
    model's beside them in the batch, with the model built to take images; the adapter's names in the older layout
    load alike; one with a tower's or projector's matrix is refused. Images with adapters through the engine:
    Qwen2.5-VL's in tests/engine/test_qwen_vl_engine.py (the decoder's layers are the same)."""
    import contextlib
    import importlib

    import transformers

    if family == "gemma3n":  # transformers builds Gemma 3n's vision tower with timm: stubbed, as its own tests do
        from gemma3n_audio_utils import _vision_tower_stubbed

        stack = contextlib.ExitStack()
        request.addfinalizer(stack.close)
        stack.enter_context(_vision_tower_stubbed())
    module, maker, kwargs, cls_name, layouts = IMAGE_TEXT[family]
    path = getattr(importlib.import_module(module), maker)(tmp_path / family, **kwargs)
    cls = getattr(transformers, cls_name if cls_name.endswith("ForCausalLM") else f"{cls_name}ForConditionalGeneration")
    if family == "paligemma":
        _edit_config(path, lambda config: config["text_config"].update(use_bidirectional_attention=False))
    # Qwen3-Omni's experts too; PEFT adapts its thinker's audio attention under any pattern: kept out by name
    experts = {"target_parameters": EXPERTS, "exclude_modules": r".*audio_tower.*"} if family == "qwen3_omni" else {}
    adapter = make_adapter(path, str(tmp_path / "adapter"), seed=7, rank=4, alpha=8, targets=DECODER_LINEARS,
                           auto_class=cls, **experts)
    tensors = load_file(f"{adapter}/adapter_model.safetensors")
    assert len(read_adapter(adapter).modules) == sum(".lora_A." in key for key in tensors) >= 8  # none left out
    checker = prepare(EngineConfig.create(path, enable_lora=True, max_lora_rank=8)).lora  # takes images
    assert checker is not None and checker.check(LoRARequest("d", 1, adapter))
    sequences, with_adapter, base = masked_logits(path, adapter, 3)
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_base = [hf(input_ids=torch.tensor([tokens])).logits[0] for tokens in sequences]
    expected, expected_base = peft_logits(path, adapter, sequences[0], cls), hf_base[1]
    assert (expected - hf_base[0]).abs().max() > 0.5  # the adapter changes the logits
    # our Cohere logits are scaled by logit_scale as vLLM's; transformers' not (Aya Vision's until 5.25)
    unscaled = ("cohere2_vision",) + (() if HF_AYA_VISION_SCALES_LOGITS else ("aya_vision",))
    scale = load_hf_config(path).text_config.logit_scale if family in unscaled else 1.0
    torch.testing.assert_close(with_adapter, expected * scale, atol=ATOL, rtol=0)
    torch.testing.assert_close(base, expected_base * scale, atol=ATOL, rtol=0)
    if layouts is not None:
        _assert_older_names_load_alike(adapter, str(tmp_path / "older"), path, layouts)
    _assert_a_tower_matrix_is_refused(adapter, str(tmp_path / "encoder"), checker, hf)
    if family == "mllama":
        _assert_a_matrix_is_refused(adapter, str(tmp_path / "cross"), checker, hf, ".cross_attn.q_proj",
                                    "adapters on the cross-attention layers")


def _edit_config(path: str, edit: Any) -> None:
    import json

    with open(f"{path}/config.json") as f:
        config = json.load(f)
    edit(config)
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)


def _renamed_copy(adapter: str, out: str, tensors: dict[str, torch.Tensor]) -> str:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(adapter, out)
    save_file(tensors, f"{out}/adapter_model.safetensors")
    return out


def _assert_older_names_load_alike(adapter: str, older: str, path: str, layouts: tuple[str, str]) -> None:
    """The adapter's matrices named in the older layout (``language_model.model.``; a full Omni model's
    ``thinker.model.``) load as the same projections and parts."""
    model = load_model(EngineConfig.create(path, max_model_len=64), load_hf_config(path), torch.device("cpu"),
                       torch.float32)
    new, old = (f"base_model.model.{prefix}" for prefix in layouts)
    tensors = load_file(f"{adapter}/adapter_model.safetensors")
    assert all(key.startswith(new) for key in tensors)
    _renamed_copy(adapter, older, {old + key.removeprefix(new): value for key, value in tensors.items()})
    got, want = load_adapter_tensors(read_adapter(older), model), load_adapter_tensors(read_adapter(adapter), model)
    assert [(n, p) for n, p, *_ in got] == [(n, p) for n, p, *_ in want] and got
    assert all(torch.equal(g[3], w[3]) for g, w in zip(got, want))


def _assert_a_tower_matrix_is_refused(adapter: str, out: str, checker: AdapterChecker, hf: Any) -> None:
    """The adapter plus a pair of matrices on the first linear layer outside the decoder (the vision or audio
    tower's, or the projector's) is refused by the host of a model that runs its tower."""
    name = next(n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)
                and ".language_model." not in n and not re.fullmatch(DECODER_LINEARS, n) and n != "lm_head")
    _assert_a_matrix_is_refused(adapter, out, checker, hf, name, "adapters on the (vision|audio) tower")


def _assert_a_matrix_is_refused(adapter: str, out: str, checker: AdapterChecker, hf: Any, name_end: str,
                                error: str) -> None:
    """The adapter plus a pair of matrices on the first linear layer whose name ends with ``name_end`` is refused
    with ``error``."""
    name, linear = next((n, m) for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)
                        and n.endswith(name_end))
    tensors = load_file(f"{adapter}/adapter_model.safetensors")
    tensors[f"base_model.model.{name}.lora_A.weight"] = torch.zeros(4, linear.in_features)
    tensors[f"base_model.model.{name}.lora_B.weight"] = torch.zeros(linear.out_features, 4)
    _renamed_copy(adapter, out, tensors)
    with pytest.raises(InvalidRequestError, match=error):
        checker.check(LoRARequest("t", 2, out))
