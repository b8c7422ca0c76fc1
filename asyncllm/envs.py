"""The few environment variables asyncllm reads, in one typed registry."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        """The variable's value; `ConfigError` naming it when it cannot be parsed."""
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            from asyncllm.errors import ConfigError

            raise ConfigError(self.name, raw, str(exc)) from None


def _positive_finite(raw: str) -> float:
    """A finite number above 0 (``float`` alone takes nan, inf and negatives, which size no cache and time out
    at once or never)."""
    value = float(raw)
    if not 0 < value < float("inf"):  # nan fails both
        raise ValueError("a finite number above 0")
    return value


CPU_KVCACHE_SPACE_GB = EnvVar(
    "ASYNCLLM_CPU_KVCACHE_SPACE_GB", 1.0, _positive_finite,
    "GiB of host memory for the KV cache when running on the CPU (no num_gpu_blocks_override); a finite number "
    "above 0. Read on the host at start (`check_at_start`) and by every worker.",
)
ENGINE_STARTUP_TIMEOUT_S = EnvVar(
    "ASYNCLLM_ENGINE_STARTUP_TIMEOUT_S", 600.0, _positive_finite,
    "Seconds the host waits for the engine core and its workers to load the model; a finite number above 0. "
    "Read on the host at start (`check_at_start`).",
)
RUNTIME_DIR = EnvVar(
    "ASYNCLLM_RUNTIME_DIR", "", str,
    "Parent folder of the private 0700 socket folders (default: the system temp dir).",
)


def _truthy(raw: str) -> bool:
    """A switch read as its owner reads it: 1, true, yes or on (any case) is on, anything else off."""
    return raw.strip().lower() in ("1", "true", "yes", "on")


TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET", False, _truthy,
    "Triton's own switch to run kernels in its CPU interpreter; with it, attention_backend='triton' "
    "is allowed on the CPU (tests only: slow). Read at worker start.",
)
HF_HUB_OFFLINE = EnvVar(
    "HF_HUB_OFFLINE", False, _truthy,
    "huggingface_hub's own switch: a hub id is looked up in the cache only, never downloaded. Read when a model "
    "path is resolved (huggingface_hub reads it once, at its import).",
)
API_KEY = EnvVar(
    "ASYNCLLM_API_KEY", "", str,
    "API key `asyncllm serve` requires as 'Authorization: Bearer KEY' when --api-key is not given; unset: vLLM's "
    "VLLM_API_KEY (`api_key`).",
)
VLLM_API_KEY_NAME = "VLLM_API_KEY"
"""vLLM's key variable, which `asyncllm serve` reads after ASYNCLLM_API_KEY (vLLM: ``args.api_key or VLLM_API_KEY``):
a vLLM deployment that sets its key this way must not serve without one."""


def api_key() -> str:
    """`asyncllm serve`'s key when --api-key is not given: ASYNCLLM_API_KEY, else VLLM_API_KEY, else ''."""
    return API_KEY.get() or os.environ.get(VLLM_API_KEY_NAME, "")
ENGINE_KEY = EnvVar(
    "ASYNCLLM_ENGINE_KEY", "", str,
    "Shared secret of a tcp:// engine address (at least 16 characters; the core and every host set the same): "
    "CURVE keys derived from it encrypt and authenticate the connection (docs/security.md).",
)

_ON_OFF_AUTO = {"1": "on", "true": "on", "yes": "on", "on": "on", "0": "off", "false": "off", "no": "off",
                "off": "off", "auto": "auto"}


def _on_off_auto(raw: str) -> str:
    mode = _ON_OFF_AUTO.get(raw.strip().lower())
    if mode is None:
        raise ValueError(f"expected 1, 0 or auto, got {raw!r}")
    return mode


WORKER_PIPELINE = EnvVar(
    "ASYNCLLM_WORKER_PIPELINE", "auto", _on_off_auto,
    "Whether workers launch a step before the previous one's sampled ids reach the host (docs/scheduling.md, "
    "'Deferred sampled ids'): 'auto' on CUDA only (a CPU computes the step before the launch returns, so there "
    "it would only delay outputs), 1 everywhere (tests), 0 nowhere (comparisons). Read at worker start.",
)


def _step_range(raw: str) -> tuple[int, int]:
    """``START:COUNT`` -> (START, COUNT): the executed steps START (0-based) to START + COUNT - 1."""
    start, sep, count = raw.strip().partition(":")
    if not sep or not start.strip().isdigit() or not count.strip().isdigit() or int(count) < 1:
        raise ValueError(f"expected START:COUNT (START >= 0, COUNT >= 1), got {raw!r}")
    return int(start), int(count)


WORKER_TRACE_STEPS = EnvVar(
    "ASYNCLLM_WORKER_TRACE_STEPS", None, _step_range,
    "START:COUNT: every worker runs torch.profiler (CPU, and CUDA on a GPU) over its executed steps START to "
    "START + COUNT - 1 (0-based, the engine's warm-up steps included) and writes a JSON summary of them to "
    "ASYNCLLM_WORKER_TRACE_DIR (workers/step_trace.py, docs/benchmarks.md); unset: no profiler. Read at worker start.",
)
WORKER_TRACE_DIR = EnvVar(
    "ASYNCLLM_WORKER_TRACE_DIR", "", str,
    "Folder of the worker traces' files (worker-trace-rank{R}-{pid}.json); unset: asyncllm-worker-trace in the "
    "system temp dir. Read when a trace is written.",
)


def _on_off(raw: str) -> bool:
    mode = _ON_OFF_AUTO.get(raw.strip().lower())
    if mode is None or mode == "auto":
        raise ValueError(f"expected 1 or 0, got {raw!r}")
    return mode == "on"


DECODE_LINEAR = EnvVar(
    "ASYNCLLM_DECODE_LINEAR", True, _on_off,
    "1 (the default): on the triton backend at tensor_parallel_size 1, steps of at most 2 tokens run each "
    "Llama-family layer's QKV, output (unless its attention overrides attend), gate-up and down products as "
    "kernels/decode_linear.py, with the norm or "
    "SiLU-and-mul before them fused in (faster than cuBLAS at batch 1 on an H200: docs/kernels.md); 0: the separate "
    "kernels and torch's matmul. Read when a worker builds the model.",
)

PDL = EnvVar(
    "ASYNCLLM_PDL", True, _on_off,
    "1 (the default): on NVIDIA GPUs of compute capability 9.0 and later (Hopper), the decode step's Triton kernels "
    "(the fused decode products, norms, SiLU-and-mul, rotary + KV write, KV write, paged attention) are launched with "
    "programmatic dependent launch, so each is scheduled while the one before it ends (kernels/_pdl.py); 0: plain "
    "launches. Never under Triton's interpreter or on ROCm. Read at a kernel's first launch on a device.",
)

GREEDY_GRAPHS = EnvVar(
    "ASYNCLLM_GREEDY_GRAPHS", True, _on_off,
    "1 (the default): with CUDA graphs on, decode batches of up to 16 requests also get a graph with the model's LM "
    "head and the greedy argmax in it, replayed for steps whose tokens are the argmax (workers/cuda_graphs.py); 0: "
    "the forward graphs only, logits and sampling eager. Read when the graphs are captured.",
)

WORKER_TRACE_CHROME = EnvVar(
    "ASYNCLLM_WORKER_TRACE_CHROME", False, _on_off,
    "1: with ASYNCLLM_WORKER_TRACE_STEPS, each worker also keeps its whole trace as a gzipped Chrome trace "
    "(worker-trace-rank{R}-{pid}.chrome.json.gz; Perfetto or chrome://tracing open it; megabytes); 0: the "
    "summary only. Read when a trace is written.",
)

ALLOW_RUNTIME_LORA_UPDATING = EnvVar(
    "ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING", False, _on_off,
    "1: the OpenAI-compatible server (`asyncllm serve`, create_app) adds vLLM's POST /v1/load_lora_adapter and "
    "/v1/unload_lora_adapter, so API clients load LoRA adapters from the server's disk or the hub while it "
    "serves (trusted clients only); 0: the routes do not exist (404). Read when the app is made.",
)

SERVER_DEV_MODE = EnvVar(
    "ASYNCLLM_SERVER_DEV_MODE", False, _on_off,
    "1: the OpenAI-compatible server adds the development routes: vLLM's POST /reset_prefix_cache (forget the "
    "prefix cache, e.g. between benchmark runs), SGLang's POST /update_weights_from_disk (new weights in place, "
    "docs/weight-updates.md) and vLLM's POST /sleep, POST /wake_up, GET /is_sleeping (docs/sleep-mode.md); 0: they "
    "do not exist (404). Read when the app is made.",
)

ENABLE_RESPONSES_API_STORE = EnvVar(
    "ASYNCLLM_ENABLE_RESPONSES_API_STORE", False, _on_off,
    "1: the OpenAI-compatible server keeps Responses API responses (those made without store: false) in its "
    "process's memory, for GET /v1/responses/{id} and previous_response_id (vLLM's "
    "VLLM_ENABLE_RESPONSES_API_STORE); 0: store is accepted and answered false, nothing is kept. Read when the "
    "app is made.",
)


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


HF_HUB_ETAG_TIMEOUT = EnvVar(
    "HF_HUB_ETAG_TIMEOUT", 10, _positive_int,
    "huggingface_hub's own: seconds a hub id's lookup waits for the hub before its cached snapshot is read instead "
    "(asyncllm/models/hub.py); a whole number above 0 (huggingface_hub reads it with int() at its import, which "
    "transformers' import makes: another value was that import's traceback). Read at start (`check_at_start`) and "
    "when a model path is resolved.",
)

RESPONSES_API_STORE_MAX_ENTRIES = EnvVar(
    "ASYNCLLM_RESPONSES_API_STORE_MAX_ENTRIES", 1000, _positive_int,
    "With ASYNCLLM_ENABLE_RESPONSES_API_STORE=1: the most responses one server process keeps; past it the least "
    "recently used (stored, retrieved or continued) is dropped. Read when the app is made.",
)

MAX_NUM_BAD_WORDS = EnvVar(
    "ASYNCLLM_MAX_NUM_BAD_WORDS", 128, _positive_int,
    "Most bad-word token sequences one request may ban (its bad_words_token_ids plus those the host tokenizes from "
    "bad_words, each word up to two; vLLM's VLLM_MAX_NUM_BAD_WORDS); more is an InvalidRequestError. Read per request.",
)
MAX_BAD_WORDS_TOTAL_TOKENS = EnvVar(
    "ASYNCLLM_MAX_BAD_WORDS_TOTAL_TOKENS", 1024, _positive_int,
    "Most tokens in all of one request's bad-word sequences together (vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS); more "
    "is an InvalidRequestError. Read per request.",
)
XGRAMMAR_CACHE_MB = EnvVar(
    "ASYNCLLM_XGRAMMAR_CACHE_MB", 512, _positive_int,
    "MiB of compiled grammars (xgrammar's memory_size_bytes) the engine core keeps for later requests with the same "
    "structured-output constraint (vLLM's VLLM_XGRAMMAR_CACHE_MB); past it the least recently used go, and a grammar "
    "larger than it is not kept. Read on the host at start (`check_at_start`) and at the core's first structured "
    "request.",
)

PP_LAYER_PARTITION = EnvVar(
    "ASYNCLLM_PP_LAYER_PARTITION", "", str,
    "With pipeline_parallel_size > 1: the decoder layers of each stage, as comma-separated counts (vLLM's "
    "VLLM_PP_LAYER_PARTITION, e.g. '3,5'); unset: vLLM's even split, the remainder to the stages before the last "
    "(docs/parallelism.md); checked with pipeline_parallel_size=1 too (as vLLM). Read on the host at start and by "
    "every worker.",
)

def _logging_level(raw: str) -> int:
    """A logging level by name (DEBUG, INFO, WARNING, ERROR, CRITICAL; any case) or number."""
    name = raw.strip().upper()
    level = int(name) if name.isdigit() else logging.getLevelName(name)  # a known name's number, else a string
    if not isinstance(level, int):
        raise ValueError("a logging level: DEBUG, INFO, WARNING, ERROR, CRITICAL or a number")
    return level


LOGGING_LEVEL = EnvVar(
    "ASYNCLLM_LOGGING_LEVEL", logging.INFO, _logging_level,
    "Level of the engine core's and workers' own stderr logging, and of `asyncllm serve`'s stats and request lines "
    "(vLLM's VLLM_LOGGING_LEVEL); unset: the level the host set on its `asyncllm` logger, else INFO "
    "(docs/observability.md). Read on the host at start (`check_at_start`), at each core and worker start and "
    "when `asyncllm serve` starts.",
)
CONFIGURE_LOGGING = EnvVar(
    "ASYNCLLM_CONFIGURE_LOGGING", True, _on_off,
    "0: the engine core and workers add no stderr handler and set no level, nor does `asyncllm serve` to its stats "
    "and request loggers (vLLM's VLLM_CONFIGURE_LOGGING=0; only Python's last-resort WARNING lines remain); 1 (the "
    "default): they do. Read on the host at start (`check_at_start`), at each core and worker start and when "
    "`asyncllm serve` starts.",
)

FORKSERVER = EnvVar(
    "ASYNCLLM_FORKSERVER", "", str,
    "Path of a running fork server's socket (`python -m asyncllm.forkserver --address PATH`): engine cores and "
    "workers are forked from it with torch already imported instead of started as new interpreters (about a "
    "second less per process on a CPU; the test suite uses it); a caller whose start-up variables differ from the "
    "server's gets a new interpreter. Unset: new interpreters. Read at each start.",
)

REGISTRY = (ALLOW_RUNTIME_LORA_UPDATING, API_KEY, CONFIGURE_LOGGING, CPU_KVCACHE_SPACE_GB, DECODE_LINEAR,
            ENABLE_RESPONSES_API_STORE, ENGINE_KEY, ENGINE_STARTUP_TIMEOUT_S, FORKSERVER, GREEDY_GRAPHS, HF_HUB_ETAG_TIMEOUT,
            HF_HUB_OFFLINE, LOGGING_LEVEL, MAX_BAD_WORDS_TOTAL_TOKENS, MAX_NUM_BAD_WORDS, PDL, PP_LAYER_PARTITION,
            RESPONSES_API_STORE_MAX_ENTRIES,
            RUNTIME_DIR, SERVER_DEV_MODE, TRITON_INTERPRET, WORKER_PIPELINE, WORKER_TRACE_CHROME, WORKER_TRACE_DIR,
            WORKER_TRACE_STEPS, XGRAMMAR_CACHE_MB)
PARENT_PID_NAME = "ASYNCLLM_PARENT_PID"
"""Set by `procutil.spawn_module` in a child's environment, read (and removed) by `procutil.exit_when_parent_dies`."""
CORE_PID_NAME = "ASYNCLLM_CORE_PID"
"""Set by the executor in its workers' environment: the engine core's pid, in the name of a worker's marker while it
writes its step trace (workers/trace_summary.py `writing_marker`), so a host waits for its own core's workers only."""
_SET_BY_ASYNCLLM = frozenset({PARENT_PID_NAME, CORE_PID_NAME})
"""Variables asyncllm sets for its own children (asyncllm/procutil.py), never read from the user."""


def unknown_names(environ: dict[str, str] | None = None) -> list[str]:
    """The ``ASYNCLLM_*`` variables set that asyncllm reads none of (a typo, a vLLM name renamed without its
    suffix), sorted; the test suite's own switches (``ASYNCLLM_TEST_*``) aside."""
    known = {var.name for var in REGISTRY} | _SET_BY_ASYNCLLM
    return sorted(name for name in (os.environ if environ is None else environ)
                  if name.startswith("ASYNCLLM_") and name not in known and not name.startswith("ASYNCLLM_TEST_"))


_VLLM_ONLY_TWINS = {"VLLM_CPU_KVCACHE_SPACE": CPU_KVCACHE_SPACE_GB.name,
                    "VLLM_ATTENTION_BACKEND": "--attention-backend (attention_backend=)"}
"""vLLM's variables whose asyncllm twin is not ``ASYNCLLM_`` + the same suffix (nor named in the twin's doc), or is
a flag."""


def vllm_twins() -> dict[str, str]:
    """vLLM's ``VLLM_*`` name -> the ``ASYNCLLM_*`` variable that does its job: the same suffix, the name a
    variable's doc gives as vLLM's, and `_VLLM_ONLY_TWINS`."""
    twins = {"VLLM_" + var.name.removeprefix("ASYNCLLM_"): var.name for var in REGISTRY
             if var.name.startswith("ASYNCLLM_")}
    twins |= {name: var.name for var in REGISTRY for name in re.findall(r"VLLM_[A-Z0-9_]*[A-Z0-9]", var.doc)}
    return twins | _VLLM_ONLY_TWINS


def unread_vllm_names(environ: dict[str, str] | None = None) -> list[str]:
    """The ``VLLM_*`` variables set that asyncllm does not read (all but VLLM_API_KEY, which serve reads), sorted:
    a deployment moved from vLLM would otherwise believe them applied."""
    return sorted(name for name in (os.environ if environ is None else environ)
                  if name.startswith("VLLM_") and name != VLLM_API_KEY_NAME)


def check_at_start() -> None:
    """At an engine's start, before anything is spawned: warn about the unknown ``ASYNCLLM_*`` variables
    (`warn_unknown`) and parse those the workers read at start, so a bad value is a `ConfigError` naming it here
    rather than a worker's failure."""
    warn_unknown()
    CPU_KVCACHE_SPACE_GB.get()
    ENGINE_STARTUP_TIMEOUT_S.get()
    WORKER_TRACE_STEPS.get()
    WORKER_TRACE_CHROME.get()
    LOGGING_LEVEL.get()
    CONFIGURE_LOGGING.get()
    XGRAMMAR_CACHE_MB.get()
    DECODE_LINEAR.get()
    PDL.get()
    GREEDY_GRAPHS.get()
    WORKER_PIPELINE.get()
    HF_HUB_ETAG_TIMEOUT.get()  # before huggingface_hub's import reads it (a traceback for a value int() refuses)


_WARNED: set[str] = set()
"""The variables `warn_unknown` has warned about in this process: each once, not at every engine start."""


def warn_unknown() -> None:
    """One warning on the ``asyncllm`` logger naming the unknown ``ASYNCLLM_*`` variables (vLLM's "Unknown vLLM
    environment variable detected"): they would otherwise be ignored silently. Each name is warned about once per
    process."""
    names = [name for name in unknown_names() if name not in _WARNED]
    _WARNED.update(names)
    if names:
        logging.getLogger("asyncllm").warning(
            "unknown asyncllm environment variable(s) %s: asyncllm reads none of them (its variables are listed in "
            "docs/configuration.md#environment-variables)", ", ".join(names))
    twins = vllm_twins()
    for name in unread_vllm_names():  # one line each, naming what to set instead
        if name in _WARNED:
            continue
        _WARNED.add(name)
        twin = twins.get(name)
        logging.getLogger("asyncllm").warning(
            "vLLM's environment variable %s is set: asyncllm does not read it (%s)", name,
            f"{'use' if twin.startswith('-') else 'set'} {twin} instead" if twin else "it has no asyncllm counterpart; "
            "docs/configuration.md#environment-variables lists asyncllm's variables")
