"""The architectures asyncllm runs, by name: checked on the host before anything is spawned, without torch.

asyncllm/models/registry.py maps each name to its in-house class (torch);
this table only says which names exist and which take images, so that the
host refuses an unsupported checkpoint at once without importing torch.
"""

from __future__ import annotations

from typing import Any

from asyncllm.errors import NotBuiltError

__all__ = ["TEXT_ARCHITECTURES", "MOE_ARCHITECTURES", "GEMMA_ARCHITECTURES", "PHI3_ARCHITECTURES",
           "MULTIMODAL_ARCHITECTURES", "EMBEDDING_ARCHITECTURES", "CLASSIFICATION_ARCHITECTURES",
           "SUPPORTED_ARCHITECTURES", "architecture_of"]

TEXT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                      "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Phi3ForCausalLM",
                      "GraniteForCausalLM", "Olmo2ForCausalLM", "GptOssForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
"""Gemma decoders (asyncllm/models/gemma.py); Gemma 3's image-text checkpoints are served as text only, without
LoRA adapters (docs/gemma.md)."""
PHI3_ARCHITECTURES = ("Phi3ForCausalLM",)
"""Phi-3, Phi-3.5, Phi-4, Phi-4-mini (asyncllm/models/phi3.py): fused checkpoints and adapters (docs/phi3.md)."""
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")
"""Mixture-of-experts text models (asyncllm/models/moe.py): the ones ``enable_expert_parallel`` applies to."""
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)
"""Architectures that take images (their host processes them: asyncllm/mm/)."""
EMBEDDING_ARCHITECTURES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
"""Bare decoders without an LM head (what ``AutoModel`` saves: embedding models such as e5-mistral):
they serve embeddings only (docs/embeddings.md)."""
CLASSIFICATION_ARCHITECTURES = ("LlamaForSequenceClassification", "MistralForSequenceClassification",
                                "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")
"""Decoders with a ``score`` head over the last token (classifiers, reward models, cross-encoders): they serve
classification and scores only (docs/pooling.md)."""
SUPPORTED_ARCHITECTURES = (TEXT_ARCHITECTURES + MULTIMODAL_ARCHITECTURES + EMBEDDING_ARCHITECTURES
                           + CLASSIFICATION_ARCHITECTURES)


def architecture_of(hf_config: Any) -> str:
    """``hf_config.architectures[0]`` when asyncllm runs it; `NotBuiltError` naming the supported ones otherwise."""
    architectures = getattr(hf_config, "architectures", None) or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotBuiltError("model", arch, f"the {arch} architecture (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch
