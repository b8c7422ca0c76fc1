"""The architectures asyncllm runs, by name: checked on the host before anything is spawned, without torch.

asyncllm/models/registry.py maps each name to its in-house class (torch);
this table only says which names exist and which take images, so that the
host refuses an unsupported checkpoint at once without importing torch.
"""

from __future__ import annotations

from typing import Any, Callable

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.rope_config import rope_scaled_length

__all__ = ["AUDIO_ARCHITECTURES", "HYBRID_ARCHITECTURES", "STATE_SPACE_ARCHITECTURES", "TEXT_ONLY_CAPABLE_ARCHITECTURES", "serves_text_only", "has_experts",
           "TEXT_ARCHITECTURES",
           "MOE_ARCHITECTURES", "MULTIMODAL_ARCHITECTURES",
           "ARCHITECTURE_ALIASES", "ENCODER_ARCHITECTURES", "EMBEDDING_ARCHITECTURES", "CLASSIFICATION_ARCHITECTURES",
           "REWARD_ARCHITECTURES", "TOKEN_CLASSIFICATION_ARCHITECTURES", "DECODER_CLASSIFIER_BASES", "HEADLESS_BASES",
           "LATE_INTERACTION_ARCHITECTURES", "base_architecture", "serves_as_encoder", "late_interaction_dim",
           "SUPPORTED_ARCHITECTURES", "architecture_of", "max_positions", "refuse_quantized_multimodal"]

TEXT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM",
                      "Gemma2ForCausalLM",
                      "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma4ForCausalLM",
                      "Gemma4ForConditionalGeneration", "Gemma3nForCausalLM", "Gemma3nForConditionalGeneration",
                      "Phi3ForCausalLM",
                      "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "SmolLM3ForCausalLM",
                      "Exaone4ForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
                      "Ernie4_5ForCausalLM", "SeedOssForCausalLM", "ArceeForCausalLM", "CohereForCausalLM",
                      "Cohere2ForCausalLM", "MinistralForCausalLM", "Ministral3ForCausalLM", "GraniteMoeForCausalLM",
                      "OlmoeForCausalLM", "Starcoder2ForCausalLM", "HunYuanDenseV1ForCausalLM", "GptOssForCausalLM",
                      "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "Mistral4ForCausalLM",
                      "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                      "Glm4MoeForCausalLM", "Qwen3_5ForCausalLM",
                      "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                      "Qwen3NextForCausalLM", "MiniMaxM2ForCausalLM", "GraniteMoeHybridForCausalLM",
                      "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "NemotronHForCausalLM", "BambaForCausalLM",
                      "FalconH1ForCausalLM", "JambaForCausalLM", "ApertusForCausalLM", "SolarOpenForCausalLM",
                      "SarvamMoEForCausalLM", "Ernie4_5_MoeForCausalLM",
                      "HunYuanMoEV1ForCausalLM", "Dots1ForCausalLM", "Llama4ForCausalLM",
                      "Llama4ForConditionalGeneration", "MambaForCausalLM", "FalconMambaForCausalLM",
                      "Mamba2ForCausalLM", "ExaoneMoeForCausalLM", "HeliumForCausalLM", "GraniteMoeSharedForCausalLM",
                      "FlexOlmoForCausalLM", "VaultGemmaForCausalLM", "PhiForCausalLM",
                      "StableLmForCausalLM", "NemotronForCausalLM", "GPTNeoXForCausalLM", "GPT2LMHeadModel",
                      "GPTBigCodeForCausalLM", "OPTForCausalLM", "GPTJForCausalLM", "FalconForCausalLM",
                      "OlmoForCausalLM", "Jais2ForCausalLM", "CwmForCausalLM", "YoutuForCausalLM",
                      "PhimoeForCausalLM", "MiniCPM3ForCausalLM", "DbrxForCausalLM", "Zamba2ForCausalLM",
                      "KimiLinearForCausalLM", "BloomForCausalLM", "MptForCausalLM", "MiniMaxForCausalLM",
                      "AfmoeForCausalLM", "LongcatFlashForCausalLM")
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM",
                        "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "NemotronHForCausalLM", "BambaForCausalLM",
                        "FalconH1ForCausalLM", "JambaForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM",
                        "Mamba2ForCausalLM", "Zamba2ForCausalLM", "KimiLinearForCausalLM",
                        "Lfm2VlForConditionalGeneration", "MiniMaxForCausalLM")
"""Models whose state layers keep per-request recurrent states (asyncllm/models/row_states.py): prefix caching from
saved states, no swap preemption, speculative decoding with a snapshot per draft (docs/hybrid-models.md)."""
STATE_SPACE_ARCHITECTURES = ("MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM")
"""The hybrids without attention: state layers only."""
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                     "Qwen3VLMoeForConditionalGeneration", "GraniteMoeForCausalLM", "OlmoeForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "Mistral4ForCausalLM",
                     "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                     "Glm4MoeForCausalLM",
                     "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM",
                     "MiniMaxM2ForCausalLM", "GraniteMoeHybridForCausalLM", "Ernie4_5_MoeForCausalLM",
                     "HunYuanMoEV1ForCausalLM", "Dots1ForCausalLM", "Llama4ForCausalLM",
                     "Llama4ForConditionalGeneration", "NemotronHForCausalLM", "Lfm2MoeForCausalLM",
                     "JambaForCausalLM", "SolarOpenForCausalLM", "SarvamMoEForCausalLM", "Gemma4ForCausalLM",
                     "Gemma4ForConditionalGeneration", "ExaoneMoeForCausalLM", "GraniteMoeSharedForCausalLM",
                     "FlexOlmoForCausalLM", "PhimoeForCausalLM", "DbrxForCausalLM",
                     "Glm4vMoeForConditionalGeneration", "KimiLinearForCausalLM", "MiniMaxForCausalLM",
                     "Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration",
                     "AriaForConditionalGeneration",
                     "Ernie4_5_VLMoeForConditionalGeneration", "AfmoeForCausalLM",
                     "LongcatFlashForCausalLM")
"""Mixture-of-experts text models (asyncllm/models/moe.py): the ones ``enable_expert_parallel`` applies to."""
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                            "LlavaNextVideoForConditionalGeneration", "LlavaOnevisionForConditionalGeneration",
                            "Idefics3ForConditionalGeneration",
                            "SmolVLMForConditionalGeneration",
                            "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                            "Qwen3VLMoeForConditionalGeneration", "Mistral3ForConditionalGeneration",
                            "LightOnOcrForConditionalGeneration",
                            "InternVLForConditionalGeneration", "Gemma3ForConditionalGeneration",
                            "PaliGemmaForConditionalGeneration", "Gemma3nForConditionalGeneration",
                            "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                            "Gemma4ForConditionalGeneration", "Qwen2AudioForConditionalGeneration",
                            "AudioFlamingo3ForConditionalGeneration", "Glm4vForConditionalGeneration",
                            "Glm4vMoeForConditionalGeneration", "AyaVisionForConditionalGeneration",
                            "Cohere2VisionForConditionalGeneration",
                            "Lfm2VlForConditionalGeneration", "WhisperForConditionalGeneration",
                            "GlmAsrForConditionalGeneration", "Qwen3ASRForConditionalGeneration",
                            "VoxtralForConditionalGeneration",
                            "GraniteSpeechForConditionalGeneration",
                            "Llama4ForConditionalGeneration", "Qwen2_5OmniThinkerForConditionalGeneration",
                            "Qwen2_5OmniForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration",
                            "Qwen3OmniMoeForConditionalGeneration", "Ernie4_5_VLMoeForConditionalGeneration",
                            "MllamaForConditionalGeneration", "Phi4MultimodalForCausalLM",
                            "PaddleOCRVLForConditionalGeneration", "HunYuanVLForConditionalGeneration",
                            "AriaForConditionalGeneration", "CLIPModel", "SiglipModel")
"""Architectures that take images or audio (their host processes them: asyncllm/mm/); the Qwen-VL ones place their tokens
by M-RoPE (asyncllm/models/mrope.py) and take videos too (GLM-4.1V: M-RoPE, images only), as LLaVA-NeXT-Video does."""
AUDIO_ARCHITECTURES = ("Qwen2AudioForConditionalGeneration", "AudioFlamingo3ForConditionalGeneration",
                       "WhisperForConditionalGeneration", "GlmAsrForConditionalGeneration",
                       "VoxtralForConditionalGeneration",
                       "Qwen3ASRForConditionalGeneration", "GraniteSpeechForConditionalGeneration",
                       "Gemma3nForConditionalGeneration")
"""Of those, the ones that take audio (and no images: docs/multimodal.md#audio; Whisper, an encoder-decoder:
docs/multimodal.md#whisper; Gemma 3n, whose vision tower is not built: docs/multimodal.md#gemma-3n)."""
TEXT_ONLY_CAPABLE_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                                   "Qwen3_5MoeForConditionalGeneration", "Gemma4ForConditionalGeneration",
                                   "Mistral3ForConditionalGeneration", "Llama4ForConditionalGeneration",
                                   "Gemma3nForConditionalGeneration")
"""Image-text (Gemma 3n: audio-text) architectures that can serve text alone, their towers unread (vLLM's
language-model-only mode: ``limit_mm_per_prompt`` of 0 images and 0 videos; asyncllm/models/registry.py names the
classes)."""


def has_experts(hf_config: Any, arch: str) -> bool:
    """Whether the checkpoint's model has experts: an MoE architecture's (a classifier's: its decoder's), but a
    Gemma 4 decoder's only with ``enable_moe_block`` (its dense sizes share the architecture name)."""
    arch = base_architecture(arch)
    if arch.startswith("Gemma4"):
        return bool(getattr(getattr(hf_config, "text_config", None) or hf_config, "enable_moe_block", False))
    return arch in MOE_ARCHITECTURES


def base_architecture(arch: str) -> str:
    """The causal LM whose decoder `arch` runs (a decoder classifier's, a bare decoder's: `DECODER_CLASSIFIER_BASES`,
    `HEADLESS_BASES`), else `arch`."""
    return DECODER_CLASSIFIER_BASES.get(arch) or HEADLESS_BASES.get(arch, arch)


def serves_text_only(arch: str, limits: dict[str, int] | None) -> bool:
    """Whether ``arch`` runs as its text-only class under these ``limit_mm_per_prompt``."""
    return arch in TEXT_ONLY_CAPABLE_ARCHITECTURES and limits is not None and not any(limits.values())


LATE_INTERACTION_ARCHITECTURES = ("HF_ColBERT",)
"""Late-interaction (ColBERT) encoders (asyncllm/models/colbert.py): every token's final hidden state through a
bias-free projection; they serve ``token_embed`` only, and scores by MaxSim of two texts' token embeddings
(docs/pooling.md#late-interaction-models-colbert)."""
ENCODER_EMBEDDING_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel", "ModernBertModel", "NomicBertModel",
                                   "GteModel", "GteNewModel",  # vLLM's name for Alibaba's "new" checkpoints
                                   "RobertaForMaskedLM",  # vLLM embeds with its encoder, the LM head unread
                                   *LATE_INTERACTION_ARCHITECTURES)


def late_interaction_dim(hf_config: Any) -> int:
    """A ColBERT checkpoint's projection width: config ``colbert_dim``, ``dim`` or ``projection_dim`` (the first
    set, as vLLM reads them); a `ConfigError` naming them when none is (vLLM's hint: ``hf_overrides``)."""
    for name in ("colbert_dim", "dim", "projection_dim"):
        if getattr(hf_config, name, None):
            return int(getattr(hf_config, name))
    raise ConfigError("model", getattr(hf_config, "name_or_path", None) or "HF_ColBERT",
                      "a ColBERT checkpoint whose config.json gives its dimension (colbert_dim, dim or projection_dim): "
                      "it gives none; hf_overrides={'dim': 128} sets one")
ENCODER_CLASSIFIER_ARCHITECTURES = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                                    "XLMRobertaForSequenceClassification", "ModernBertForSequenceClassification",
                                    "GteForSequenceClassification", "GteNewForSequenceClassification")
TOKEN_CLASSIFICATION_ARCHITECTURES = ("BertForTokenClassification", "ModernBertForTokenClassification")
"""Encoder token classifiers (NER and other taggers): a ``classifier`` on every token's final hidden state; they
serve ``token_classify`` only (docs/pooling.md, "Token classifiers")."""
ENCODER_ARCHITECTURES = (ENCODER_EMBEDDING_ARCHITECTURES + ENCODER_CLASSIFIER_ARCHITECTURES
                         + TOKEN_CLASSIFICATION_ARCHITECTURES)
"""Bidirectional encoders (asyncllm/models/bert.py, modernbert.py): sentence-embedding models (bge, e5, gte,
all-MiniLM, multilingual-e5, gte-modernbert), cross-encoders (bge-reranker, ms-marco MiniLM,
gte-reranker-modernbert) and token classifiers; each prompt computed whole in one step, no chunked prefill, no
prefix caching (docs/embeddings.md, docs/pooling.md). EmbeddingGemma is one by its config: `serves_as_encoder`."""


def serves_as_encoder(arch: str, hf_config: Any) -> bool:
    """Whether a checkpoint of ``arch`` runs as a bidirectional encoder: an `ENCODER_ARCHITECTURES` one, or
    EmbeddingGemma (``Gemma3TextModel`` whose config sets ``use_bidirectional_attention``:
    asyncllm/models/embedding_gemma.py); a causal ``Gemma3TextModel`` is a bare decoder (`HEADLESS_BASES`)."""
    return arch in ENCODER_ARCHITECTURES or (
        arch == "Gemma3TextModel" and bool(getattr(hf_config, "use_bidirectional_attention", False)))


HEADLESS_BASES = {
    **{f"{family}Model": f"{family}ForCausalLM" for family in (
        "Afmoe", "Apertus", "Arcee", "Bamba", "Bloom", "Cohere", "Cohere2", "Cwm", "Dbrx", "DeepseekV2",
        "DeepseekV3", "DeepseekV32", "Dots1", "Ernie4_5", "Ernie4_5_Moe", "Exaone4", "ExaoneMoe", "Falcon",
        "FalconH1", "FlexOlmo", "Gemma", "Gemma2", "Glm", "Glm4", "Glm4Moe", "Glm4MoeLite", "GlmMoeDsa",
        "GPTBigCode", "GPTJ", "GPTNeoX", "GptOss", "Granite", "GraniteMoe", "GraniteMoeHybrid", "GraniteMoeShared",
        "Helium", "HunYuanDenseV1", "HunYuanMoEV1", "Jais2", "Jamba", "KimiLinear", "Lfm2", "Lfm2Moe", "Llama",
        "LongcatFlash", "MiniCPM3", "MiniMax", "MiniMaxM2", "Ministral", "Ministral3", "Mistral", "Mistral4",
        "Mixtral", "Mpt", "Nemotron", "NemotronH", "Olmo", "Olmo2", "Olmo3", "Olmoe", "OPT", "Phi", "Phi3", "Phimoe",
        "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe", "Qwen3Next", "SeedOss", "SmolLM3", "SolarOpen", "StableLm",
        "Starcoder2", "VaultGemma", "Youtu", "Zamba2")},
    "GPT2Model": "GPT2LMHeadModel",
    "Gemma3TextModel": "Gemma3ForCausalLM",  # with use_bidirectional_attention: EmbeddingGemma (serves_as_encoder)
    "Gemma3nTextModel": "Gemma3nForCausalLM",
    "Gemma4TextModel": "Gemma4ForCausalLM",
    "Llama4TextModel": "Llama4ForCausalLM",
    "Qwen3_5MoeTextModel": "Qwen3_5MoeForCausalLM",
    "Qwen3_5TextModel": "Qwen3_5ForCausalLM",
}
"""A bare decoder's checkpoint (what transformers' ``AutoModel`` saves: no LM head, names without the causal LM's
prefix) -> the causal LM whose decoder it is; served as an embedding model (vLLM resolves an unregistered ``*Model``
to its family's model the same way: as_embedding_model). docs/embeddings.md."""
DUAL_ENCODER_ARCHITECTURES = ("CLIPModel", "SiglipModel")
"""Text-or-image embedding models (asyncllm/models/clip_embedding.py, siglip_embedding.py): a prompt's text or its
one image as a point of the shared space (docs/embeddings.md#clip-and-siglip-text-or-image-embeddings)."""
EMBEDDING_ARCHITECTURES = (*HEADLESS_BASES, *ENCODER_EMBEDDING_ARCHITECTURES, *DUAL_ENCODER_ARCHITECTURES)
"""Models without an LM head, which serve embeddings only (docs/embeddings.md): bare decoders (what ``AutoModel``
saves: embedding models such as e5-mistral) and the encoders."""
DECODER_CLASSIFIER_BASES = {
    **{f"{family}ForSequenceClassification": f"{family}ForCausalLM" for family in (
        "Arcee", "Bloom", "DeepseekV2", "DeepseekV3", "Exaone4", "Falcon", "Gemma", "Gemma2", "Glm", "Glm4",
        "GPTBigCode", "GPTJ", "GPTNeoX", "GptOss", "Helium", "HunYuanDenseV1", "HunYuanMoEV1", "Jamba", "Llama",
        "MiniCPM3", "MiniMax", "Ministral", "Ministral3", "Mistral", "Mistral4", "Mixtral", "Mpt", "Nemotron", "Olmo",
        "Olmo2", "Olmo3", "OPT", "Phi", "Phi3", "Phimoe", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe", "Qwen3Next",
        "SeedOss", "SmolLM3", "StableLm", "Starcoder2", "Zamba2")},
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
    "Qwen3_5TextForSequenceClassification": "Qwen3_5ForCausalLM",
    "GPT2ForSequenceClassification": "GPT2LMHeadModel",
}
"""transformers' ``*ForSequenceClassification`` of a decoder family (every one transformers has for a family here)
-> the causal LM whose decoder it is, under a ``score`` head on the last token: vLLM resolves such an architecture
to its family's model the same way (as_seq_cls_model). docs/pooling.md#classification-models."""
CLASSIFICATION_ARCHITECTURES = (*DECODER_CLASSIFIER_BASES, *ENCODER_CLASSIFIER_ARCHITECTURES,
                                *TOKEN_CLASSIFICATION_ARCHITECTURES)
"""Models with a classification head: decoders with a ``score`` head over the last token and encoders with theirs
(classifiers, reward models, cross-encoders) serve classification and scores (and ``token_classify``); the token
classifiers ``token_classify`` only (docs/pooling.md)."""
REWARD_ARCHITECTURES = ("Qwen2ForRewardModel", "Qwen2ForProcessRewardModel")
"""Reward models with their own head on every prompt row (asyncllm/models/reward.py): they serve ``token_classify``
only, vLLM's ALL (the reward model) and STEP (the process reward model) pooling (docs/pooling.md#reward-models)."""
SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys(TEXT_ARCHITECTURES + MULTIMODAL_ARCHITECTURES + EMBEDDING_ARCHITECTURES
                                             + CLASSIFICATION_ARCHITECTURES + REWARD_ARCHITECTURES))


ARCHITECTURE_ALIASES = {
    "LightOnOCRForConditionalGeneration": "LightOnOcrForConditionalGeneration",
    "ExaoneMoEForCausalLM": "ExaoneMoeForCausalLM",
    "PhiMoEForCausalLM": "PhimoeForCausalLM",
    "MPTForCausalLM": "MptForCausalLM",
    "LLaMAForCausalLM": "LlamaForCausalLM",
}
"""Other spellings of a supported architecture -> ours, each one vLLM registers for the same model and checkpoints
write (with a config transformers loads: the same ``model_type``): LightOnOCR's first release, EXAONE-MoE's
checkpoints, Phi-3.5-MoE's and MPT's older configs, decapoda-research's LLaMA; transformers 5 names the second."""


def architecture_of(hf_config: Any) -> str:
    """``hf_config.architectures[0]`` when asyncllm runs it; `NotBuiltError` naming the supported ones otherwise, a
    `ConfigError` when config.json lists none (vLLM's "No model architectures are specified"). An alias
    (`ARCHITECTURE_ALIASES`) is rewritten to our name in ``hf_config.architectures`` itself, so that every later
    lookup of the config (the registry's, the workers' reading the host's config) sees one name."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ConfigError("model", getattr(hf_config, "name_or_path", None) or None,
                          "a checkpoint whose config.json lists its architectures: it lists none (no model "
                          "architectures are specified; hf_overrides={'architectures': [...]} can name one)")
    if not isinstance(architectures, (list, tuple)):  # a string's [0] would be its first letter
        raise ConfigError("model", getattr(hf_config, "name_or_path", None) or None,
                          f"a checkpoint whose config.json lists its architectures (a list of names, as "
                          f"[\"LlamaForCausalLM\"]): it gives {architectures!r}")
    arch = ARCHITECTURE_ALIASES.get(architectures[0], architectures[0])
    if arch != architectures[0]:
        hf_config.architectures = [arch, *architectures[1:]]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotBuiltError("model", getattr(hf_config, "name_or_path", None) or arch,  # the folder given
                            f"the {arch} architecture (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def max_positions(hf_config: Any) -> int | None:
    """The longest prompt + output the model's positions serve: ``max_position_embeddings`` (Whisper's decoder:
    ``max_target_positions``), less RoBERTa's and XLM-R's ``pad_token_id + 1`` (their positions start after it;
    514 -> 512), times a rope scaling's factor (`rope_scaled_length`: vLLM's derivation)."""
    limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "max_target_positions", None)
    if limit is None and getattr(hf_config, "model_type", "") == "mpt":  # MPT's name for it (BLOOM's ALiBi: none)
        limit = hf_config.max_seq_len
    if limit is not None and getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta"):
        limit -= int(hf_config.pad_token_id) + 1
    return None if limit is None else rope_scaled_length(hf_config, limit)


QUANTIZED_DECODER_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                   "Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration")
"""Multimodal models served from pre-quantized checkpoints (fp8, AWQ, GPTQ, compressed-tensors) that quantized the
decoder only: the vision tower left whole, as AutoAWQ, GPTQModel and llm-compressor's recipes leave it."""
_TOWER_LAYERS = ("visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.qkv")
"""A vision-tower layer's checkpoint name in either layout: the tower counts as left whole when the checkpoint
ignores it."""


def refuse_quantized_multimodal(arch: str, model: str, method: str, is_ignored: Callable[[str], bool]) -> None:
    """`NotBuiltError` for a pre-quantized multimodal checkpoint, unless its architecture serves a quantized decoder
    and ``is_ignored`` (the checkpoint's rule) leaves the vision tower whole."""
    if arch not in MULTIMODAL_ARCHITECTURES:
        return
    if arch not in QUANTIZED_DECODER_ARCHITECTURES:
        raise NotBuiltError("model", model, f"a pre-quantized {method} {arch} checkpoint (text models and "
                                            "the Qwen-VL decoders only)")
    if not any(is_ignored(name) for name in _TOWER_LAYERS):
        raise NotBuiltError("model", model, f"a pre-quantized {method} {arch} checkpoint with a quantized vision "
                                            "tower (its quantization_config does not leave 'visual' out)")
