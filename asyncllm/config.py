"""`EngineConfig`: one frozen object made of small frozen sections.

Field names follow vLLM's so that users can move over without a dictionary.
Every section validates itself in ``__post_init__`` and raises `ConfigError`
naming the field, the value and what is allowed; a field whose feature is not
built yet raises `NotBuiltError` (a `ConfigError`) naming the feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from asyncllm.attention.availability import check_backend_available
from asyncllm.config_checks import check_bool, check_choice, check_float, check_int, check_registry
from asyncllm.config_model import ModelConfig, MultiModalConfig
from asyncllm.config_scheduler import SchedulerConfig
from asyncllm.config_scheduler import default_max_num_seqs as default_max_num_seqs  # re-exported: asyncllm/bench
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.pipeline_parallel import check_pipeline_config

__all__ = [
    "EngineConfig",
    "HOST_SIDE_FIELDS",
    "check_host_side",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "MultiModalConfig",
    "ObservabilityConfig",
    "LoRAConfig",
    "FaultToleranceConfig",
]

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
"""auto = the model dtype; bfloat16 / float16 = that dtype, which must be the model's; fp8 and fp8_e4m3 =
float8_e4m3fn; fp8_e5m2 = float8_e5m2 (docs/fp8-kv-cache.md)."""
UNBUILT_KV_CACHE_DTYPES = ("int8", "fp8_inc", "fp8_ds_mla")
"""vLLM's other `kv_cache_dtype` values: `NotBuiltError` (int8 with per-head scales, Intel Gaudi's fp8, DeepSeek's
packed MLA cache)."""
UNBUILT_HASH_ALGOS = ("sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM's other `prefix_caching_hash_algo` values: `NotBuiltError` (asyncllm/kv/hashing.py hashes with sha256)."""
NONE_IS_DEFAULT = frozenset({"seed", "block_size", "enable_prefix_caching", "enable_chunked_prefill",
                             "async_scheduling", "preemption_mode"})
"""Fields vLLM's EngineArgs types Optional with None meaning "the default" (``seed=args.seed`` passed through):
None given for one of them is its default here too (`EngineConfig.create`), not a ConfigError."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights, activations, KV cache); ignored on the CPU
    (ASYNCLLM_CPU_KVCACHE_SPACE_GB)."""
    num_gpu_blocks_override: int | None = None
    """Use exactly this many KV blocks instead of sizing from memory."""
    kv_cache_memory_bytes: int | None = None
    """vLLM's: bytes of KV cache per rank (the draft model's included), instead of what gpu_memory_utilization
    leaves after a profile step (on the CPU: instead of ASYNCLLM_CPU_KVCACHE_SPACE_GB); num_gpu_blocks_override
    wins over it."""
    kv_cache_dtype: str = "auto"
    """auto = the model dtype (bfloat16 / float16: vLLM's names of it, for a model of that dtype); fp8 / fp8_e4m3
    (float8_e4m3fn) or fp8_e5m2 (float8_e5m2): K and V stored in one byte each with the checkpoint's calibrated
    per-layer scales, else 1.0; twice the blocks of bfloat16 (docs/fp8-kv-cache.md). vLLM's int8, fp8_inc and
    fp8_ds_mla are not built."""
    calculate_kv_scales: bool = False
    """vLLM's: False (its default) takes an fp8 cache's k_scale / v_scale from the checkpoint, else 1.0; True (scales
    computed from the first batch's keys and values) is not built."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    prefix_caching_hash_algo: str = "sha256"
    """vLLM's: the hash naming prefix-cache blocks; sha256 (asyncllm's own pickle-free encoding of the tokens, so not
    vLLM's digests); vLLM's sha256_cbor, xxhash and xxhash_cbor are not built."""
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
        check_choice("block_size", self.block_size, BLOCK_SIZES)
        check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1, optional=True)
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        if self.kv_cache_dtype in UNBUILT_KV_CACHE_DTYPES:
            raise NotBuiltError("kv_cache_dtype", self.kv_cache_dtype, f"vLLM's {self.kv_cache_dtype} KV cache "
                                                                       f"(built: {', '.join(map(repr, KV_CACHE_DTYPES))})")
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_bool("calculate_kv_scales", self.calculate_kv_scales)
        if self.calculate_kv_scales:
            raise NotBuiltError("calculate_kv_scales", True,
                                "fp8 KV-cache scales computed from the first batch (asyncllm reads a checkpoint's "
                                "calibrated k_scale / v_scale, else uses 1.0: docs/fp8-kv-cache.md)")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_choice("prefix_caching_hash_algo", self.prefix_caching_hash_algo, ("sha256", *UNBUILT_HASH_ALGOS))
        algo = self.prefix_caching_hash_algo
        if algo in UNBUILT_HASH_ALGOS:
            raise NotBuiltError("prefix_caching_hash_algo", algo,
                                f"prefix-cache hashing with {algo} (asyncllm hashes with sha256)")
        check_float("swap_space", self.swap_space, 0.0, 1024.0)
        check_float("kv_offloading_size", self.kv_offloading_size, 0.0, 1 << 20)
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ConfigError("kv_offloading_size", self.kv_offloading_size, "0 with enable_prefix_caching=False "
                                                                             "(the CPU tier holds prefix-cache blocks)")
        check_int("mamba_block_size", self.mamba_block_size, 1)
        check_int("mamba_checkpoint_slots", self.mamba_checkpoint_slots, 0)
        if self.mamba_block_size % self.block_size:
            raise ConfigError("mamba_block_size", self.mamba_block_size, f"a multiple of block_size={self.block_size}")


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
    (docs/parallelism.md). `asyncllm serve` only: `asyncllm engine` refuses it (not built)."""
    enable_expert_parallel: bool = False
    """MoE models: each TP rank holds a 1/tp share of the experts whole, instead of a 1/tp slice of every
    expert (docs/moe.md); a dense model refuses it. Not with data_parallel_size > 1 (not built yet)."""

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1, 64)
        check_int("data_parallel_size", self.data_parallel_size, 1, 64)
        check_bool("enable_expert_parallel", self.enable_expert_parallel)
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            raise NotBuiltError("enable_expert_parallel", True, "expert parallelism with data_parallel_size > 1 "
                                "(experts sharded over dp x tp ranks; without enable_expert_parallel each replica "
                                "holds every expert, docs/parallelism.md)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size



@dataclass(frozen=True)
class ObservabilityConfig:
    disable_log_stats: bool = False
    """Turn off the periodic stats log line."""
    log_stats_interval: float = 10.0
    """Seconds between two stats log lines."""
    prometheus_registry: Any = None
    """A prometheus_client CollectorRegistry for the engine's metrics; None = a private one (`engine.metrics_registry`)."""

    def __post_init__(self) -> None:
        check_bool("disable_log_stats", self.disable_log_stats)
        check_float("log_stats_interval", self.log_stats_interval, 0.0, 86400.0, lo_open=True)
        if self.prometheus_registry is not None:
            check_registry("prometheus_registry", self.prometheus_registry)


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
        check_bool("enable_lora", self.enable_lora)
        check_int("max_loras", self.max_loras, 1)
        check_int("max_lora_rank", self.max_lora_rank, 1, 512)
        if self.max_cpu_loras is not None:
            check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras)

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
    host_heartbeat_timeout_s: float | None = 30.0
    """A core detaches a host attached over tcp:// that sent nothing, not even its heartbeat (every second), for
    this many seconds (a dead machine, a lost network): its requests are aborted; None = only its Goodbye
    detaches it. A shared core's (`asyncllm engine`) setting; hosts on its machine are watched by pid besides."""

    def __post_init__(self) -> None:
        if self.worker_step_timeout_s is not None:
            check_float("worker_step_timeout_s", self.worker_step_timeout_s, 0.0, 86400.0, lo_open=True)
        if self.host_heartbeat_timeout_s is not None:  # several heartbeats: one late beat is no death
            check_float("host_heartbeat_timeout_s", self.host_heartbeat_timeout_s, 3.0, 86400.0)
        check_int("max_worker_restarts", self.max_worker_restarts, 0, 1000)
        check_int("max_core_restarts", self.max_core_restarts, 0, 1000)


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
HOST_SIDE_FIELDS = frozenset({"disable_log_stats", "log_stats_interval", "prometheus_registry", "stream_interval",
                              "max_core_restarts", "mm_processor_cache_type", "mm_processor_cache_gb"})
"""Fields each host attached to a shared core (`AsyncEngine.connect`, ``asyncllm serve --connect``) may set for
itself: its stats log, metrics, stream pacing, core supervisor and processor cache; the core's value is their default.
Every other field is core-side: an attached host takes the core's value, sent in its `Ready`."""


def check_host_side(kwargs: dict[str, Any]) -> None:
    """`ConfigError` naming the core-side fields among `kwargs`, given to a host that attaches to a shared core."""
    core_side = sorted(key for key in kwargs if key in _FIELD_TO_SECTION and key not in HOST_SIDE_FIELDS)
    if core_side:
        given = ", ".join(f"{key}={kwargs[key]!r}" for key in core_side)
        raise ConfigError(core_side[0], kwargs[core_side[0]], "core-side fields are the shared core's (give them to "
                          "`asyncllm engine`): a host that attaches takes the core's values and may set only "
                          f"{', '.join(sorted(HOST_SIDE_FIELDS))}", value_repr=given[len(core_side[0]) + 1:])


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
        kv, dtype = self.cache_config.kv_cache_dtype, self.model_config.dtype
        if kv in ("bfloat16", "float16") and dtype not in ("auto", kv):  # auto: checked at load (kv_cache_torch_dtype)
            raise NotBuiltError("kv_cache_dtype", kv, f"a {kv} KV cache under a {dtype} model (a cache of another "
                                                      "dtype than the model's)")

    @classmethod
    def create(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """Distribute flat vLLM-style keyword fields over the sections (and check this machine can run them)."""
        config = cls._create(model, kwargs)
        config._check_machine()
        return config

    @classmethod
    def _create(cls, model: str, kwargs: dict[str, Any]) -> "EngineConfig":
        per_section: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        per_section["model_config"]["model"] = model
        for key, value in kwargs.items():
            section = _FIELD_TO_SECTION.get(key)
            if section is None or key == "model":
                raise ConfigError(key, value, "a known EngineConfig field (see docs/configuration.md)")
            if value is not None or key not in NONE_IS_DEFAULT:  # vLLM's Optional fields: None is the default
                per_section[section][key] = value
        return cls(**{name: _SECTIONS[name](**values) for name, values in per_section.items()})

    def __getattr__(self, name: str) -> Any:
        section = _FIELD_TO_SECTION.get(name)
        if section is None:
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, section), name)

    def _check_machine(self) -> None:
        """The core's checks of the machine it runs on: the attention backend's package is installed. A host attached
        to a core skips them (`from_dict(from_core=True)`): the core checked them on its machine, and the host runs no
        attention."""
        if self.attention_backend is not None:
            check_backend_available(self.attention_backend)

    def replace(self, **kwargs: Any) -> "EngineConfig":
        """A copy with some flat fields changed (validated again; the machine checked again for those fields)."""
        flat = self.to_dict()
        derived = flat["max_num_seqs"] == default_max_num_seqs(flat["max_num_batched_tokens"])
        if derived and "max_num_seqs" not in kwargs:  # unset (its default): derived again from the budget it may change
            flat["max_num_seqs"] = None
        flat.update(kwargs)
        config = EngineConfig._create(flat.pop("model"), flat)
        if "attention_backend" in kwargs:
            config._check_machine()
        return config

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
    def from_dict(cls, flat: dict[str, Any], from_core: bool = False) -> "EngineConfig":
        """The config of `to_dict`; ``from_core``: a core's, taken by a host attached to it, which skips the core's
        checks of its own machine (`_check_machine`)."""
        flat = dict(flat)
        config = cls._create(flat.pop("model"), flat)
        if not from_core:
            config._check_machine()
        return config

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
