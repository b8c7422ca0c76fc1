"""Which in-house class runs which HF architecture, and what its KV cache looks like."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.architectures import (
    DECODER_CLASSIFIER_BASES, HEADLESS_BASES, SUPPORTED_ARCHITECTURES, TEXT_ONLY_CAPABLE_ARCHITECTURES,
    architecture_of, serves_as_encoder, serves_text_only,
)
from asyncllm.models.family_config import mlp_width
from asyncllm.models.layers import LoadedWeight, TensorParallel, head_dim_of, kv_heads_per_rank, num_kv_heads_of
from asyncllm.models.moe import moe_parallel_problems

__all__ = [
    "CausalLM",
    "FP8_KV_CACHE_DTYPES",
    "KVCacheSpec",
    "SUPPORTED_ARCHITECTURES",
    "get_model_class",
    "kv_cache_spec",
    "kv_cache_torch_dtype",
    "check_tensor_parallel",
    "text_config_of",
]


class CausalLM(Protocol):
    """What the model runner and the loader use of a model (an ``nn.Module``)."""

    def __init__(
        self,
        hf_config: Any,
        *,
        dtype: torch.dtype,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        max_position: int,
    ) -> None: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def checkpoint_weight_names(self) -> set[str]: ...

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]: ...


class LazyClasses(Mapping[str, Any]):
    """Architecture -> its class (or function), each model module imported the first time it is asked for: a
    worker imports its own model's module, not the hundred others (about 0.2 s of every worker's start).

    A value is ``"module:name"`` under ``asyncllm.models``, or ``("module:wrapper", "module:name")`` for a class
    made from another (`headless`, `sequence_classifier`)."""

    def __init__(self, specs: dict[str, str | tuple[str, str]]) -> None:
        self._specs = specs
        self._resolved: dict[str, Any] = {}

    def __getitem__(self, arch: str) -> Any:
        if arch not in self._resolved:
            spec = self._specs[arch]
            wrapper, target = spec if isinstance(spec, tuple) else (None, spec)
            obj = _resolve(target)
            self._resolved[arch] = _resolve(wrapper)(obj) if wrapper is not None else obj
        return self._resolved[arch]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def _resolve(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(f"asyncllm.models.{module}"), name)


def headless(cls: type) -> type:
    """`cls` for a bare decoder's checkpoint (``LlamaModel`` & co.): no LM head to load (embeddings only), and the
    checkpoint's names under the causal LM's decoder prefix (``hf_decoder_prefix``: ``model.``, GPT-NeoX's
    ``gpt_neox.``, ...) before the family's own renames read them."""
    prefix = cls.hf_decoder_prefix

    def load_weights(self: Any, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return cls.load_weights(self, ((name if name.startswith(prefix) else prefix + name, weight)
                                       for name, weight in weights))

    return type(cls.__name__ + "Headless", (cls,), {"has_lm_head": False, "load_weights": load_weights})


_SPECS: dict[str, str | tuple[str, str]] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
    "GemmaForCausalLM": "gemma:Gemma1ForCausalLM",
    "Gemma2ForCausalLM": "gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "gemma3_mm:Gemma3ForConditionalGeneration",  # limit_mm_per_prompt image 0: Gemma3TextOnly
    "PaliGemmaForConditionalGeneration": "paligemma:PaliGemmaForConditionalGeneration",
    "Gemma4ForCausalLM": "gemma4:Gemma4ForCausalLM",
    "Gemma3nForCausalLM": "gemma3n:Gemma3nForCausalLM",
    "Qwen2AudioForConditionalGeneration": "qwen2_audio:Qwen2AudioForConditionalGeneration",
    "AudioFlamingo3ForConditionalGeneration": "qwen2_audio:AudioFlamingo3ForConditionalGeneration",
    "GlmAsrForConditionalGeneration": "glmasr:GlmAsrForConditionalGeneration",
    "VoxtralForConditionalGeneration": "voxtral:VoxtralForConditionalGeneration",
    "Qwen3ASRForConditionalGeneration": "qwen3_asr:Qwen3ASRForConditionalGeneration",
    "GraniteSpeechForConditionalGeneration": "granite_speech:GraniteSpeechForConditionalGeneration",
    "Qwen2_5OmniThinkerForConditionalGeneration": "qwen2_5_omni:Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen2_5OmniForConditionalGeneration": "qwen2_5_omni:Qwen2_5OmniThinkerForConditionalGeneration",  # thinker only
    "Qwen3OmniMoeThinkerForConditionalGeneration": "qwen3_omni:Qwen3OmniMoeThinkerForConditionalGeneration",
    "Qwen3OmniMoeForConditionalGeneration": "qwen3_omni:Qwen3OmniMoeThinkerForConditionalGeneration",  # thinker only
    "WhisperForConditionalGeneration": "whisper:WhisperForConditionalGeneration",
    "Gemma3nForConditionalGeneration": "gemma3n_mm:Gemma3nForConditionalGeneration",  # limit_mm_per_prompt image 0: Gemma3nTextOnly
    "Gemma4ForConditionalGeneration": "gemma4_mm:Gemma4ForConditionalGeneration",  # limit_mm_per_prompt image 0: Gemma4TextOnly
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "Phi4MultimodalForCausalLM": "phi4_multimodal:Phi4MultimodalForCausalLM",
    "GraniteForCausalLM": "granite:GraniteForCausalLM",
    "Olmo2ForCausalLM": "olmo2:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "olmo2:Olmo3ForCausalLM",
    "SmolLM3ForCausalLM": "smollm3:SmolLM3ForCausalLM",
    "Exaone4ForCausalLM": "exaone4:Exaone4ForCausalLM",
    "GlmForCausalLM": "glm4:GlmForCausalLM",
    "Glm4ForCausalLM": "glm4:Glm4ForCausalLM",
    "Ernie4_5ForCausalLM": "ernie_seed_arcee:Ernie4_5ForCausalLM",
    "SeedOssForCausalLM": "ernie_seed_arcee:SeedOssForCausalLM",
    "ArceeForCausalLM": "ernie_seed_arcee:ArceeForCausalLM",
    "CohereForCausalLM": "cohere:CohereForCausalLM",
    "Cohere2ForCausalLM": "cohere:Cohere2ForCausalLM",
    "MinistralForCausalLM": "llama:LlamaForCausalLM",  # Mistral's layers; sliding windows per layer_types
    "Ministral3ForCausalLM": "ministral3:Ministral3ForCausalLM",
    "GraniteMoeForCausalLM": "granitemoe:GraniteMoeForCausalLM",
    "OlmoeForCausalLM": "olmoe:OlmoeForCausalLM",
    "Starcoder2ForCausalLM": "starcoder2:Starcoder2ForCausalLM",
    "HunYuanDenseV1ForCausalLM": "hunyuan:HunYuanDenseV1ForCausalLM",
    "GptOssForCausalLM": "gpt_oss:GptOssForCausalLM",
    "LlavaForConditionalGeneration": "llava:LlavaForConditionalGeneration",
    "MllamaForConditionalGeneration": "mllama:MllamaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "llava_next:LlavaNextForConditionalGeneration",
    "LlavaNextVideoForConditionalGeneration": "llava_next_video:LlavaNextVideoForConditionalGeneration",
    "Idefics3ForConditionalGeneration": "idefics3:Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "idefics3:SmolVLMForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration": "llava_onevision:LlavaOnevisionForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "mistral3:Mistral3ForConditionalGeneration",
    "LightOnOcrForConditionalGeneration": "lighton_ocr:LightOnOcrForConditionalGeneration",
    "InternVLForConditionalGeneration": "internvl:InternVLForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "qwen2_vl:Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe:Qwen3VLMoeForConditionalGeneration",
    "Glm4vForConditionalGeneration": "glm4v:Glm4vForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration": "glm4v:Glm4vMoeForConditionalGeneration",
    "Ernie4_5_VLMoeForConditionalGeneration": "ernie4_5_vl:Ernie4_5_VLMoeForConditionalGeneration",
    "PaddleOCRVLForConditionalGeneration": "paddleocr_vl:PaddleOCRVLForConditionalGeneration",
    "HunYuanVLForConditionalGeneration": "hunyuan_vl:HunYuanVLForConditionalGeneration",
    "AriaForConditionalGeneration": "aria:AriaForConditionalGeneration",
    "AyaVisionForConditionalGeneration": "aya_vision:AyaVisionForConditionalGeneration",
    "Cohere2VisionForConditionalGeneration": "cohere2_vision:Cohere2VisionForConditionalGeneration",
    "Lfm2VlForConditionalGeneration": "lfm2_vl:Lfm2VlForConditionalGeneration",
    "DeepseekV2ForCausalLM": "deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "deepseek:DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM": "deepseek:Glm4MoeLiteForCausalLM",
    "Mistral4ForCausalLM": "deepseek:Mistral4ForCausalLM",
    "DeepseekV32ForCausalLM": "deepseek_sparse:DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM": "deepseek_sparse:GlmMoeDsaForCausalLM",
    "Glm4MoeForCausalLM": "glm4_moe:Glm4MoeForCausalLM",
    "Dots1ForCausalLM": "dots1:Dots1ForCausalLM",
    "Llama4ForCausalLM": "llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "llama4:Llama4ForConditionalGeneration",  # limit_mm_per_prompt 0: Llama4TextOnly
    "Qwen3_5ForCausalLM": "qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "qwen3_5:Qwen3_5ForConditionalGeneration",  # limit_mm_per_prompt 0: Qwen3_5TextOnly
    "Qwen3_5MoeForCausalLM": "qwen3_5:Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5:Qwen3_5MoeForConditionalGeneration",
    "Qwen3NextForCausalLM": "qwen3_next:Qwen3NextForCausalLM",
    "KimiLinearForCausalLM": "kimi_linear:KimiLinearForCausalLM",
    "MiniMaxForCausalLM": "minimax:MiniMaxForCausalLM",
    "MiniMaxM2ForCausalLM": "minimax_m2:MiniMaxM2ForCausalLM",
    "GraniteMoeHybridForCausalLM": "granite4:GraniteMoeHybridForCausalLM",
    "Lfm2ForCausalLM": "lfm2:Lfm2ForCausalLM",
    "FalconH1ForCausalLM": "falcon_h1:FalconH1ForCausalLM",
    "SolarOpenForCausalLM": "glm4_moe:SolarOpenForCausalLM",
    "AfmoeForCausalLM": "afmoe:AfmoeForCausalLM",
    "LongcatFlashForCausalLM": "longcat_flash:LongcatFlashForCausalLM",
    "SarvamMoEForCausalLM": "glm4_moe:Glm4MoeForCausalLM",
    "JambaForCausalLM": "jamba:JambaForCausalLM",
    "MambaForCausalLM": "mamba:MambaForCausalLM",
    "ExaoneMoeForCausalLM": "exaone_moe:ExaoneMoeForCausalLM",
    "HeliumForCausalLM": "helium:HeliumForCausalLM",
    "VaultGemmaForCausalLM": "gemma2:VaultGemmaForCausalLM",
    "GraniteMoeSharedForCausalLM": "granitemoe:GraniteMoeSharedForCausalLM",
    "FlexOlmoForCausalLM": "olmoe:FlexOlmoForCausalLM",
    "PhiForCausalLM": "phi:PhiForCausalLM",
    "StableLmForCausalLM": "stablelm:StableLmForCausalLM",
    "NemotronForCausalLM": "nemotron:NemotronForCausalLM",
    "GPTNeoXForCausalLM": "gpt_neox:GPTNeoXForCausalLM",
    "GPT2LMHeadModel": "gpt2:GPT2LMHeadModel",
    "GPTBigCodeForCausalLM": "gpt2:GPTBigCodeForCausalLM",
    "OPTForCausalLM": "opt:OPTForCausalLM",
    "GPTJForCausalLM": "gptj:GPTJForCausalLM",
    "FalconForCausalLM": "falcon:FalconForCausalLM",
    "BloomForCausalLM": "bloom:BloomForCausalLM",
    "MptForCausalLM": "mpt:MptForCausalLM",
    "OlmoForCausalLM": "olmo:OlmoForCausalLM",
    "Jais2ForCausalLM": "jais2:Jais2ForCausalLM",
    "YoutuForCausalLM": "deepseek:YoutuForCausalLM",
    "MiniCPM3ForCausalLM": "minicpm3:MiniCPM3ForCausalLM",
    "PhimoeForCausalLM": "phimoe:PhimoeForCausalLM",
    "DbrxForCausalLM": "dbrx:DbrxForCausalLM",
    "CwmForCausalLM": "llama:LlamaForCausalLM",  # Llama's layers, a window in the layers layer_types names
    "FalconMambaForCausalLM": "mamba:FalconMambaForCausalLM", "Mamba2ForCausalLM": "mamba:Mamba2ForCausalLM",
    "ApertusForCausalLM": "apertus:ApertusForCausalLM",
    "Lfm2MoeForCausalLM": "lfm2:Lfm2MoeForCausalLM",
    "NemotronHForCausalLM": "nemotron_h:NemotronHForCausalLM",
    "BambaForCausalLM": "bamba:BambaForCausalLM",
    "Zamba2ForCausalLM": "zamba2:Zamba2ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "ernie_seed_arcee:Ernie4_5_MoeForCausalLM",
    "HunYuanMoEV1ForCausalLM": "hunyuan:HunYuanMoEV1ForCausalLM",
    "BertModel": "bert:BertEmbeddingModel", "RobertaModel": "bert:BertEmbeddingModel",
    "HF_ColBERT": "colbert:ColBERTModel",  # a BERT encoder under a per-token projection (late interaction)
    "RobertaForMaskedLM": "bert:BertEmbeddingModel",
    "XLMRobertaModel": "bert:BertEmbeddingModel",
    "BertForSequenceClassification": "bert:BertForSequenceClassification",
    "RobertaForSequenceClassification": "bert:BertForSequenceClassification",
    "XLMRobertaForSequenceClassification": "bert:BertForSequenceClassification",
    "ModernBertModel": "modernbert:ModernBertEmbeddingModel", "NomicBertModel": "rotary_bert:NomicBertEmbeddingModel",
    "GteModel": "rotary_bert:GteEmbeddingModel", "GteNewModel": "rotary_bert:GteEmbeddingModel",
    "GteForSequenceClassification": "rotary_bert:GteForSequenceClassification",
    "GteNewForSequenceClassification": "rotary_bert:GteForSequenceClassification",
    "CLIPModel": "clip_embedding:CLIPEmbeddingModel", "SiglipModel": "siglip_embedding:SiglipEmbeddingModel",
    "ModernBertForSequenceClassification": "modernbert:ModernBertForSequenceClassification",
    "BertForTokenClassification": "bert:BertForTokenClassification",
    "ModernBertForTokenClassification": "modernbert:ModernBertForTokenClassification",
    "Qwen2ForRewardModel": ("reward:qwen2_reward_model", "qwen2:Qwen2ForCausalLM"),
    "Qwen2ForProcessRewardModel": ("reward:qwen2_process_reward_model", "qwen2:Qwen2ForCausalLM"),
}
_MODELS = LazyClasses({
    **_SPECS,
    **{arch: ("classifier:sequence_classifier", _SPECS[base]) for arch, base in DECODER_CLASSIFIER_BASES.items()},
    **{arch: ("registry:headless", _SPECS[base]) for arch, base in HEADLESS_BASES.items()},
})
assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES), "asyncllm/models/architectures.py names every class here"


_TEXT_ONLY = LazyClasses({"Gemma3ForConditionalGeneration": "gemma3:Gemma3TextOnly",
                          "Gemma4ForConditionalGeneration": "gemma4:Gemma4TextOnly",
                          "Qwen3_5ForConditionalGeneration": "qwen3_5:Qwen3_5TextOnly",
                          "Qwen3_5MoeForConditionalGeneration": "qwen3_5:Qwen3_5MoeTextOnly",
                          "Mistral3ForConditionalGeneration": "mistral3:mistral3_text_only",
                          "Llama4ForConditionalGeneration": "llama4:Llama4TextOnly",
                          "Gemma3nForConditionalGeneration": "gemma3n:Gemma3nTextOnly"})
"""Each text-only-capable architecture's text model: its class, or a function of the config naming it (Mistral 3:
by its decoder's type)."""
assert set(_TEXT_ONLY) == set(TEXT_ONLY_CAPABLE_ARCHITECTURES)


def get_model_class(hf_config: Any, limits: dict[str, int] | None = None) -> type[CausalLM]:
    """The class for ``hf_config.architectures[0]`` (its text-only class when `serves_text_only` under the
    ``limit_mm_per_prompt`` given); `NotBuiltError` for any other."""
    arch = architecture_of(hf_config)
    if serves_text_only(arch, limits):
        text_only = _TEXT_ONLY[arch]
        return text_only if isinstance(text_only, type) else text_only(hf_config)
    variant = _VARIANTS.get(arch)
    return variant(hf_config) if variant is not None else _MODELS[arch]


def _llava_variant(hf_config: Any) -> type[CausalLM]:
    """LLaVA's class by its tower: Pixtral-12B's checkpoints are LLaVA ones with a Pixtral tower."""
    from asyncllm.models.mistral3 import PixtralLlavaForConditionalGeneration

    vision = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
    return PixtralLlavaForConditionalGeneration if vision == "pixtral" else _MODELS["LlavaForConditionalGeneration"]


_VARIANTS = LazyClasses({"LlavaForConditionalGeneration": "registry:_llava_variant",
                         "Gemma3TextModel": "embedding_gemma:gemma3_text_model"})  # EmbeddingGemma or causal
"""Architectures whose class depends on more of the config than its name: a function of the config naming it."""


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one layer's KV cache on one rank: ``[kv_parts, num_blocks, block_size, num_kv_heads, head_dim]``.

    ``layer_shapes`` gives each cache layer its own ``(num_kv_heads, head_dim)`` where they differ (Gemma 4's
    sliding and global layers); empty: every layer ``(num_kv_heads, head_dim)``. ``kv_parts`` is 2 (keys, then
    values) or 1: the keys alone, which are the values too (latent attention's cache: DeepSeek, docs/deepseek.md)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_shapes: tuple[tuple[int, int], ...] = ()
    kv_parts: int = 2

    def shapes(self) -> list[tuple[int, int]]:
        """Each cache layer's ``(num_kv_heads, head_dim)`` on this rank."""
        if self.layer_shapes:
            assert len(self.layer_shapes) == self.num_layers, (len(self.layer_shapes), self.num_layers)
            return list(self.layer_shapes)
        return [(self.num_kv_heads, self.head_dim)] * self.num_layers

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
                 ) -> list[torch.Tensor]:
        """Zeroed caches, one ``[kv_parts, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer."""
        return [torch.zeros((self.kv_parts, num_blocks, block_size, heads, dim), dtype=dtype, device=device)
                for heads, dim in self.shapes()]

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers (K and V, or the keys alone)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.kv_parts * block_size * itemsize * sum(heads * dim for heads, dim in self.shapes())


FP8_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""`kv_cache_dtype` values that store K and V in one byte (vLLM's names), and their torch dtypes."""


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: ``model_dtype`` for ``auto`` and for its name (``bfloat16``, ``float16``: vLLM's;
    `NotBuiltError` for a model of another dtype), else the fp8 type named."""
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return FP8_KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype not in ("auto", str(model_dtype).removeprefix("torch.")):
        raise NotBuiltError("kv_cache_dtype", kv_cache_dtype, f"a {kv_cache_dtype} KV cache under a "
                                                              f"{str(model_dtype).removeprefix('torch.')} model (a "
                                                              "cache of another dtype than the model's)")
    return model_dtype


def text_config_of(hf_config: Any) -> Any:
    """The decoder's config: ``text_config`` of a multimodal checkpoint, else the config itself."""
    return getattr(hf_config, "text_config", None) or hf_config


def check_tensor_parallel(hf_config: Any, tp_size: int, expert_parallel: bool = False) -> None:
    """`ConfigError` unless the model's heads and MLPs (dense or experts) split evenly over ``tp_size`` ranks."""
    model_cls = _MODELS.get((getattr(hf_config, "architectures", None) or [""])[0])
    if hasattr(model_cls, "kv_cache_spec_of"):  # attention-free: its mixers are whole on every rank
        return
    hf_config = text_config_of(hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads  # encoders: one KV head per head
    problems = []
    if heads % tp_size:
        problems.append(f"num_attention_heads={heads}")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} (a multiple or a divisor of tp)")
    specs = [model_cls.moe_spec(hf_config, i) if getattr(model_cls, "is_moe", False) else None
             for i in range(hf_config.num_hidden_layers)]
    sizes = (getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "decoder_ffn_dim", None)
             or mlp_width(hf_config))  # Gemma 3n: one per layer; BLOOM, MPT: none named;
    # Whisper: its decoder's (the encoder is whole on every rank)
    if None in specs and any(size % tp_size for size in (sizes if isinstance(sizes, (list, tuple)) else [sizes])):
        problems.append(f"intermediate_size={sizes}")
    # distinct specs in layer order: a set of them (a str field) iterates by the interpreter's hash seed
    for spec in dict.fromkeys(spec for spec in specs if spec is not None):
        problems += [p for p in moe_parallel_problems(spec, tp_size, expert_parallel) if p not in problems]
    beside = getattr(model_cls, "dense_mlp_sizes", None)  # dense MLPs beside every layer's experts (LongCat-Flash)
    problems += [f"{name}={size}" for name, size in (beside(hf_config) if beside else {}).items() if size % tp_size]
    if problems:
        raise ConfigError("tensor_parallel_size", tp_size, "a size that divides the model's " + ", ".join(problems))


def kv_cache_spec(hf_config: Any, tp_size: int) -> KVCacheSpec:
    """Per-rank KV-cache shape; KV heads are replicated when there are fewer than ranks."""
    check_tensor_parallel(hf_config, tp_size)
    if serves_as_encoder((getattr(hf_config, "architectures", None) or [""])[0], hf_config):
        # an encoder keeps no KV; one small layer's worth backs the scheduler's block accounting
        return KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=head_dim_of(hf_config))
    model_cls = _MODELS.get((getattr(hf_config, "architectures", None) or [""])[0])
    if hasattr(model_cls, "kv_cache_spec_of"):  # attention-free models: a token-sized layer for the accounting
        return model_cls.kv_cache_spec_of(hf_config, tp_size)
    hf_config = text_config_of(hf_config)
    decoders = getattr(model_cls, "decoder_classes", None)  # an image-text model's decoder shapes its cache
    model_cls = decoders.get(hf_config.model_type, model_cls) if decoders else model_cls
    per_layer = getattr(model_cls, "kv_cache_shapes", None)  # (total kv heads, head_dim) per cache layer
    shapes = tuple((kv_heads_per_rank(heads, tp_size), dim) for heads, dim in per_layer(hf_config)) if per_layer else ()
    num_kv_heads, head_dim = kv_heads_per_rank(num_kv_heads_of(hf_config), tp_size), head_dim_of(hf_config)
    if len(set(shapes)) == 1:  # every layer alike (DeepSeek's latent: one 576-wide head)
        (num_kv_heads, head_dim), shapes = shapes[0], ()
    return KVCacheSpec(
        num_layers=getattr(model_cls, "kv_cache_layers", lambda c: c.num_hidden_layers)(hf_config),  # hybrids: fewer
        num_kv_heads=num_kv_heads, head_dim=head_dim, layer_shapes=shapes,
        kv_parts=getattr(model_cls, "kv_cache_parts", 2),
    )
