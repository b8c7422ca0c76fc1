"""Host-side preparation before the core starts: find the model, load the tokenizer.

Runs in a worker thread (file and hub I/O, the imports of transformers), never
on the event loop. It needs no model class (a multimodal model's image
processing aside): the host is the user's app process, the workers run the model.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from asyncllm.config import EngineConfig
from asyncllm.config_checks import check_heads_split
from asyncllm.config_model import AUTO_MAX_MODEL_LEN
from asyncllm.engine.defaults import default_sampling_fields
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.generation_config import SuppressedTokens, read_generation_config, sampling_fields_of, source_of
from asyncllm.lora import kept_lora_ids
from asyncllm.mistral_tokenizer import encodes_media, is_mistral
from asyncllm.models.mistral_format import mistral_files, uses_mistral_weights
from asyncllm.lora_checker import AdapterChecker
from asyncllm.lora_experts import ExpertLayer
from asyncllm.engine.pooling_model import Matryoshka, PoolingModel, pooling_model_of, sentence_transformers_config
from asyncllm.engine.classifier_tokens import classifier_from_tokens
from asyncllm.engine.runner import resolve_runner
from asyncllm.models.architectures import (
    AUDIO_ARCHITECTURES,
    DUAL_ENCODER_ARCHITECTURES,
    ENCODER_ARCHITECTURES,
    HYBRID_ARCHITECTURES,
    LATE_INTERACTION_ARCHITECTURES,
    MOE_ARCHITECTURES,
    MULTIMODAL_ARCHITECTURES,
    REWARD_ARCHITECTURES,
    architecture_of, base_architecture,
    max_positions,
    serves_as_encoder,
    serves_text_only,
)
from asyncllm.models.checkpoint import (
    hf_config_json,
    prequantized_config,
    resolve_kv_cache_dtype,
    resolve_model_path,
    served_hf_config,
)
from asyncllm.models.rope_config import longrope_original
from asyncllm.pipeline_parallel import check_pipeline_model
from asyncllm.models.st_dense import embedding_width
from asyncllm.spec.draft_model import prepare_draft_model
from asyncllm.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger("asyncllm.engine")

_IMPORT_LOCK = threading.Lock()
"""Held around the import of the transformers names preparation uses (`import_transformers`), never around a download
or a load."""


@dataclass
class Prepared:
    config: EngineConfig
    """`model` is now a local folder and `max_model_len` is set."""
    tokenizer: Any
    eos_token_ids: list[int]
    vocab_size: int
    mm: Any = None
    """The `MultiModalProcessor` of a multimodal model (asyncllm/mm/), else None."""
    hf_config_json: str | None = None
    """The checkpoint's config, defaults filled in, for the workers (read once, here)."""
    lora: AdapterChecker | None = None
    """Checks requests' LoRA adapters against the model (enable_lora only)."""
    hidden_size: int = 0
    """The model's embedding width, after any sentence-transformers Dense modules (`PoolingParams.dimensions` may not
    exceed it)."""
    default_sampling: dict[str, Any] = field(default_factory=dict)
    """SamplingParams fields from the model's generation config (asyncllm/engine/defaults.py)."""
    generation_config: dict[str, Any] = field(default_factory=dict)
    """The keys of the generation_config.json the ``generation_config`` field names (asyncllm/generation_config.py:
    read once, here; the model folder's for ``vllm`` too, whose sampling defaults alone are dropped; a folder without
    one: its config.json's generation attributes)."""
    pooling_model: PoolingModel | None = None
    """Which requests the model takes (bare decoders embed only, classifiers classify only) and a classifier's
    labels (asyncllm/engine/pooling_model.py)."""
    embeds_width: int | None = None
    """The rows' width of a prompt given as embeddings (the model's hidden size); None: not enabled."""
    suppressed_tokens: SuppressedTokens = field(default_factory=SuppressedTokens)
    """`generation_config`'s suppressed ids (beam search leaves them out as the workers' rules do), read here so
    that a malformed list is refused before the workers start."""


def prepare(config: EngineConfig, resolved: bool = False, decodes_images: bool = True) -> Prepared:
    """What the host needs before the core starts (on a worker thread; engines starting at once prepare in parallel,
    their transformers names imported first, one thread at a time). ``resolved``: `config` is one prepared before
    (a restart's, or the shared core's an attached host takes), its model and tokenizer the local folders its hub ids
    and revisions resolved to, so its revisions are not checked against those folders. ``decodes_images`` False: a
    standalone core's preparation (asyncllm/engine/standalone.py), which decodes no image, so ``mm_max_image_pixels``
    is not compared with its PIL's limit (each attached host compares it with its own)."""
    import_transformers()
    if not resolved:
        _check_local_revisions(config)
    return _prepare(config, decodes_images)


def import_transformers(multimodal: bool = False) -> None:
    """Import the names of transformers' lazy namespace that preparation reaches, one thread at a time: its lazy
    imports are not thread-safe (two engines starting at once got "cannot import name 'AutoConfig' from
    'transformers'"). Once imported they are plain attributes, so the next import is cheap and the loads that
    follow run in parallel. The image and audio processors' only for a `multimodal` model: their modules import
    torch._dynamo, scipy and more, whose side effects (environment variables, warning filters) a text-only
    model's host is spared."""
    with _IMPORT_LOCK:
        from transformers import AutoConfig, AutoTokenizer, LlamaConfig, PretrainedConfig  # noqa: F401

        if multimodal:
            from transformers import AutoFeatureExtractor, AutoImageProcessor  # noqa: F401


def _prepare(config: EngineConfig, decodes_images: bool = True) -> Prepared:
    path = resolve_model_path(config.model, config.revision, config.download_dir, load_format=config.load_format,
                              trust_remote_code=config.trust_remote_code)
    hf_config = served_hf_config(path, config.hf_overrides, config.trust_remote_code, config.config_format)
    if uses_mistral_weights(path, config.load_format):
        mistral_files(path)  # a folder without Mistral's weight files: refused before spawning
    arch = architecture_of(hf_config)  # refuse an unsupported architecture before spawning anything
    limits = config.multimodal_config.limit_mm_per_prompt
    multimodal = arch in MULTIMODAL_ARCHITECTURES and not serves_text_only(arch, limits)
    if not multimodal:
        _check_served_as_text(config, arch)
    prequantized_config(hf_config, config.model, config.quantization)  # refused methods: errors before spawning
    text_config = getattr(hf_config, "text_config", None) or hf_config
    check_pipeline_model(config, arch, text_config)
    check_heads_split(config.tensor_parallel_size, text_config)  # the workers' check, before spawning them
    max_model_len = _max_model_len(config, text_config, path)
    tokenizer_name = config.tokenizer or _model_tokenizer_path(config, path)
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
        tokenizer_name, config.tokenizer_revision if config.tokenizer else None, config.tokenizer_mode,
        config.trust_remote_code)
    resolved = config.replace(model=path, tokenizer=tokenizer_name, max_model_len=max_model_len,
                              kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, hf_config),
                              **resolve_runner(config, arch, hf_config))  # runner, convert, task: docs/pooling.md
    if base_architecture(arch) in HYBRID_ARCHITECTURES:
        resolved = _hybrid_config(resolved, arch)
    if config.skip_tokenizer_init and multimodal:
        raise ConfigError("skip_tokenizer_init", True, f"False for {arch} with images (its processor places image "
                                                       "tokens with the tokenizer)")
    if multimodal and is_mistral(tokenizer) and not encodes_media(arch, hf_config):  # docs/tokenizers.md
        raise NotBuiltError("tokenizer_mode", config.tokenizer_mode, f"mistral_common's tokenizer for {arch} with media")
    if getattr(text_config, "classifier_from_token", None) is not None:
        if tokenizer is None:
            raise ConfigError("skip_tokenizer_init", True, "False with classifier_from_token (its tokens are looked "
                                                           "up in the tokenizer)")
        classifier_from_tokens(text_config, arch, tokenizer)
    if serves_as_encoder(arch, hf_config):
        resolved = _encoder_config(resolved)
    spec = config.scheduler_config.speculative
    if spec is not None and spec.uses_draft_model:  # the draft checked against the target before spawning
        resolved = resolved.replace(speculative_config=prepare_draft_model(
            config.speculative_config, spec, text_config, config.tensor_parallel_size, max_model_len,  # type: ignore[arg-type]
            multimodal, arch, config.download_dir, config.load_format))
    if config.enable_expert_parallel and base_architecture(arch) not in MOE_ARCHITECTURES:
        raise ConfigError("enable_expert_parallel", True, f"a mixture-of-experts model ({arch} has no experts)")
    lora = None
    if config.enable_lora:
        unbuilt = multimodal or base_architecture(arch) in _NO_LORA or serves_as_encoder(arch, hf_config)
        if unbuilt and arch not in LORA_MULTIMODAL_ARCHITECTURES:
            raise NotBuiltError("enable_lora", True, f"LoRA adapters for {arch} (docs/models.md lists the "
                                                     "architectures that take them; where its LoRA column says "
                                                     "'as text', serve it as text: limit_mm_per_prompt of 0 for "
                                                     "each kind)")
        lora = AdapterChecker(_lora_config(arch, text_config), config.max_lora_rank,
                              *_expert_layers(hf_config, text_config, limits), runs_tower=multimodal,
                              kept_ids=kept_lora_ids(config.lora_config.resolved_max_cpu_loras))
    mm = None
    if multimodal:
        import_transformers(multimodal=True)
        from asyncllm.mm.images import check_max_image_pixels
        from asyncllm.mm.processor import MultiModalProcessor
        from asyncllm.models.registry import get_model_class
        from asyncllm.models.vision_language import image_limit

        model_cls = get_model_class(hf_config, config.multimodal_config.limit_mm_per_prompt)

        mm_config = config.multimodal_config
        if decodes_images:  # the host that decodes the images, not a standalone core
            check_max_image_pixels(mm_config.mm_max_image_pixels)
        limits = mm_config.limit_mm_per_prompt or {}
        for kind in ("video", "audio"):
            if limits.get(kind) and getattr(model_cls, f"mm_{kind}_token_id", None) is None:
                raise ConfigError(f"limit_mm_per_prompt.{kind}", limits[kind], f"0: {arch} takes no {kind}s")
        mm = MultiModalProcessor(path, hf_config, model_cls, tokenizer, int(mm_config.mm_processor_cache_gb * 2**30),
                                 mm_config.mm_max_image_pixels, mm_config.mm_processor_cache_type,
                                 mm_config.mm_processor_kwargs, image_limit(model_cls, limits), limits.get("video"),
                                 mm_config.video_num_frames, limits.get("audio"))
    config_json = hf_config_json(hf_config)
    generation = read_generation_config(config.generation_config, path, hf_config)
    eos = eos_token_ids(tokenizer, generation, getattr(text_config, "eos_token_id", None))
    return Prepared(resolved, tokenizer, eos, text_config.vocab_size, mm,
                    config_json if len(config_json) <= _MAX_CONFIG_ARG else None, lora,
                    embedding_width(path, _pooled_width(hf_config, text_config, arch, limits)),
                    default_sampling_fields(sampling_fields_of(config.generation_config, generation),
                                            config.override_generation_config), generation,
                    pooling_model_of(arch, text_config, path, config.pooler_config,
                                     Matryoshka.of(hf_config, config.model), resolved.runner, resolved.convert),
                    _embeds_width(config, arch, multimodal, text_config),
                    SuppressedTokens.of(generation, text_config.vocab_size, source_of(config.generation_config, path)))


def _pooled_width(hf_config: Any, text_config: Any, arch: str, limits: Any) -> int:
    """The width of the rows a pooling model pools: the hidden size, or a text-or-image model's shared space's
    (CLIP's ``projection_dim``) or a ColBERT's dimension (a `ConfigError` without one): the class's
    ``embedding_width``."""
    if arch not in DUAL_ENCODER_ARCHITECTURES + LATE_INTERACTION_ARCHITECTURES:
        return int(text_config.hidden_size)
    from asyncllm.models.registry import get_model_class

    return get_model_class(hf_config, limits).embedding_width(hf_config)


def _embeds_width(config: EngineConfig, arch: str, multimodal: bool, text_config: Any) -> int | None:
    """``enable_prompt_embeds``: the hidden size prompts' rows must have; what it is not built with refused."""
    if not config.enable_prompt_embeds:
        return None
    spec = config.scheduler_config.speculative
    media = "audio" if arch in AUDIO_ARCHITECTURES else "images"  # Whisper, the audio LLMs: no images
    for what, unbuilt in ((f"{arch} (it takes {media})", multimodal),
                          ("a draft model, EAGLE head or MTP layer (n-gram drafts work)",
                           spec is not None and spec.method != "ngram"),
                          (f"the encoder {arch}", serves_as_encoder(arch, text_config)),
                          (f"{arch} (its per-layer inputs are looked up by token id)",
                           bool(getattr(text_config, "hidden_size_per_layer_input", 0)))):  # Gemma 3n, Gemma 4
        if unbuilt:
            raise NotBuiltError("enable_prompt_embeds", True, f"prompts given as embeddings with {what}")
    return int(text_config.hidden_size)


def _expert_layers(hf_config: Any, text_config: Any, limits: Any) -> tuple[list[ExpertLayer | None] | None, bool, bool]:
    """A mixture of experts' layers as its model class builds them (None: a dense layer), whether its experts
    take adapters and whether PEFT stores them transposed, for the host's check of LoRA adapters; (None, False,
    False) for a dense model."""
    from asyncllm.models.registry import get_model_class

    model_cls = get_model_class(hf_config, limits)
    moe_spec = getattr(model_cls, "moe_spec", None)
    if moe_spec is None:
        return None, False, False
    specs = [moe_spec(text_config, i) for i in range(text_config.num_hidden_layers)]
    return ([None if spec is None else ExpertLayer(spec.num_experts, spec.intermediate_size, spec.shared_expert_size)
             for spec in specs], bool(getattr(model_cls, "lora_experts", False)),
            bool(getattr(model_cls, "lora_experts_transposed", False)))


def _hybrid_config(config: EngineConfig, arch: str) -> EngineConfig:
    """A linear-attention hybrid's config: its per-request states cannot be swapped, so swap preemption is refused;
    prefix caching restores them from checkpoint slots, and with none (``mamba_checkpoint_slots=0``) it is turned
    off (a log line says so). Speculative decoding keeps a snapshot per draft (asyncllm/models/row_states.py)."""
    if config.preemption_mode == "swap":
        raise NotBuiltError("preemption_mode", "swap", f"swap preemption for {arch}'s recurrent states (recompute)")
    if config.kv_offloading_size:
        raise NotBuiltError("kv_offloading_size", config.kv_offloading_size, f"a CPU prefix-cache tier for {arch} "
                                                                             "(its saved states stay on the GPU)")
    if config.enable_prefix_caching and not config.mamba_checkpoint_slots:
        logger.warning("prefix caching is off for %s: mamba_checkpoint_slots=0 keeps no saved states", arch)
        config = config.replace(enable_prefix_caching=False)
    return config


_NO_LORA = ENCODER_ARCHITECTURES + REWARD_ARCHITECTURES + ("LongcatFlashForCausalLM",)
"""The encoders and the reward models' own classes take no adapters (not built), nor LongCat-Flash (its two attention
blocks per layer: not built). The state-space models without attention (Mamba, Falcon Mamba, Mamba2) take them
on their mixers' projections (``in_proj``, ``out_proj``; Mamba's ``x_proj``, ``dt_proj`` too: asyncllm/models/mamba.py).
Every other decoder takes them on its attention and dense MLP projections (tests/unit/test_lora_models.py: logits equal
PEFT's; latent attention's ``kv_b_proj`` through its absorbed expansions, asyncllm/models/deepseek.py; DBRX's fused
``Wqkv``, not its bare expert matrices; Zamba2's shared blocks, one adapter per invocation,
asyncllm/models/zamba2_lora.py; a hybrid's state layers take none but Qwen3.5's, Kimi-Linear's KDA layers' and
MiniMax's lightning layers' (``qkv_proj``, ``output_gate``, ``out_proj``), an
adapter naming one, Mamba2's ``in_proj`` say, is refused by name)."""
LORA_MULTIMODAL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                 "Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                                 "Qwen3_5MoeForConditionalGeneration", "Qwen2AudioForConditionalGeneration",
                                 "AudioFlamingo3ForConditionalGeneration", "Glm4vForConditionalGeneration",
                                 "Glm4vMoeForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                                 "Lfm2VlForConditionalGeneration", "GlmAsrForConditionalGeneration",
                                 "VoxtralForConditionalGeneration",
                                 "Qwen3ASRForConditionalGeneration", "Llama4ForConditionalGeneration",
                                 "GraniteSpeechForConditionalGeneration", "PaliGemmaForConditionalGeneration",
                                 "Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniForConditionalGeneration",
                                 "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                 "LlavaNextVideoForConditionalGeneration",
                                 "LlavaOnevisionForConditionalGeneration", "Idefics3ForConditionalGeneration",
                                 "SmolVLMForConditionalGeneration", "InternVLForConditionalGeneration",
                                 "AyaVisionForConditionalGeneration", "Cohere2VisionForConditionalGeneration",
                                 "Gemma3ForConditionalGeneration",
                                 "Mistral3ForConditionalGeneration", "Gemma4ForConditionalGeneration",
                                 "LightOnOcrForConditionalGeneration",
                                 "Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration",
                                 "Gemma3nForConditionalGeneration", "MllamaForConditionalGeneration",
                                 "Phi4MultimodalForCausalLM",
                                 "Ernie4_5_VLMoeForConditionalGeneration",  # its attention and dense MLPs
                                 "PaddleOCRVLForConditionalGeneration", "HunYuanVLForConditionalGeneration",
                                 "AriaForConditionalGeneration",  # its attention (the experts take none)
                                 "WhisperForConditionalGeneration")  # its decoder's self- and cross-attention, MLP
"""Image-text (audio-text) models whose decoder takes adapters (the vision or audio tower does not: an adapter with
tower matrices is refused); their hooks are the decoder's (asyncllm/models/decoder_lora.py; Whisper's its own)."""


def _lora_config(arch: str, text_config: Any) -> Any:
    """The config whose fields the host checks an adapter's shapes by: Whisper's decoder's (``WhisperConfig``'s
    ``num_hidden_layers`` and ``num_attention_heads`` are its encoder's), else the text config."""
    if arch != "WhisperForConditionalGeneration":
        return text_config
    from asyncllm.models.whisper import WhisperDecoder

    return WhisperDecoder.config_view(text_config)


_MAX_CONFIG_ARG = 64 * 1024
"""Longest config JSON sent on the core's and workers' command lines (Linux refuses one argument over 128 KiB);
a longer one is not sent, and the workers read config.json themselves."""


def _encoder_config(config: EngineConfig) -> EngineConfig:
    """A bidirectional encoder's scheduling (as vLLM's for encoder-only models): every prompt whole in one step,
    no prefix caching (a cached prefix would skip tokens the others attend to), and KV blocks only for the
    scheduler's accounting (the model keeps none): enough for max_num_seqs prompts of max_model_len."""
    if config.kv_offloading_size:
        raise ConfigError("kv_offloading_size", config.kv_offloading_size, "0 for an encoder model (it keeps no KV "
                                                                           "cache and no prefix cache to offload)")
    if config.long_prefill_token_threshold:
        raise ConfigError("long_prefill_token_threshold", config.long_prefill_token_threshold,
                          "0 for an encoder model (each prompt runs whole in one step)")
    budget = config.max_num_batched_tokens
    if budget is not None and budget < config.max_model_len:
        raise ConfigError("max_num_batched_tokens", budget, f"at least max_model_len={config.max_model_len} for an "
                                                            "encoder model (each prompt runs whole in one step), or "
                                                            "a smaller max_model_len")
    changes: dict[str, Any] = {"enable_chunked_prefill": False, "enable_prefix_caching": False}
    if config.num_gpu_blocks_override is None:
        blocks_per_prompt = -(-(config.max_model_len + 1) // config.block_size)
        changes["num_gpu_blocks_override"] = config.max_num_seqs * blocks_per_prompt
    logger.info("encoder model: each prompt runs whole in one step (chunked prefill and prefix caching off)")
    return config.replace(**changes)


def _check_local_revisions(config: EngineConfig) -> None:
    """A revision names a hub repo's branch, tag or commit; a local folder (or .gguf file) has none, so one given
    with it is a `ConfigError` naming the field (vLLM and transformers ignore it); a draft model's too."""
    if config.revision is not None and os.path.exists(config.model):
        raise ConfigError("revision", config.revision, f"None for a local model ({config.model} has no revisions)")
    spec = config.scheduler_config.speculative
    if spec is not None and spec.revision is not None and os.path.exists(spec.model or ""):
        raise ConfigError("speculative_config.revision", spec.revision, f"None for a local draft model ({spec.model} "
                                                                        "has no revisions)")
    if config.tokenizer_revision is None:
        return
    if config.tokenizer is not None and os.path.exists(config.tokenizer):
        raise ConfigError("tokenizer_revision", config.tokenizer_revision, f"None for a local tokenizer "
                                                                           f"({config.tokenizer} has no revisions)")
    if config.tokenizer is None and os.path.exists(config.model):
        raise ConfigError("tokenizer_revision", config.tokenizer_revision, f"None for a local model ({config.model} "
                                                                           "has no revisions; pass tokenizer= a folder)")


def _check_served_as_text(config: EngineConfig, arch: str) -> None:
    """The multimodal fields of a model served as text (a text-only architecture, or an image-text one with every
    ``limit_mm_per_prompt`` count 0): one that asks for media is a `ConfigError` naming it, not ignored (older vLLM
    refused them too: "only supported for multimodal models"); None, {} and counts of 0 pass."""
    mm_config = config.multimodal_config
    for kind, count in (mm_config.limit_mm_per_prompt or {}).items():
        if count:
            raise ConfigError(f"limit_mm_per_prompt.{kind}", count, f"0: {arch} is served as text (no {kind}s)")
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if getattr(mm_config, name):
            raise ConfigError(name, getattr(mm_config, name), f"None: {arch} is served as text (it processes no "
                                                              "images, videos or audio)")


def _model_tokenizer_path(config: EngineConfig, path: str) -> str:
    """The folder of the model's own tokenizer: the model's, or (as vLLM reads ``tokenizer_revision`` with no
    ``tokenizer``) the model repo's tokenizer files at that revision, without its weights."""
    if config.tokenizer_revision is None or config.tokenizer_revision == config.revision:
        return path
    return resolve_model_path(config.model, config.tokenizer_revision, config.download_dir, weights=False,
                              trust_remote_code=config.trust_remote_code)


def _max_model_len(config: EngineConfig, hf_config: Any, path: str | None = None) -> int:
    limit, what = max_positions(hf_config), "the model's max_position_embeddings (times its rope scaling factor)"
    window = getattr(hf_config, "sliding_window", None)
    if config.disable_sliding_window and isinstance(window, int) and window > 0 and (limit is None or window < limit):
        limit, what = window, "the sliding window (disable_sliding_window)"  # no window ever slides: full attention
    seq_length = sentence_transformers_config(path).get("max_seq_length")
    if isinstance(seq_length, int) and seq_length > 0 and (limit is None or seq_length < limit):  # vLLM's
        limit, what = seq_length, "the sentence-transformers config's max_seq_length"  # (encoder_config)
    if config.max_model_len in (None, AUTO_MAX_MODEL_LEN):  # auto: the core lowers it to the KV cache's capacity
        original = longrope_original(hf_config)  # vLLM's LongRoPE default: the short factors (transformers' outputs)
        return min(original, limit or original) if original is not None else limit or 2048
    if limit is not None and config.max_model_len > limit:
        raise ConfigError("max_model_len", config.max_model_len, f"at most {what} ({limit})")
    return config.max_model_len
