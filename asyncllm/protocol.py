"""Every message that crosses a process boundary, as msgspec Structs.

host <-> engine core (zmq DEALER/ROUTER) and engine core <-> workers
(shared-memory broadcast down, zmq back up). Tagged unions so one decoder per
socket direction validates every frame; no pickle anywhere.

This module holds the host <-> core messages and re-exports the rest, so
``protocol.X`` names every message: the core <-> worker step messages and the
payloads they share with the host's (asyncllm/protocol_worker.py), the weight
update and sleep mode calls and typed errors on the wire
(asyncllm/protocol_control.py). A tag is its class's name, whatever the module.
`wire_protocol()` fingerprints the host <-> core messages' shapes: a core refuses a host of another.
"""

from __future__ import annotations

import enum
import functools
import hashlib
from typing import Any, Union

import msgspec

from asyncllm.lora import LoRARequest
from asyncllm.pooling import PoolingParams
from asyncllm.protocol_control import (_STRUCT, AddLoRA, AwaitWeights, LoRAAdded, LoRAPinned, LoRARemoved, PinLoRA,
                                       RemoveLoRA, Sleep, SleepModeDone, UpdateWeights, WakeUp, WeightsUpdated,
                                       WeightTensor, call_error, call_error_fields, config_error_from_parts,
                                       config_error_parts, worker_failure)
from asyncllm.protocol_worker import (CachedRequestData, CacheReady, FirstStageReport, GrammarBitmask, InitCache,
                                      JoinRendezvous, LogprobsArrays, ModelRunnerOutput, MultiModalItem,
                                      NewRequestData, PromptEmbeds, RendezvousOpened, SchedulerOutput, ShutdownWorker,
                                      WorkerCommand, WorkerError, WorkerMessage, WorkerReady)
from asyncllm.sampling import SamplingParams

__all__ = [
    # host -> core
    "Hello", "AddRequest", "AbortRequests", "Goodbye", "ResetPrefixCache", "Heartbeat", "HostMessage",
    # core -> host
    "SchedulerStats", "Ready", "EngineCoreEventType", "EngineCoreEvent", "RequestOutputDelta", "Outputs",
    "EngineFailed", "CoreMessage",
    # both ways
    "wire_protocol", "wire_protocol_mismatch",
    # asyncllm/protocol_worker.py
    "PromptEmbeds", "MultiModalItem", "LogprobsArrays", "NewRequestData", "CachedRequestData", "SchedulerOutput",
    "GrammarBitmask", "InitCache", "ShutdownWorker", "JoinRendezvous", "WorkerCommand", "RendezvousOpened",
    "WorkerReady", "CacheReady", "ModelRunnerOutput", "FirstStageReport", "WorkerError", "WorkerMessage",
    # asyncllm/protocol_control.py
    "WeightTensor", "UpdateWeights", "AwaitWeights", "Sleep", "WakeUp", "WeightsUpdated", "SleepModeDone",
    "AddLoRA", "LoRAAdded", "RemoveLoRA", "LoRARemoved", "PinLoRA", "LoRAPinned", "config_error_parts",
    "config_error_from_parts", "call_error_fields", "call_error", "worker_failure",
]


# ---------------------------------------------------------------- host -> core
class Hello(msgspec.Struct, **_STRUCT):
    """First frame of a host: registers its DEALER identity with the core."""

    pid: int
    mm_shm_ring: str = ""
    """The host's shared-memory processor cache segment (mm_processor_cache_type="shm"), for the core to map."""
    wire_protocol: str = ""
    """The host's `wire_protocol()`; "" (a host from before the check) matches no core."""
    process_identity: str = ""
    """The host's machine, pid namespace and process start time (`client_liveness.process_identity`): a core on
    the same machine notices the host die without a `Goodbye`; "" (a handshake, off Linux): not watched."""
    heartbeat_interval_s: float = 0.0
    """The host sends a `Heartbeat` this often (a host attached over tcp://): a core with
    `host_heartbeat_timeout_s` detaches it once it is silent that long; 0: it sends none and is not timed out."""
    probe: bool = False
    """`AsyncEngine.connect`'s handshake (asyncllm/engine/connect.py), asking what the core serves: answered with a
    `Ready`, never registered as a host (a probe killed before its `Goodbye` would stay one for good)."""


class AddRequest(msgspec.Struct, **_STRUCT):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    """Mixed into the first block's hash: requests with different salts never share cached KV."""
    timeout: float | None = None
    """Seconds after the core receives this message at which it ends the request with finish_reason "timeout"."""
    mm_items: list[MultiModalItem] = []
    """Images of the prompt, in prompt order (asyncllm/mm/; empty for text prompts)."""
    num_samples: int = 1
    """The core requests the queue's limits count this one as (`check_queue_capacity`): an n > 1 request's n on its
    sample 0, which is checked once for all its samples; 0 on its other samples, queued with sample 0 (when sample 0
    is refused, the core refuses them too: asyncllm/engine/sample_groups.py)."""
    lora: LoRARequest | None = None
    """The request's adapter, checked by the host (``lora_path`` a local folder); None: the base model."""
    pooling: PoolingParams | None = None
    """An embedding request (`AsyncEngine.embed`): the worker returns the pooled hidden state with its token."""
    prompt_embeds: PromptEmbeds | None = None
    """A prompt given as embeddings (``enable_prompt_embeds``): ``prompt_token_ids`` are placeholders."""
    admission_group: str = ""
    """The admission group the request belongs to ("": none), "NAME/SIZE", the name unique to its host: a group
    that found the queue empty may pass its limits by SIZE requests (`asyncllm.sched.admission.AdmissionGroups`)."""


class AbortRequests(msgspec.Struct, **_STRUCT):
    request_ids: list[str]


class Goodbye(msgspec.Struct, **_STRUCT):
    """The host is leaving: abort its requests; `shutdown` stops the core too."""

    shutdown: bool = False


class ResetPrefixCache(msgspec.Struct, **_STRUCT):
    """Forget every prefix-cache entry (vLLM's reset_prefix_cache): requests the core handles after this
    message hit nothing computed before it. Running requests keep their blocks."""


class Heartbeat(msgspec.Struct, **_STRUCT):
    """A host attached over tcp:// is alive (sent every `Hello.heartbeat_interval_s`); the core answers one from a
    host it detached with `EngineFailed`."""


HostMessage = Union[Hello, AddRequest, AbortRequests, Goodbye, ResetPrefixCache, UpdateWeights, AwaitWeights, Sleep,
                    WakeUp, AddLoRA, RemoveLoRA, PinLoRA, Heartbeat]


# ---------------------------------------------------------------- core -> host
class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_gpu_blocks: int = 0
    num_used_blocks: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cpu_prefix_cache_hits: int = 0
    """Of ``prefix_cache_hits``, the tokens loaded back from the CPU tier (kv_offloading_size)."""
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps_total: int = 0
    num_waiting_tokens: int = 0
    """Known tokens of the waiting requests (admission control's max_num_queued_tokens)."""
    num_swapped_total: int = 0
    """Preemptions that swapped the victim's KV to the CPU (the others recomputed)."""
    mm_encoder_cache_queries: int = 0
    """Images the workers looked up in their encoder cache (reached by a prefill)."""
    mm_encoder_cache_hits: int = 0
    """Images found there: the vision tower ran queries - hits times."""
    max_lora: int = 0
    """max_loras when the engine serves LoRA adapters (0: enable_lora off)."""
    running_lora_adapters: list[str] = []
    """Names of the adapters of the running requests (sorted; LoRA on only)."""
    waiting_lora_adapters: list[str] = []
    """Names of the adapters of the waiting requests (sorted; LoRA on only)."""
    spec_decode_num_drafts: int = 0
    """Speculative decoding: request-steps that carried drafts (asyncllm/spec/stats.py)."""
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = []
    """Drafts accepted at each draft position (num_speculative_tokens entries; speculative decoding on only)."""
    weights_version: int = 0
    """Successful weight updates of this core (`UpdateWeights`; docs/weight-updates.md)."""
    sleep_level: int = 0
    """The level of the last `Sleep` while any part (weights, KV cache) still sleeps; 0: awake (docs/sleep-mode.md)."""
    awaiting_weights: bool = False
    """Woken after a level-2 sleep with no `UpdateWeights` since: no step runs until one succeeds."""
    preempted_prefix_cache_hits: int = 0
    """Tokens preempted requests found again in the prefix cache at their readmission (not in `prefix_cache_hits`)."""
    host_samples_queued: int = 0
    """Per host (each host's `Outputs` carry its own): the samples (`AddRequest.num_samples`) of the requests of this
    host the core queued or parked so far, counted from 0 by each core process; its admission estimate counts its
    submissions past them (asyncllm/engine/admission.py)."""
    prefix_cache_requests: int = 0
    """Requests whose admission looked up the prefix cache (``prefix_cache_queries`` counts their tokens)."""

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_gpu_blocks if self.num_gpu_blocks else 0.0


class Ready(msgspec.Struct, **_STRUCT):
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    core_pid: int
    model: str = ""
    """The model as the core's launcher named it (`asyncllm engine MODEL`'s MODEL, not the folder it resolved to:
    the bundled model's `asyncllm-tiny`; an owned core's host's label): an attached host labels its metrics and
    spans with it (`AsyncEngine.connect`), as the launcher's host would. ("": a core that names none.)"""
    tokenizer: str = ""
    """Unused, as `revision`, `max_lora_rank` and `max_loras` (`config` holds them): kept so that `wire_protocol`
    stays where an older host reads it, and refuses this core cleanly."""
    revision: str | None = None
    mm_shm_ring_mapped: bool = False
    """The core mapped the ring named in the host's Hello (False: the host sends image data inline)."""
    max_lora_rank: int = 0
    max_loras: int = 1
    wire_protocol: str = ""
    """The core's `wire_protocol()`; "" (a core from before the check) matches no host."""
    config: dict[str, Any] = {}
    """The core's `EngineConfig.to_dict(wire=True)` (its model folder, fitted max_model_len, ...): a host that
    attaches (`AsyncEngine.connect`) takes it, with its own `HOST_SIDE_FIELDS` on top (asyncllm/engine/connect.py)."""


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request in the core (see `EngineCoreEvent`)."""

    QUEUED = 1
    SCHEDULED = 2
    """Admitted into the running batch (first time, or again after a preemption)."""
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True):
    """A timestamped scheduling event; rides on the request's next `RequestOutputDelta`."""

    type: EngineCoreEventType
    timestamp: float
    """time.time() in the engine core."""


class RequestOutputDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request.

    ``gc=False``: one is made per running request per step, and its fields never
    point back at it, so the cycle collector need not track it (half the cost).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    """Set when the core rejected the request ("field: why")."""
    error_type: str = "InvalidRequestError"
    """The asyncllm.errors class of `error`."""
    logprobs: LogprobsArrays | None = None
    """One row per new token, when the request asked for logprobs."""
    prompt_logprobs: LogprobsArrays | None = None
    """Rows for prompt tokens computed this step, when the request asked for prompt_logprobs."""
    events: list[EngineCoreEvent] | None = None
    """Scheduling events since the request's previous delta (None on most deltas)."""
    embedding: bytes | None = None
    """An embedding request's embedding: little-endian float32 (`ModelRunnerOutput.embeddings`)."""


class Outputs(msgspec.Struct, **_STRUCT):
    outputs: list[RequestOutputDelta]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    stats_reporter: bool = False
    """True for the one host that exports the engine-wide metrics, so hosts sharing a core report them once."""
    token_req_ids: list[str] = []
    """Requests whose only news is one new token (the decode steady state), parallel to `token_ids`:
    each is the delta ``RequestOutputDelta(token_req_ids[i], [token_ids[i]])`` (asyncllm/sched/step_outputs.py)."""
    token_ids: list[int] = []


class EngineFailed(msgspec.Struct, **_STRUCT):
    """The core is going down; `error_type` names the asyncllm.errors class."""

    error_type: str
    message: str
    config_error: list[str] = []
    """[field, value repr, allowed] when error_type is ConfigError ([field, value repr, feature, where]:
    NotBuiltError)."""


CoreMessage = Union[Ready, Outputs, EngineFailed, WeightsUpdated, SleepModeDone, LoRAAdded, LoRARemoved, LoRAPinned]


# ---------------------------------------------------------------- both ways
_DOC_KEYS = frozenset({"title", "description", "examples"})


@functools.cache
def wire_protocol() -> str:
    """This install's host <-> core wire protocol: a short hash of msgspec's JSON schema of `HostMessage` and
    `CoreMessage`, every nested struct included (SamplingParams, MultiModalItem, ...), docstrings left out.

    Array-like structs are decoded by position: a field inserted mid-struct misreads every request of a host and a
    core of different asyncllm versions, so each refuses the other at `Hello` / `Ready` (`wire_protocol_mismatch`).
    Computed once per process, on first use (a few ms). `WIRE_REVISION` is in it too: a change of meaning the
    schema does not show (an id's format or bound, an error type's name) bumps it by hand. So is `EngineConfig`'s
    schema (`_config_schema`): `Ready.config` is a plain dict, read by `EngineConfig.from_dict` on the host.
    """
    return _fingerprint((HostMessage, CoreMessage))


WIRE_REVISION = 1
"""Bumped when the messages' meaning changes without their shape (1: core ids ``<id>#<k>``, 2026-11-30)."""


def _fingerprint(messages: tuple[Any, ...], config_schema: dict[str, list[list[str]]] | None = None) -> str:
    schemas, structs = msgspec.json.schema_components(messages)
    shape = {"messages": _shape(list(schemas)), "structs": {name: _shape(s) for name, s in structs.items()},
             "revision": WIRE_REVISION, "config": _config_schema() if config_schema is None else config_schema}
    return hashlib.sha256(msgspec.json.encode(shape, order="sorted")).hexdigest()[:16]


def _config_schema() -> dict[str, list[list[str]]]:
    """`EngineConfig`'s sections, each its fields' [name, annotation] in order, and the keys of its
    `speculative_config` dict (`SpeculativeConfig`'s): what `Ready.config` carries."""
    from dataclasses import fields

    from asyncllm.config import _SECTIONS  # here: asyncllm.config is not needed to decode messages
    from asyncllm.spec.config import SpeculativeConfig

    sections = {**_SECTIONS, "speculative_config": SpeculativeConfig}
    return {name: [[f.name, str(f.type)] for f in fields(section)] for name, section in sections.items()}


def _shape(schema: Any) -> Any:
    """`schema` without its docs; the keys of ``properties`` are field names, kept (a field may be named "title")."""
    if isinstance(schema, dict):
        return {key: {name: _shape(s) for name, s in value.items()} if key == "properties" else _shape(value)
                for key, value in schema.items() if key not in _DOC_KEYS}
    if isinstance(schema, list):
        return [_shape(item) for item in schema]
    return schema


def wire_protocol_mismatch(host: str, core: str) -> str | None:
    """Why a host of wire protocol `host` and a core of `core` cannot talk (an EngineDeadError's message); None: they
    can."""
    if host == core:
        return None
    return (f"the host and the engine core run different asyncllm wire protocols (host {host or 'unknown: older'}, "
            f"core {core or 'unknown: older'}): upgrade or restart both, so that they run the same asyncllm "
            "(a standalone `asyncllm engine` is restarted with the hosts' install)")
