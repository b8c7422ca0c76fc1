"""Which in-house class runs which HF architecture, and what its KV cache looks like."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError
from asyncllm.models.architectures import (
    ENCODER_ARCHITECTURES, SUPPORTED_ARCHITECTURES, TEXT_ONLY_CAPABLE_ARCHITECTURES, architecture_of, serves_text_only,
)
from asyncllm.models.bert import BertEmbeddingModel, BertForSequenceClassification
from asyncllm.models.classifier import sequence_classifier
from asyncllm.models.gemma import Gemma1ForCausalLM
from asyncllm.models.gemma2 import Gemma2ForCausalLM, VaultGemmaForCausalLM
from asyncllm.models.gemma3 import Gemma3ForCausalLM, Gemma3TextOnly
from asyncllm.models.gemma3_mm import Gemma3ForConditionalGeneration
from asyncllm.models.gemma4 import Gemma4ForCausalLM, Gemma4TextOnly
from asyncllm.models.gemma4_mm import Gemma4ForConditionalGeneration
from asyncllm.models.mamba import FalconMambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM
from asyncllm.models.exaone_moe import ExaoneMoeForCausalLM
from asyncllm.models.helium import HeliumForCausalLM
from asyncllm.models.gpt_neox import GPTNeoXForCausalLM
from asyncllm.models.gpt2 import GPT2LMHeadModel, GPTBigCodeForCausalLM
from asyncllm.models.gptj import GPTJForCausalLM
from asyncllm.models.falcon import FalconForCausalLM
from asyncllm.models.jais2 import Jais2ForCausalLM
from asyncllm.models.olmo import OlmoForCausalLM
from asyncllm.models.phimoe import PhimoeForCausalLM
from asyncllm.models.opt import OPTForCausalLM
from asyncllm.models.nemotron import NemotronForCausalLM
from asyncllm.models.phi import PhiForCausalLM
from asyncllm.models.stablelm import StableLmForCausalLM
from asyncllm.models.granite import GraniteForCausalLM
from asyncllm.models.gpt_oss import GptOssForCausalLM
from asyncllm.models.layers import LoadedWeight, TensorParallel, head_dim_of, kv_heads_per_rank, num_kv_heads_of
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.llava import LlavaForConditionalGeneration
from asyncllm.models.idefics3 import Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration
from asyncllm.models.llava_next import LlavaNextForConditionalGeneration
from asyncllm.models.llava_onevision import LlavaOnevisionForConditionalGeneration
from asyncllm.models.mistral3 import (Mistral3ForConditionalGeneration, PixtralLlavaForConditionalGeneration,
                                      mistral3_text_only)
from asyncllm.models.internvl import InternVLForConditionalGeneration
from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration
from asyncllm.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from asyncllm.models.mixtral import MixtralForCausalLM
from asyncllm.models.modernbert import ModernBertEmbeddingModel, ModernBertForSequenceClassification
from asyncllm.models.embedding_gemma import EmbeddingGemmaModel
from asyncllm.models.moe import moe_parallel_problems
from asyncllm.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
from asyncllm.models.smollm3 import SmolLM3ForCausalLM
from asyncllm.models.exaone4 import Exaone4ForCausalLM
from asyncllm.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from asyncllm.models.ernie_seed_arcee import (
    ArceeForCausalLM, Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM, SeedOssForCausalLM,
)
from asyncllm.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from asyncllm.models.ministral3 import Ministral3ForCausalLM
from asyncllm.models.granitemoe import GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM
from asyncllm.models.olmoe import FlexOlmoForCausalLM, OlmoeForCausalLM
from asyncllm.models.starcoder2 import Starcoder2ForCausalLM
from asyncllm.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from asyncllm.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    Glm4MoeLiteForCausalLM,
    Mistral4ForCausalLM,
    YoutuForCausalLM,
)
from asyncllm.models.glm4_moe import Glm4MoeForCausalLM
from asyncllm.models.dots1 import Dots1ForCausalLM
from asyncllm.models.llama4 import Llama4ForCausalLM, Llama4TextOnly
from asyncllm.models.qwen3_5 import (
    Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextOnly, Qwen3_5TextOnly,
)
from asyncllm.models.qwen3_next import Qwen3NextForCausalLM
from asyncllm.models.minimax_m2 import MiniMaxM2ForCausalLM
from asyncllm.models.granite4 import GraniteMoeHybridForCausalLM
from asyncllm.models.apertus import ApertusForCausalLM
from asyncllm.models.falcon_h1 import FalconH1ForCausalLM
from asyncllm.models.glm4_moe import SolarOpenForCausalLM
from asyncllm.models.jamba import JambaForCausalLM
from asyncllm.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from asyncllm.models.nemotron_h import NemotronHForCausalLM
from asyncllm.models.bamba import BambaForCausalLM
from asyncllm.models.phi3 import Phi3ForCausalLM
from asyncllm.models.qwen2 import Qwen2ForCausalLM
from asyncllm.models.qwen2_moe import Qwen2MoeForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.qwen3_moe import Qwen3MoeForCausalLM

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


def headless(cls: type) -> type:
    """`cls` for a bare decoder's checkpoint (``LlamaModel`` & co.): no LM head to load (embeddings only)."""
    return type(cls.__name__ + "Headless", (cls,), {"has_lm_head": False})


_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GemmaForCausalLM": Gemma1ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # limit_mm_per_prompt image 0: Gemma3TextOnly
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,  # limit_mm_per_prompt image 0: Gemma4TextOnly
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "MinistralForCausalLM": LlamaForCausalLM,  # Mistral's layers; sliding windows per layer_types
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "SmolVLMForConditionalGeneration": SmolVLMForConditionalGeneration,
    "LlavaOnevisionForConditionalGeneration": LlavaOnevisionForConditionalGeneration,
    "Mistral3ForConditionalGeneration": Mistral3ForConditionalGeneration,
    "InternVLForConditionalGeneration": InternVLForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "Mistral4ForCausalLM": Mistral4ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "Llama4ForConditionalGeneration": Llama4TextOnly,  # text prompts only: the vision model is not read
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,  # limit_mm_per_prompt 0: Qwen3_5TextOnly
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "SolarOpenForCausalLM": SolarOpenForCausalLM,
    "SarvamMoEForCausalLM": Glm4MoeForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "MambaForCausalLM": MambaForCausalLM,
    "ExaoneMoeForCausalLM": ExaoneMoeForCausalLM,
    "HeliumForCausalLM": HeliumForCausalLM,
    "VaultGemmaForCausalLM": VaultGemmaForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    "FlexOlmoForCausalLM": FlexOlmoForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "NemotronForCausalLM": NemotronForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPTJForCausalLM": GPTJForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "Jais2ForCausalLM": Jais2ForCausalLM,
    "YoutuForCausalLM": YoutuForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "CwmForCausalLM": LlamaForCausalLM,  # Llama's layers, a window in the layers layer_types names
    "FalconMambaForCausalLM": FalconMambaForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "ApertusForCausalLM": ApertusForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunYuanMoEV1ForCausalLM,
    "LlamaModel": headless(LlamaForCausalLM),
    "MistralModel": headless(LlamaForCausalLM),
    "Qwen2Model": headless(Qwen2ForCausalLM),
    "Qwen3Model": headless(Qwen3ForCausalLM),
    "BertModel": BertEmbeddingModel,
    "RobertaModel": BertEmbeddingModel,
    "XLMRobertaModel": BertEmbeddingModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": BertForSequenceClassification,
    "ModernBertModel": ModernBertEmbeddingModel,
    "Gemma3TextModel": EmbeddingGemmaModel,
    "ModernBertForSequenceClassification": ModernBertForSequenceClassification,
    "LlamaForSequenceClassification": sequence_classifier(LlamaForCausalLM),
    "MistralForSequenceClassification": sequence_classifier(LlamaForCausalLM),
    "Qwen2ForSequenceClassification": sequence_classifier(Qwen2ForCausalLM),
    "Qwen3ForSequenceClassification": sequence_classifier(Qwen3ForCausalLM),
}
assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES), "asyncllm/models/architectures.py names every class here"


_TEXT_ONLY: dict[str, Any] = {"Gemma3ForConditionalGeneration": Gemma3TextOnly,
                              "Gemma4ForConditionalGeneration": Gemma4TextOnly,
                              "Qwen3_5ForConditionalGeneration": Qwen3_5TextOnly,
                              "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeTextOnly,
                              "Mistral3ForConditionalGeneration": mistral3_text_only}
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
    vision = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
    return PixtralLlavaForConditionalGeneration if vision == "pixtral" else LlavaForConditionalGeneration


_VARIANTS: dict[str, Any] = {"LlavaForConditionalGeneration": _llava_variant}
"""Architectures whose class depends on more of the config than its name."""


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
    """The KV cache's element type: ``model_dtype`` for ``auto``, else the fp8 type named."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_KV_CACHE_DTYPES[kv_cache_dtype]


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
    if None in specs and hf_config.intermediate_size % tp_size:
        problems.append(f"intermediate_size={hf_config.intermediate_size}")
    for spec in set(specs) - {None}:
        problems += [p for p in moe_parallel_problems(spec, tp_size, expert_parallel) if p not in problems]
    if problems:
        raise ConfigError("tensor_parallel_size", tp_size, "a size that divides the model's " + ", ".join(problems))


def kv_cache_spec(hf_config: Any, tp_size: int) -> KVCacheSpec:
    """Per-rank KV-cache shape; KV heads are replicated when there are fewer than ranks."""
    check_tensor_parallel(hf_config, tp_size)
    if (getattr(hf_config, "architectures", None) or [""])[0] in ENCODER_ARCHITECTURES:
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
