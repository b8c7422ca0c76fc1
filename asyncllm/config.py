"""`EngineConfig`: one frozen object made of small frozen sections.

Field names follow vLLM's so that users can move over without a dictionary.
Every section validates itself in ``__post_init__`` and raises `ConfigError`
naming the field, the value and what is allowed; a field whose feature is not
built yet raises `NotBuiltError` (a `ConfigError`) naming the feature.
"""

from __future__ import annotations

import json

from dataclasses import dataclass, field, fields
from typing import Any

from asyncllm.attention.availability import ATTENTION_BACKENDS, check_backend_available
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.pipeline_parallel import check_pipeline_config
from asyncllm.pooling import check_pooler_config
from asyncllm.spec.config import SpeculativeConfig

__all__ = [
    "EngineConfig",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "MultiModalConfig",
    "ObservabilityConfig",
    "LoRAConfig",
    "FaultToleranceConfig",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
TOKENIZER_MODES = ("auto", "hf", "slow")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUANTIZATIONS = ("fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors", "gguf")
"""Built values of `quantization` besides None (asyncllm/models/quantization.py, docs/quantization.md); awq, gptq
and their _marlin names serve checkpoints pre-quantized with that method (asyncllm/models/int4_checkpoint.py),
compressed-tensors llm-compressor's checkpoints (asyncllm/models/compressed_tensors.py), gguf a .gguf file
(asyncllm/models/gguf_loader.py)."""
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""auto = the model dtype; fp8 and fp8_e4m3 = float8_e4m3fn; fp8_e5m2 = float8_e5m2 (docs/fp8-kv-cache.md)."""


def _choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"one of {', '.join(map(repr, allowed))}")


def _int(name: str, value: object, lo: int, hi: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        bound = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ConfigError(name, value, bound + (" or None" if optional else ""))


def _json_dict(name: str, value: object) -> None:
    """None, or a dict with str keys that JSON can write."""
    if value is None:
        return
    try:
        ok = isinstance(value, dict) and all(isinstance(key, str) for key in value) and bool(json.dumps(value))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(name, value, "a dict of config.json keys and JSON values, or None")


def _sampling_fields(name: str, value: object) -> None:
    """None, or a dict of SamplingParams field names (checked by building one)."""
    if value is None:
        return
    from asyncllm.sampling import SamplingParams

    if not isinstance(value, dict):
        raise ConfigError(name, value, "a dict of SamplingParams fields, or None")
    try:
        SamplingParams(**value).validate()
    except (TypeError, ValueError) as exc:
        raise ConfigError(name, value, f"SamplingParams fields with valid values ({exc})") from None


def _float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > lo if lo_open else value >= lo) and value <= hi  # type: ignore[operator]
    if not ok:
        raise ConfigError(name, value, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")


def _registry(name: str, value: object) -> None:
    from prometheus_client import CollectorRegistry  # only when a registry is given: import asyncllm stays cheap

    if not isinstance(value, CollectorRegistry):
        raise ConfigError(name, value, "a prometheus_client.CollectorRegistry, or None for a private one")


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(name, value, "True or False")


@dataclass(frozen=True)
class ModelConfig:
    model: str = ""
    """Local folder of a Hugging Face checkpoint, or a hub id (looked up in the huggingface_hub cache)."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; defaults to `model`."""
    tokenizer_mode: str = "auto"
    """vLLM's: auto (or hf) loads the fast tokenizer when there is one, slow the Python one (``use_fast=False``);
    mistral (mistral_common) and custom are not built."""
    trust_remote_code: bool = False
    """vLLM's: let transformers run the checkpoint's own Python code for its config, tokenizer and image processor
    (``auto_map``; only from checkpoints you trust). The model itself is always asyncllm's class of its
    architecture; off, such a checkpoint is a ConfigError naming this field."""
    enable_prompt_embeds: bool = False
    """vLLM's: accept prompts given as embeddings, ``{"prompt_embeds": tensor [tokens, hidden]}`` (what the
    model's input embedding layer returns; docs/sampling.md#prompts-given-as-embeddings). Not with image-text
    models or a draft model / EAGLE head / MTP layer (n-gram drafts work)."""
    skip_tokenizer_init: bool = False
    """vLLM's: load no tokenizer. Prompts are token ids and outputs token ids with empty text; what needs the
    tokenizer (text prompts, chat, stop strings, bad words, structured output, images) is refused by name."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of `model`."""
    tokenizer_revision: str | None = None
    """vLLM's: hub revision of `tokenizer` when that is a hub id of its own (None: its default branch)."""
    download_dir: str | None = None
    """vLLM's: the huggingface_hub cache folder a hub id's weights are downloaded to and read from (a draft
    model's too); None: HF_HUB_CACHE, else huggingface_hub's default. A local folder is read where it is."""
    dtype: str = "auto"
    """Weights and activations: float32, bfloat16, float16; auto = float32 on CPU, the checkpoint's half type on GPU."""
    device: str = "auto"
    """cpu or cuda; auto picks cuda when available."""
    seed: int = 0
    """Seed of the engine's random state (dummy weights, unseeded sampling)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); defaults to the model's max_position_embeddings."""
    disable_sliding_window: bool = False
    """vLLM's: cap max_model_len at the model's sliding window, so that no window ever slides (every layer attends
    to the whole sequence); no effect on a model without one."""
    load_format: str = "auto"
    """auto/safetensors read the checkpoint; dummy makes random weights of the real shapes."""
    quantization: str | None = None
    """Weight quantization: None, or fp8 (online: every decoder linear's weight quantized at load to float8_e4m3fn
    with one scale per tensor and rank, activations per token; see docs/quantization.md). A pre-quantized fp8
    checkpoint (config.json's quantization_config) is served in its own fp8 with None or fp8; an AWQ or GPTQ one
    (int4 weights, GPTQ int8 too) with None or its method's name (awq / gptq; vLLM's awq_marlin / gptq_marlin read
    the same checkpoints); a compressed-tensors one (fp8 W8A8 per tensor, row or block, int8 W8A8, int4 / int8
    W4A16 / W8A16) with None or compressed-tensors; a GGUF file (the model given as a local .gguf) with None or gguf.
    Other methods are not built yet."""
    enforce_eager: bool = False
    """Never capture CUDA graphs. Otherwise, on CUDA with the triton backend and one rank, decode batches replay graphs captured at start (docs/kernels.md); the CPU and torch_sdpa always run eagerly."""
    attention_backend: str | None = None
    """torch_sdpa (CPU default, the reference) or triton (CUDA default; on CPU only with TRITON_INTERPRET=1);
    flashinfer, flash_attn: an error naming the package when it is missing, not built yet otherwise. None picks the default."""
    generation_config: str = "auto"
    """The model's generation config: auto = the model folder's generation_config.json, vllm = the same file without
    its sampling defaults, or a folder holding one. Its temperature, top_p, top_k, min_p, repetition_penalty and
    max_new_tokens (as max_tokens) are the defaults of requests without SamplingParams and of server fields left
    unset (vllm: SamplingParams' own); its suppress_tokens, begin_suppress_tokens and Whisper's task and timestamp
    tokens apply to every request and its eos_token_id joins the EOS ids, vllm included."""
    override_generation_config: dict[str, Any] | None = None
    """SamplingParams fields set on top of those defaults, e.g. {"temperature": 0.5}."""
    max_logprobs: int = 20
    """vLLM's: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (-1: the vocabulary's size);
    a request asking for more is an InvalidRequestError naming the field."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs hold, as vLLM's: raw_logprobs (log-softmax of the model's logits), raw_logits, or
    processed_logprobs / processed_logits (after logit_bias, penalties, bad words, min_tokens, a grammar, then
    temperature, top-k, top-p and min-p for sampled rows: the distribution a token was drawn from)."""
    pooler_config: dict[str, Any] | None = None
    """vLLM's PoolerConfig as a dict: {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": bool} (docs/embeddings.md)."""
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
        if self.tokenizer_mode in ("mistral", "custom"):
            raise NotBuiltError("tokenizer_mode", self.tokenizer_mode, f"tokenizer_mode={self.tokenizer_mode!r} "
                                                                       "(auto, hf or slow: transformers' tokenizers)")
        _choice("tokenizer_mode", self.tokenizer_mode, TOKENIZER_MODES)
        _bool("skip_tokenizer_init", self.skip_tokenizer_init)
        _bool("enable_prompt_embeds", self.enable_prompt_embeds)
        _bool("trust_remote_code", self.trust_remote_code)
        if self.download_dir is not None and (not isinstance(self.download_dir, str) or not self.download_dir):
            raise ConfigError("download_dir", self.download_dir, "a folder path (non-empty string), or None")
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        _int("seed", self.seed, 0)
        _int("max_model_len", self.max_model_len, 1, optional=True)
        _int("max_logprobs", self.max_logprobs, -1)
        _bool("disable_sliding_window", self.disable_sliding_window)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            if not isinstance(self.quantization, str):
                raise ConfigError("quantization", self.quantization, "None or 'fp8'")
            raise NotBuiltError("quantization", self.quantization, f"{self.quantization!r} weight quantization "
                                "(only 'fp8', online or pre-quantized, pre-quantized 'awq' / 'gptq' / "
                                "'compressed-tensors' checkpoints and 'gguf' files)")
        _bool("enforce_eager", self.enforce_eager)
        _bool("enable_sleep_mode", self.enable_sleep_mode)
        if self.attention_backend is not None:
            _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
            check_backend_available(self.attention_backend)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError("generation_config", self.generation_config, "'auto', 'vllm' or a folder")
        _sampling_fields("override_generation_config", self.override_generation_config)
        _choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        check_pooler_config(self.pooler_config)
        _json_dict("hf_overrides", self.hf_overrides)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights, activations, KV cache)."""
    num_gpu_blocks_override: int | None = None
    """Use exactly this many KV blocks instead of sizing from memory."""
    kv_cache_memory_bytes: int | None = None
    """vLLM's: bytes of KV cache per rank (the draft model's included), instead of what gpu_memory_utilization
    leaves after a profile step (on the CPU: instead of ASYNCLLM_CPU_KVCACHE_SPACE_GB); num_gpu_blocks_override
    wins over it."""
    kv_cache_dtype: str = "auto"
    """auto = the model dtype; fp8 / fp8_e4m3 (float8_e4m3fn) or fp8_e5m2 (float8_e5m2): K and V stored in
    one byte each with the checkpoint's calibrated per-layer scales, else 1.0; twice the blocks of bfloat16
    (docs/fp8-kv-cache.md)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    swap_space: float = 4.0
    """GiB of CPU memory per GPU for swapped-out blocks (preemption_mode='swap')."""
    kv_offloading_size: float = 0.0
    """vLLM's: GiB of CPU memory, summed over the ranks, for a second prefix-cache tier: cached KV blocks evicted
    from the GPU are copied there and loaded back on a later prefix hit (0: off; asyncllm/kv/offload.py)."""
    mamba_block_size: int = 256
    """Hybrid models (recurrent state layers beside attention) with prefix caching: the layers' states are saved
    every this many tokens (a multiple of block_size), and a prefix-cache hit resumes at the last such point
    (docs/hybrid-models.md#prefix-caching)."""
    mamba_checkpoint_slots: int = 16
    """Hybrid models with prefix caching: how many saved states (each the size of one request's states) the
    workers keep, least recently used replaced first; 0 turns prefix caching off for them."""

    def __post_init__(self) -> None:
        _choice("block_size", self.block_size, BLOCK_SIZES)
        _float("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        _int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1, optional=True)
        _int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _bool("enable_prefix_caching", self.enable_prefix_caching)
        _float("swap_space", self.swap_space, 0.0, 1024.0)
        _float("kv_offloading_size", self.kv_offloading_size, 0.0, 1 << 20)
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ConfigError("kv_offloading_size", self.kv_offloading_size, "0 with enable_prefix_caching=False "
                                                                             "(the CPU tier holds prefix-cache blocks)")
        _int("mamba_block_size", self.mamba_block_size, 1)
        _int("mamba_checkpoint_slots", self.mamba_checkpoint_slots, 0)
        if self.mamba_block_size % self.block_size:
            raise ConfigError("mamba_block_size", self.mamba_block_size, f"a multiple of block_size={self.block_size}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int | None = None
    """Most tokens in one step; defaults to 8192 with chunked prefill, else max_model_len."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so that decodes keep running."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step; 0 means no cap."""
    preemption_mode: str = "recompute"
    """recompute frees a victim's blocks and recomputes later; swap copies them to a CPU pool of swap_space GiB."""
    scheduling_policy: str = "fcfs"
    """fcfs (first come first served) or priority (lower `priority` first; may preempt lower-priority requests)."""
    max_num_queued_requests: int | None = None
    """Admission control: reject new requests with EngineOverloadedError while this many wait; None = no limit."""
    speculative_config: dict | None = None
    """Speculative decoding as vLLM's dict: ``{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}``, a draft model: ``{"model": "path/or/hub-id",
    "num_speculative_tokens": 5}``, or an EAGLE head: ``{"method": "eagle3", "model": "head/path-or-id",
    "num_speculative_tokens": 3}`` (docs/speculative.md). Steps then run
    synchronously (async_scheduling does not apply); None: off."""
    max_num_queued_tokens: int | None = None
    """Admission control: reject new requests with EngineOverloadedError when the waiting prompts' tokens would exceed this; None = no limit."""
    structured_output_compile_timeout_s: float = 30.0
    """Structured output: a request whose grammar has not compiled after this many seconds fails with
    InvalidRequestError (the first structured request's tokenizer loading does not count)."""
    async_scheduling: bool = True
    """Overlap the core's scheduling of step N+1 with the workers' step N (outputs stay token-exact; some steps
    still run synchronously, see docs/scheduling.md); False runs every step synchronously."""
    stream_interval: int = 1
    """vLLM's: a stream's deltas carry this many tokens (its first token and its last ones come at once); above 1
    the host wakes each stream's consumer that many times less often (docs/sampling.md)."""

    def __post_init__(self) -> None:
        _int("max_num_seqs", self.max_num_seqs, 1)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        _bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        _choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        _int("max_num_queued_requests", self.max_num_queued_requests, 1, optional=True)
        _int("max_num_queued_tokens", self.max_num_queued_tokens, 1, optional=True)
        _float("structured_output_compile_timeout_s", self.structured_output_compile_timeout_s, 0.0, 86400.0,
               lo_open=True)
        _bool("async_scheduling", self.async_scheduling)
        self.speculative  # noqa: B018 - validates speculative_config
        _int("stream_interval", self.stream_interval, 1)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` read and checked; None when off."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Worker processes the model is sharded across (NCCL on GPU, gloo on CPU)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages: the decoder layers split over this many stages of tensor_parallel_size workers each
    (vLLM's split): it fits a model too big for one device; with async_scheduling the stages run that many
    micro-batches of disjoint requests at once (docs/parallelism.md)."""
    data_parallel_size: int = 1
    """Engine replicas: N engine cores, each with its own tensor_parallel_size x pipeline_parallel_size workers (on
    CUDA replica i uses devices i*w .. (i+1)*w-1, w those workers); requests go to the least loaded one
    (docs/parallelism.md)."""
    enable_expert_parallel: bool = False
    """MoE models: each TP rank holds a 1/tp share of the experts whole, instead of a 1/tp slice of every
    expert (docs/moe.md); a dense model refuses it. Not with data_parallel_size > 1 (not built yet)."""

    def __post_init__(self) -> None:
        _int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        _int("pipeline_parallel_size", self.pipeline_parallel_size, 1, 64)
        _int("data_parallel_size", self.data_parallel_size, 1, 64)
        _bool("enable_expert_parallel", self.enable_expert_parallel)
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            raise NotBuiltError("enable_expert_parallel", True, "expert parallelism with data_parallel_size > 1 "
                                "(experts sharded over dp x tp ranks; without enable_expert_parallel each replica "
                                "holds every expert, docs/parallelism.md)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


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
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
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
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 768:
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
    """weights: the decoder sharded, the (small) vision tower replicated, every rank encodes every image; data: each
    rank encodes a share of a step's images and the features are all-gathered."""
    mm_max_image_pixels: int = 16_777_216
    """Largest image accepted (width x height, read from its header before decoding)."""
    mm_encoder_cache_gb: float = 0.5
    """GiB of encoder outputs kept per worker across requests (by image hash); 0 keeps them only during a prefill."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Overrides of the checkpoint's image processor settings, e.g. ``{"max_pixels": 1003520}`` for Qwen2-VL."""
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    """vLLM's media loading settings per modality: ``{"video": {"num_frames": 32}}``, the frames taken (evenly
    spaced) from an encoded video file; None: 32."""
    limit_mm_per_prompt: dict[str, int] | None = None
    """Most inputs per prompt of each modality, e.g. ``{"image": 4, "video": 1}``; 0 refuses that modality (all 0 on
    Gemma 3: its text decoder alone). None: no limit."""

    def __post_init__(self) -> None:
        _float("mm_processor_cache_gb", self.mm_processor_cache_gb, 0.0, 1024.0)
        _choice("mm_processor_cache_type", self.mm_processor_cache_type, ("lru", "shm"))
        _choice("mm_encoder_tp_mode", self.mm_encoder_tp_mode, ("weights", "data"))
        _int("mm_max_image_pixels", self.mm_max_image_pixels, 1)
        _float("mm_encoder_cache_gb", self.mm_encoder_cache_gb, 0.0, 1024.0)
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise ConfigError("mm_processor_kwargs", self.mm_processor_kwargs, "a dict of image processor settings")
        _check_mm_limits(self.limit_mm_per_prompt)
        _check_media_io(self.media_io_kwargs)

    @property
    def video_num_frames(self) -> int:
        """Frames sampled from an encoded video file."""
        return int(((self.media_io_kwargs or {}).get("video") or {}).get("num_frames", 32))


@dataclass(frozen=True)
class ObservabilityConfig:
    disable_log_stats: bool = False
    """Turn off the periodic stats log line."""
    log_stats_interval: float = 10.0
    """Seconds between two stats log lines."""
    prometheus_registry: Any = None
    """A prometheus_client CollectorRegistry for the engine's metrics; None = a private one (`engine.metrics_registry`)."""

    def __post_init__(self) -> None:
        _bool("disable_log_stats", self.disable_log_stats)
        _float("log_stats_interval", self.log_stats_interval, 0.0, 86400.0, lo_open=True)
        if self.prometheus_registry is not None:
            _registry("prometheus_registry", self.prometheus_registry)


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    """Serve LoRA adapters: a request's ``lora_request`` names its adapter (docs/lora.md)."""
    max_loras: int = 1
    """Adapters in one batch: the workers hold this many adapter slots; a request whose adapter would be
    one more waits for a step with room."""
    max_lora_rank: int = 16
    """Largest adapter rank: the slots' size (a request whose adapter has a higher rank is refused)."""
    max_cpu_loras: int | None = None
    """Adapters each worker keeps in CPU memory after reading them (None: max_loras); at least max_loras."""

    def __post_init__(self) -> None:
        _bool("enable_lora", self.enable_lora)
        _int("max_loras", self.max_loras, 1)
        _int("max_lora_rank", self.max_lora_rank, 1, 512)
        if self.max_cpu_loras is not None:
            _int("max_cpu_loras", self.max_cpu_loras, self.max_loras)

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class FaultToleranceConfig:
    """What the engine does when a worker or the engine core fails (docs/reliability.md)."""

    worker_step_timeout_s: float | None = 300.0
    """Watchdog: a step the workers have not finished after this many seconds counts as a worker failure
    (restart and replay, as for a dead worker); None = no watchdog (a first step may compile for minutes)."""
    max_worker_restarts: int = 3
    """Worker restarts within 10 minutes before the engine fails (every stream gets EngineDeadError); 0 = fail-stop."""
    max_core_restarts: int = 0
    """The host restarts a dead engine core this many times within 10 minutes (its in-flight requests fail,
    new ones are served); 0 = no supervisor, a dead core ends the engine."""

    def __post_init__(self) -> None:
        if self.worker_step_timeout_s is not None:
            _float("worker_step_timeout_s", self.worker_step_timeout_s, 0.0, 86400.0, lo_open=True)
        _int("max_worker_restarts", self.max_worker_restarts, 0, 1000)
        _int("max_core_restarts", self.max_core_restarts, 0, 1000)


_SECTIONS = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "multimodal_config": MultiModalConfig,
    "observability_config": ObservabilityConfig,
    "lora_config": LoRAConfig,
    "fault_tolerance_config": FaultToleranceConfig,
}
_FIELD_TO_SECTION = {f.name: name for name, cls in _SECTIONS.items() for f in fields(cls)}
_HOST_ONLY_FIELDS = ("prometheus_registry",)


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine configuration; build it with `EngineConfig.create(model, **fields)`."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    fault_tolerance_config: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self) -> None:
        check_pipeline_config(self)  # combinations across sections not built with pipeline parallelism

    @classmethod
    def create(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """Distribute flat vLLM-style keyword fields over the sections."""
        per_section: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        per_section["model_config"]["model"] = model
        for key, value in kwargs.items():
            section = _FIELD_TO_SECTION.get(key)
            if section is None or key == "model":
                raise ConfigError(key, value, "a known EngineConfig field (see docs/configuration.md)")
            per_section[section][key] = value
        return cls(**{name: _SECTIONS[name](**values) for name, values in per_section.items()})

    def __getattr__(self, name: str) -> Any:
        section = _FIELD_TO_SECTION.get(name)
        if section is None:
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, section), name)

    def replace(self, **kwargs: Any) -> "EngineConfig":
        """A copy with some flat fields changed (validated again)."""
        flat = self.to_dict()
        flat.update(kwargs)
        return EngineConfig.create(**flat)

    def to_dict(self, wire: bool = False) -> dict[str, Any]:
        """Flat field -> value; `wire=True` leaves out host-only objects."""
        flat = {}
        for name in _SECTIONS:  # shallow: a host-only object (a registry) must not be deep-copied
            section = getattr(self, name)
            flat.update({f.name: getattr(section, f.name) for f in fields(section)})
        if wire:
            for key in _HOST_ONLY_FIELDS:
                flat.pop(key, None)
        return flat

    @classmethod
    def from_dict(cls, flat: dict[str, Any]) -> "EngineConfig":
        flat = dict(flat)
        return cls.create(flat.pop("model"), **flat)

    # ---- values derived once the model is known (the host resolves them)
    @property
    def resolved_max_num_batched_tokens(self) -> int:
        """The step token budget: the field, else vLLM's defaults."""
        sched = self.scheduler_config
        if sched.max_num_batched_tokens is not None:
            return sched.max_num_batched_tokens
        if sched.enable_chunked_prefill:
            return max(8192, sched.max_num_seqs)
        return max(self.model_config.max_model_len or 8192, sched.max_num_seqs)
