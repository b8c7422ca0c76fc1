"""The sections of `EngineConfig` that describe the model: `ModelConfig` (the checkpoint, its tokenizer, dtype,
quantization, generation defaults) and `MultiModalConfig` (how images, videos and audio are read and cached).
Validated as every section is (asyncllm/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.attention.availability import ATTENTION_BACKENDS, backend_name
from asyncllm.config_checks import (check_bool, check_choice, check_float, check_int, check_json_dict,
                                     check_sampling_fields, is_int)
from asyncllm.config_runner import check_runner_fields
from asyncllm.engine.defaults import sampling_overrides
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.pooling import check_pooler_config

__all__ = ["ModelConfig", "MultiModalConfig"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's other names, served as the names they stand for."""
DEVICES = ("auto", "cpu", "cuda")
AUTO_MAX_MODEL_LEN = -1
"""vLLM's ``max_model_len`` -1 (the CLI's ``auto``): the longest length that fits the KV cache
(asyncllm/engine/kv_budget.py `fit_max_model_len`)."""
_MAX_ENGINE_SEED = 2**64 - 1
"""torch's ``manual_seed`` takes a uint64 (a request's seed is an int64: `SamplingParams.seed`)."""
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy", "mistral")
CONFIG_FORMATS = ("auto", "hf", "mistral")
TOKENIZER_MODES = ("auto", "hf", "slow", "mistral")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
QUANTIZATIONS = ("fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors", "gguf", "mxfp4")
"""Built values of `quantization` besides None (asyncllm/models/quantization.py, docs/quantization.md); awq, gptq
and their _marlin names serve checkpoints pre-quantized with that method (asyncllm/models/int4_checkpoint.py),
compressed-tensors llm-compressor's checkpoints (asyncllm/models/compressed_tensors.py), gguf a .gguf file
(asyncllm/models/gguf_loader.py)."""


@dataclass(frozen=True)
class ModelConfig:
    model: str = ""
    """Local folder of a Hugging Face checkpoint, or a hub id (looked up in the huggingface_hub cache)."""
    runner: str = "auto"
    """vLLM's: generate serves generation only, pooling embeddings / classification / rewards only (draft: refused,
    drafts are speculative_config's); auto: pooling for an embedding, classifier or reward architecture (or
    convert='reward'), else a causal LM serves both
    generation and embeddings (asyncllm's; vLLM's auto generates only). The engine's config shows it resolved
    (docs/pooling.md#runner-and-convert)."""
    convert: str = "auto"
    """vLLM's adapters for runner='pooling': embed serves a causal LM's embeddings (LAST pooling, normalized, as
    vLLM's as_embedding_model), classify needs a classification head (a *ForSequenceClassification checkpoint),
    none keeps the model as it is, reward serves every prompt token's hidden state (vLLM's as_reward_model:
    token_classify only; a causal LM or bare decoder). auto: embed for a causal LM under runner='pooling'."""
    task: str | None = None
    """vLLM's deprecated --task (generate, embed, embedding, classify, score, transcription, auto), mapped onto runner
    and convert as vLLM maps it (reward: convert reward), with vLLM's deprecation warning; draft is refused."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; defaults to `model`."""
    tokenizer_mode: str = "auto"
    """vLLM's: auto (or hf) loads the fast tokenizer when there is one, slow the Python one (``use_fast=False``),
    mistral Mistral's own files (tekken.json, tokenizer.model.v<N>) with mistral_common (the ``mistral`` extra);
    auto takes mistral for a folder with such a file and no Hugging Face tokenizer (docs/tokenizers.md). custom
    is not built."""
    trust_remote_code: bool = False
    """vLLM's: let transformers run the checkpoint's own Python code for its config and tokenizer (``auto_map``;
    only from checkpoints you trust; an image processor's own code is not run). The model itself is always
    asyncllm's class of its architecture; off, such a checkpoint is a ConfigError naming this field."""
    enable_prompt_embeds: bool = False
    """vLLM's: accept prompts given as embeddings, ``{"prompt_embeds": tensor [tokens, hidden]}`` (what the
    model's input embedding layer returns; docs/sampling.md#prompts-given-as-embeddings). Not with image-text or
    audio models (Whisper too), models with per-layer inputs (Gemma 3n, Gemma 4 with
    ``hidden_size_per_layer_input``) or a draft model / EAGLE head / MTP layer (n-gram drafts work)."""
    skip_tokenizer_init: bool = False
    """vLLM's: load no tokenizer. Prompts are token ids and outputs token ids with empty text; what needs the
    tokenizer (text prompts, chat, stop strings, bad words, structured output, images) is refused by name."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of `model` (a local folder has none: an error)."""
    tokenizer_revision: str | None = None
    """vLLM's: hub revision of `tokenizer` when that is a hub id of its own (None: its default branch); with no
    tokenizer, the model repo's tokenizer at this revision (a local model or tokenizer folder has none: an
    error)."""
    download_dir: str | None = None
    """vLLM's: the huggingface_hub cache folder a hub id's weights are downloaded to and read from (a draft
    model's too); None: HF_HUB_CACHE, else huggingface_hub's default. A local folder is read where it is."""
    dtype: str = "auto"
    """Weights and activations: float32, bfloat16, float16 (vLLM's half and float too, and a ``torch.dtype`` such as
    ``torch.bfloat16``: kept as its name); auto = float32 on CPU, the checkpoint's half type on GPU."""
    device: str = "auto"
    """cpu or cuda; auto picks cuda when available."""
    seed: int = 0
    """Seed of the engine's random state (dummy weights, unseeded sampling): 0 to 2**64 - 1, what torch's
    generators take."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); defaults to the model's max_position_embeddings, times its rope scaling
    factor (YaRN: original_max_position_embeddings times it), as vLLM derives it; a LongRoPE model's (Phi-3-128k,
    Phi-3.5, Phi-4-mini) to its original_max_position_embeddings, as vLLM's (its short factors, transformers'
    outputs; a longer value takes the long factors: docs/phi3.md). -1 (the CLI's ``auto``, vLLM's):
    that default, lowered once the KV cache is sized to the most tokens its blocks hold (blocks x block_size: one
    sequence fills the whole cache), and logged; ``engine.config`` and the server show the resolved value."""
    disable_sliding_window: bool = False
    """vLLM's: cap max_model_len at the model's sliding window, so that no window ever slides (every layer attends
    to the whole sequence); no effect on a model without one."""
    load_format: str = "auto"
    """auto reads the safetensors, else the PyTorch pickles (`pytorch_model*.bin`, `*.pt`); safetensors / pt read
    only those (pre-quantized checkpoints too; with pt a hub id fetches its `*.bin` / `*.pt`); dummy makes random
    weights of the real shapes; mistral reads Mistral's `consolidated*.safetensors` (auto does for a checkpoint
    whose config is its params.json; docs/tokenizers.md#mistrals-checkpoint-format)."""
    config_format: str = "auto"
    """vLLM's: hf reads config.json, mistral Mistral's params.json (the dense text models), auto config.json, else
    params.json (docs/tokenizers.md#mistrals-checkpoint-format)."""
    quantization: str | None = None
    """Weight quantization: None, or fp8 (online: every decoder linear's weight quantized at load to float8_e4m3fn
    with one scale per tensor and rank, activations per token; see docs/quantization.md). A pre-quantized fp8
    checkpoint (config.json's quantization_config) is served in its own fp8 with None or fp8; an AWQ or GPTQ one
    (int4 weights, GPTQ int8 too) with None or its method's name (awq / gptq; vLLM's awq_marlin / gptq_marlin read
    the same checkpoints); a compressed-tensors one (fp8 W8A8 per tensor, row or block, int8 W8A8, int4 / int8
    W4A16 / W8A16) with None or compressed-tensors; a GGUF file (the model given as a local .gguf) with None or gguf;
    a gpt-oss mxfp4 one with None or mxfp4. Other methods are not built yet."""
    enforce_eager: bool = False
    """Never capture CUDA graphs. Otherwise, on CUDA with the triton backend and one rank, decode batches replay graphs captured at start (docs/kernels.md); the CPU and torch_sdpa always run eagerly."""
    attention_backend: str | None = None
    """torch_sdpa (CPU default, the reference) or triton (CUDA default; on CPU only with TRITON_INTERPRET=1);
    flashinfer, flash_attn: an error naming the package when it is missing, not built yet otherwise. None picks the default.
    vLLM's names, in any case, name the same backends: FLASH_ATTN, FLASHINFER, TRITON_ATTN (triton), TORCH_SDPA."""
    generation_config: str = "auto"
    """The model's generation config: auto = the model folder's generation_config.json, vllm = the same file without
    its sampling defaults, or a folder holding one. Its temperature, top_p, top_k, min_p, repetition_penalty and
    max_new_tokens (as max_tokens) are the defaults of requests without SamplingParams and of server fields left
    unset (vllm: SamplingParams' own); its suppress_tokens, begin_suppress_tokens and Whisper's task and timestamp
    tokens apply to every request and its eos_token_id joins the EOS ids, vllm included."""
    override_generation_config: dict[str, Any] | None = None
    """Sampling defaults set on top of those, e.g. {"temperature": 0.5}: vLLM's keys only (temperature, top_p, top_k,
    min_p, repetition_penalty, max_new_tokens or max_tokens); another key is a ConfigError naming it."""
    max_logprobs: int = 20
    """vLLM's: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (-1: the vocabulary's size);
    a request asking for more is an InvalidRequestError naming the field."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs hold, as vLLM's: raw_logprobs (log-softmax of the model's logits), raw_logits, or
    processed_logprobs / processed_logits (after logit_bias, penalties, bad words, min_tokens, a grammar, then
    temperature, min-p, top-k and top-p for sampled rows: the distribution a token was drawn from)."""
    pooler_config: dict[str, Any] | None = None
    """vLLM's PoolerConfig as a dict: {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": bool} (docs/embeddings.md);
    with convert='reward': {"pooling_type": "ALL"|"STEP", "step_tag_id": int, "returned_token_ids": [int, ...],
    "use_activation": bool} (docs/pooling.md#reward-models)."""
    enable_sleep_mode: bool = False
    """Allow `AsyncEngine.sleep()` / `wake_up()` (vLLM's sleep mode, docs/sleep-mode.md): free the GPU memory of the
    weights (level 1: kept in CPU memory; level 2: discarded) and of the KV cache between RL rollouts."""
    hf_overrides: dict[str, Any] | None = None
    """vLLM's: config.json keys set on top of the checkpoint's, e.g. {"max_position_embeddings": 4096}; a dict
    value updates a nested config ({"text_config": {...}}). {"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true} serves Qwen3-Reranker as a
    cross-encoder (docs/pooling.md). JSON values only (the config travels to the workers as JSON)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", self.model, "a local folder or a hub id (non-empty string)")
        if self.tokenizer_mode == "custom":
            raise NotBuiltError("tokenizer_mode", self.tokenizer_mode, f"tokenizer_mode={self.tokenizer_mode!r} "
                                                                       "(auto, hf, slow or mistral)")
        check_choice("tokenizer_mode", self.tokenizer_mode, TOKENIZER_MODES)
        check_runner_fields(self.runner, self.convert, self.task)
        check_bool("skip_tokenizer_init", self.skip_tokenizer_init)
        check_bool("enable_prompt_embeds", self.enable_prompt_embeds)
        check_bool("trust_remote_code", self.trust_remote_code)
        for name, what in (("download_dir", "a folder path"), ("tokenizer", "a local folder or a hub id"),
                           ("revision", "a branch, tag or commit"), ("tokenizer_revision", "a branch, tag or commit")):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, value, f"{what} (non-empty string), or None")
        if type(self.dtype).__module__ == "torch" and type(self.dtype).__name__ == "dtype":  # torch.bfloat16, as
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))  # vLLM's LLM takes: its name
        if isinstance(self.dtype, str) and self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("device", self.device, DEVICES)
        check_int("seed", self.seed, 0, _MAX_ENGINE_SEED)
        length = self.max_model_len
        if length is not None and (not is_int(length)
                                   or (length < 1 and length != AUTO_MAX_MODEL_LEN)):
            raise ConfigError("max_model_len", length, "an int >= 1, -1 (fitted to the KV cache; the CLI's 'auto') "
                              "or None (the model's maximum)")
        check_int("max_logprobs", self.max_logprobs, -1)
        check_bool("disable_sliding_window", self.disable_sliding_window)
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_choice("config_format", self.config_format, CONFIG_FORMATS)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            if not isinstance(self.quantization, str):
                raise ConfigError("quantization", self.quantization,
                                  f"None or one of {', '.join(map(repr, QUANTIZATIONS))}")
            raise NotBuiltError("quantization", self.quantization, f"{self.quantization!r} weight quantization "
                                "(only 'fp8', online or pre-quantized, pre-quantized 'awq' / 'gptq' / "
                                "'compressed-tensors' / 'mxfp4' checkpoints and 'gguf' files)")
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("enable_sleep_mode", self.enable_sleep_mode)
        if self.attention_backend is not None:
            object.__setattr__(self, "attention_backend", backend_name(self.attention_backend))  # vLLM's names too
            check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)  # its package: EngineConfig.create
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError("generation_config", self.generation_config, "'auto', 'vllm' or a folder")
        object.__setattr__(self, "override_generation_config",
                           sampling_overrides("override_generation_config", self.override_generation_config))
        check_sampling_fields("override_generation_config", self.override_generation_config)
        check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        check_pooler_config(self.pooler_config, reward="reward" in (self.convert, self.task))
        check_json_dict("hf_overrides", self.hf_overrides)


def _check_mm_limits(limits: dict[str, int] | None) -> None:
    """vLLM's ``limit_mm_per_prompt``: counts per modality (a video or audio count for a model without them is
    refused when the model is known: asyncllm/engine/prepare.py)."""
    if limits is None:
        return
    if not isinstance(limits, dict):
        raise ConfigError("limit_mm_per_prompt", limits, 'a dict of modality -> count, e.g. {"image": 4}')
    for modality, count in limits.items():
        field_name = f"limit_mm_per_prompt.{modality}"
        if modality not in ("image", "video", "audio"):
            raise ConfigError(field_name, count, "a modality of 'image', 'video', 'audio'")
        if not is_int(count) or count < 0:
            raise ConfigError(field_name, count, "an int >= 0")


def _check_media_io(settings: dict[str, Any] | None) -> None:
    """``media_io_kwargs``: only the video loader's ``num_frames`` is built."""
    if settings is None:
        return
    if not isinstance(settings, dict) or not all(isinstance(v, dict) for v in settings.values()):
        raise ConfigError("media_io_kwargs", settings, 'a dict of modality -> settings, e.g. {"video": {"num_frames": 16}}')
    for modality, values in settings.items():
        for key, value in values.items():
            if (modality, key) != ("video", "num_frames"):
                raise NotBuiltError(f"media_io_kwargs.{modality}.{key}", value, "media_io_kwargs other than video num_frames")
            if not is_int(value) or not 1 <= value <= 768:
                raise ConfigError("media_io_kwargs.video.num_frames", value, "an int in [1, 768]")


@dataclass(frozen=True)
class MultiModalConfig:
    """Settings of multimodal models (LLaVA, Qwen2-VL, Qwen2.5-VL; docs/multimodal.md)."""

    mm_processor_cache_gb: float = 4.0
    """GiB of processed multimodal inputs to cache; 0 disables the cache."""
    mm_processor_cache_type: str = "lru"
    """lru: key-replicated (keys on the host, data in the core); shm: data in a shared-memory ring the host writes
    and the core reads, keys in the host (docs/multimodal.md)."""
    mm_encoder_tp_mode: str = "weights"
    """weights: the vision tower and projector sharded like the decoder, every rank encodes every image with its
    shard; data: the encoder replicated, each rank encodes a share of a step's images and the features are
    all-gathered."""
    mm_max_image_pixels: int = 16_777_216
    """Largest image accepted (width x height, read from its header before decoding); at most PIL's limit, 2 x
    `PIL.Image.MAX_IMAGE_PIXELS` in the host process (checked when it prepares a multimodal model)."""
    mm_encoder_cache_gb: float = 0.5
    """GiB of encoder outputs kept per worker across requests (by image hash); 0 keeps them only during a prefill."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Overrides of the checkpoint's image processor settings, e.g. ``{"max_pixels": 1003520}`` for Qwen2-VL
    (a key the processor does not have is an error, as is any key on a text-only model)."""
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    """vLLM's media loading settings per modality: ``{"video": {"num_frames": 32}}``, the frames taken (evenly
    spaced) from an encoded video file; None: 32 (a text-only model: an error)."""
    limit_mm_per_prompt: dict[str, int] | None = None
    """Most inputs per prompt of each modality, e.g. ``{"image": 4, "video": 1}``; 0 refuses that modality (all 0 on
    Gemma 3: its text decoder alone; above 0 on a text-only model: an error). None: no limit."""

    def __post_init__(self) -> None:
        check_float("mm_processor_cache_gb", self.mm_processor_cache_gb, 0.0, 1024.0)
        check_choice("mm_processor_cache_type", self.mm_processor_cache_type, ("lru", "shm"))
        check_choice("mm_encoder_tp_mode", self.mm_encoder_tp_mode, ("weights", "data"))
        check_int("mm_max_image_pixels", self.mm_max_image_pixels, 1)  # PIL's bound: check_max_image_pixels
        check_float("mm_encoder_cache_gb", self.mm_encoder_cache_gb, 0.0, 1024.0)
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise ConfigError("mm_processor_kwargs", self.mm_processor_kwargs, "a dict of image processor settings")
        _check_mm_limits(self.limit_mm_per_prompt)
        _check_media_io(self.media_io_kwargs)

    @property
    def video_num_frames(self) -> int:
        """Frames sampled from an encoded video file."""
        return int(((self.media_io_kwargs or {}).get("video") or {}).get("num_frames", 32))

