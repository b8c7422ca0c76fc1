"""Pipeline parallelism's torch-free half: the layer split and what is refused (docs/parallelism.md).

``pipeline_parallel_size=P`` splits the decoder layers over P stages of
``tensor_parallel_size=T`` ranks each (world = T x P; rank = pp_rank x T + tp_rank, as vLLM orders them).
`get_pp_indices` is vLLM's split; `check_pipeline_config` refuses at config time what is not built with
P > 1 (it needs no model), `check_pipeline_model` on the host what depends on the checkpoint (its
architecture, its layer count). The torch half: asyncllm/models/pipeline.py and workers/pipeline.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncllm import envs
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.deepseek_sparse_config import check_indexer_split
from asyncllm.spec.config import SPEC_FIELD

if TYPE_CHECKING:
    from asyncllm.config import EngineConfig

__all__ = ["PIPELINE_ARCHITECTURES", "check_pipeline_config", "check_pipeline_model",
           "get_pp_indices", "layer_partition", "output_rank"]

_FIELD = "pipeline_parallel_size"

PIPELINE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                          "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                          "Gemma3ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
                          "GptOssForCausalLM", "MiniCPM3ForCausalLM",
                          # the same decoder stack under the other families' layers
                          "GemmaForCausalLM", "Ernie4_5ForCausalLM", "Exaone4ForCausalLM", "GlmForCausalLM",
                          "Glm4ForCausalLM", "HeliumForCausalLM", "HunYuanDenseV1ForCausalLM", "SeedOssForCausalLM",
                          "SmolLM3ForCausalLM", "Starcoder2ForCausalLM", "Olmo3ForCausalLM", "MinistralForCausalLM",
                          "Ministral3ForCausalLM", "ArceeForCausalLM", "ApertusForCausalLM", "CwmForCausalLM",
                          "VaultGemmaForCausalLM", "NemotronForCausalLM", "OlmoForCausalLM", "Jais2ForCausalLM",
                          "StableLmForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM", "GPTJForCausalLM",
                          "FalconForCausalLM", "GraniteMoeForCausalLM", "OlmoeForCausalLM", "FlexOlmoForCausalLM",
                          "PhimoeForCausalLM", "DbrxForCausalLM", "Dots1ForCausalLM", "Glm4MoeForCausalLM",
                          "MiniMaxM2ForCausalLM",
                          "ExaoneMoeForCausalLM", "Ernie4_5_MoeForCausalLM", "HunYuanMoEV1ForCausalLM",
                          "SolarOpenForCausalLM", "SarvamMoEForCausalLM", "AfmoeForCausalLM", "Llama4ForCausalLM",
                          "DeepseekV2ForCausalLM",
                          "DeepseekV3ForCausalLM", "GraniteMoeSharedForCausalLM", "YoutuForCausalLM",
                          "Mistral4ForCausalLM", "Glm4MoeLiteForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
                          "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",  # their latent and indexer caches per stage
                          "Llama4ForConditionalGeneration",  # the vision model on the first stage
                          "GPT2LMHeadModel", "GPTBigCodeForCausalLM", "OPTForCausalLM",  # learned positions
                          "BloomForCausalLM", "MptForCausalLM",  # ALiBi
                          # hybrids: state layers beside attention (asyncllm/models/hybrid.py)
                          "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM",
                          "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "BambaForCausalLM", "JambaForCausalLM",
                          "NemotronHForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "KimiLinearForCausalLM",
                          "MiniMaxForCausalLM",
                          # decoders that run a stage themselves (``run_stage``: what crosses a boundary is theirs)
                          "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma3nForCausalLM",
                          "Gemma3nForConditionalGeneration", "Zamba2ForCausalLM", "MambaForCausalLM",
                          "FalconMambaForCausalLM", "Mamba2ForCausalLM",  # attention-free: the stream alone crosses
                          # image-text: the encoder on the first stage (asyncllm/models/vision_language.py)
                          "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                          "LlavaNextVideoForConditionalGeneration",
                          "LlavaOnevisionForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                          "Qwen2_5_VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                          "Qwen3_5MoeForConditionalGeneration", "Gemma3ForConditionalGeneration",
                          "Mistral3ForConditionalGeneration", "Idefics3ForConditionalGeneration",
                          "LightOnOcrForConditionalGeneration",
                          "SmolVLMForConditionalGeneration", "InternVLForConditionalGeneration",
                          "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                          "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
                          "Lfm2VlForConditionalGeneration", "PaliGemmaForConditionalGeneration",
                          "Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniForConditionalGeneration",
                          "AyaVisionForConditionalGeneration", "Cohere2VisionForConditionalGeneration",
                          "Qwen3OmniMoeThinkerForConditionalGeneration",
                          "Qwen3OmniMoeForConditionalGeneration",
                          "Ernie4_5_VLMoeForConditionalGeneration",  # its rows by modality on every stage
                          "PaddleOCRVLForConditionalGeneration", "HunYuanVLForConditionalGeneration",
                          "AriaForConditionalGeneration",  # its MoE decoder's layers as Qwen-MoE's
                          # audio-text: the audio encoder on the first stage
                          "Qwen2AudioForConditionalGeneration", "AudioFlamingo3ForConditionalGeneration",
                          "GlmAsrForConditionalGeneration", "Qwen3ASRForConditionalGeneration",
                          "VoxtralForConditionalGeneration",
                          "GraniteSpeechForConditionalGeneration")
"""The causal LMs on `LlamaForCausalLM`'s decoder stack (embeddings, layers passing (hidden, residual), final
norm, LM head; a hybrid's `HybridModel`; an image-text model's decoder; a decoder with its own ``run_stage``) that run
split into stages; each is tested against its unsplit model (tests/unit)."""


def layer_partition(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """Layers per stage. vLLM's rule: an even split, the remainder one each to the stages before the last,
    from the second-to-last backwards (the last also holds the final norm and LM head); or ``partition``,
    vLLM's ``VLLM_PP_LAYER_PARTITION`` format ("3,5": comma-separated counts, one per stage)."""
    if partition:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            raise ConfigError(envs.PP_LAYER_PARTITION.name, partition, "comma-separated layer counts") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ConfigError(envs.PP_LAYER_PARTITION.name, partition,
                              f"one positive layer count per stage ({_FIELD}={pp_size}) adding up to the model's "
                              f"{num_layers} layers")
        return counts
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return counts


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int, partition: str | None = None) -> tuple[int, int]:
    """Stage ``pp_rank``'s layers: ``[start, end)`` (`layer_partition`)."""
    counts = layer_partition(num_layers, pp_size, partition)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank whose step outputs the executor takes: the last stage's first TP rank (0 without stages)."""
    return (pp_size - 1) * tp_size


def check_pipeline_config(config: EngineConfig) -> None:
    """`NotBuiltError` naming a field whose feature is not built with ``pipeline_parallel_size > 1``."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return
    if config.speculative_config is not None:
        raise NotBuiltError(SPEC_FIELD, config.speculative_config,
                            f"speculative_config with pipeline_parallel_size={pp}")


def check_pipeline_model(config: EngineConfig, architecture: str, hf_config: Any) -> None:
    """The host's checks once the checkpoint is known: an architecture that runs in stages, no more stages than
    layers, a valid ASYNCLLM_PP_LAYER_PARTITION (with one stage too, as vLLM: unset or the model's layer count, where
    the config names one: a config without num_hidden_layers runs in one stage whatever it says).
    Pre-quantized checkpoints (fp8, AWQ / GPTQ, compressed-tensors, GGUF) all run in stages, each stage making,
    loading and finishing the quantized parameters of its own layers only
    (tests/unit/test_pipeline_parallel_quantized.py)."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        num_layers = getattr(hf_config, "num_hidden_layers", None)
        if envs.PP_LAYER_PARTITION.get() and num_layers is not None:  # never silently ignored where it can be checked
            layer_partition(num_layers, 1, envs.PP_LAYER_PARTITION.get())
        return
    if architecture not in PIPELINE_ARCHITECTURES:
        raise NotBuiltError(_FIELD, pp, f"pipeline parallelism for {architecture} (built for "
                                        f"{', '.join(PIPELINE_ARCHITECTURES)})")
    num_layers = hf_config.num_hidden_layers
    if pp > num_layers:
        raise ConfigError(_FIELD, pp, f"at most the model's num_hidden_layers ({num_layers}): "
                                      f"{pp} stages cannot split {num_layers} layers")
    counts = layer_partition(num_layers, pp, envs.PP_LAYER_PARTITION.get())
    if getattr(hf_config, "num_kv_shared_layers", 0):  # Gemma 4 / 3n: a layer reading another layer's KV cache
        from asyncllm.models.gemma4_config import check_kv_sharing_split

        check_kv_sharing_split(hf_config, counts)
    check_indexer_split(hf_config, counts)
