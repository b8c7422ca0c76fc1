"""Every message that crosses a process boundary, as msgspec Structs.

host <-> engine core (zmq DEALER/ROUTER) and engine core <-> workers
(shared-memory broadcast down, zmq back up). Tagged unions so one decoder per
socket direction validates every frame; no pickle anywhere.
"""

from __future__ import annotations

from typing import Union

import msgspec

from asyncllm.sampling import SamplingParams

_STRUCT = dict(tag=True, array_like=True, omit_defaults=True)


# ---------------------------------------------------------------- host -> core
class Hello(msgspec.Struct, **_STRUCT):
    """First frame of a host: registers its DEALER identity with the core."""

    pid: int


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
    """Seconds after arrival at which the core ends the request with finish_reason "timeout"."""


class AbortRequests(msgspec.Struct, **_STRUCT):
    request_ids: list[str]


class Goodbye(msgspec.Struct, **_STRUCT):
    """The host is leaving: abort its requests; `shutdown` stops the core too."""

    shutdown: bool = False


HostMessage = Union[Hello, AddRequest, AbortRequests, Goodbye]


# ---------------------------------------------------------------- core -> host
class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_gpu_blocks: int = 0
    num_used_blocks: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps_total: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_gpu_blocks if self.num_gpu_blocks else 0.0


class Ready(msgspec.Struct, **_STRUCT):
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    core_pid: int


class RequestOutputDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    """Set when the core rejected the request ("field: why")."""
    error_type: str = "InvalidRequestError"
    """The asyncllm.errors class of `error`."""


class Outputs(msgspec.Struct, **_STRUCT):
    outputs: list[RequestOutputDelta]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineFailed(msgspec.Struct, **_STRUCT):
    """The core is going down; `error_type` names the asyncllm.errors class."""

    error_type: str
    message: str
    config_error: list[str] = []
    """[field, value repr, allowed] when error_type is ConfigError."""


CoreMessage = Union[Ready, Outputs, EngineFailed]


# ------------------------------------------------------------- core -> workers
class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the workers have no state for (new, or resumed after preemption)."""

    req_id: str
    token_ids: list[int]
    """Every known token: the prompt, then outputs already generated (on resume)."""
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the workers know: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct, **_STRUCT):
    """One step, from the scheduler to every worker."""

    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    """Aborted or finished since the last step: workers drop their state."""
    preempted_req_ids: list[str] = []
    """Preempted (recompute) since the last step: workers drop their state."""


class InitCache(msgspec.Struct, **_STRUCT):
    num_gpu_blocks: int


class ShutdownWorker(msgspec.Struct, **_STRUCT):
    pass


WorkerCommand = Union[SchedulerOutput, InitCache, ShutdownWorker]


# ------------------------------------------------------------- workers -> core
class WorkerReady(msgspec.Struct, **_STRUCT):
    rank: int
    num_available_blocks: int
    """Blocks this rank can hold in its memory budget (the core takes the min)."""


class CacheReady(msgspec.Struct, **_STRUCT):
    rank: int


class ModelRunnerOutput(msgspec.Struct, **_STRUCT):
    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """One list per scheduled request; empty for a prefill chunk that samples nothing."""


class WorkerError(msgspec.Struct, **_STRUCT):
    rank: int
    message: str
    error_type: str = ""
    """Class name of the worker's exception, so the core re-raises ConfigError as ConfigError."""
    config_error: list[str] = []
    """[field, value repr, allowed] when the exception is a ConfigError (as in EngineFailed)."""


WorkerMessage = Union[WorkerReady, CacheReady, ModelRunnerOutput, WorkerError]
