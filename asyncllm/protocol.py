"""Every message that crosses a process boundary, as msgspec Structs.

host <-> engine core (zmq DEALER/ROUTER) and engine core <-> workers
(shared-memory broadcast down, zmq back up). Tagged unions so one decoder per
socket direction validates every frame; no pickle anywhere.
"""

from __future__ import annotations

import enum
from typing import Union

import msgspec

from asyncllm.errors import AsyncLLMError, ConfigError, EngineDeadError, InvalidRequestError, NotBuiltError
from asyncllm.lora import LoRARequest
from asyncllm.pooling import PoolingParams
from asyncllm.sampling import SamplingParams

_STRUCT = dict(tag=True, array_like=True, omit_defaults=True)


# ---------------------------------------------------------------- host -> core
class Hello(msgspec.Struct, **_STRUCT):
    """First frame of a host: registers its DEALER identity with the core."""

    pid: int
    mm_shm_ring: str = ""
    """The host's shared-memory processor cache segment (mm_processor_cache_type="shm"), for the core to map."""


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
    mm_items: list["MultiModalItem"] = []
    """Images of the prompt, in prompt order (asyncllm/mm/; empty for text prompts)."""
    lora: LoRARequest | None = None
    """The request's adapter, checked by the host (``lora_path`` a local folder); None: the base model."""
    pooling: PoolingParams | None = None
    """An embedding request (`AsyncEngine.embed`): the worker returns the pooled hidden state with its token."""
    prompt_embeds: "PromptEmbeds | None" = None
    """A prompt given as embeddings (``enable_prompt_embeds``): ``prompt_token_ids`` are placeholders."""


class PromptEmbeds(msgspec.Struct, array_like=True, omit_defaults=True):
    """A prompt's input embeddings, ``[tokens, hidden]`` as raw bytes of ``dtype`` (asyncllm/engine/prompt_embeds.py):
    the first layer's input in place of the token embeddings of the prompt's positions."""

    data: bytes
    shape: list[int]
    dtype: str


class MultiModalItem(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image's (or video's, or a video frame's) processed input and where its placeholder tokens sit in the prompt.

    ``data`` is the processor's output as raw bytes (``shape``, ``dtype`` say how to
    view it; no pickle). It is None when the host's processor-cache mirror says the
    core already holds ``mm_hash`` (docs/multimodal.md): the core fills it in.
    """

    mm_hash: str
    offset: int
    """Index of the first placeholder token in the prompt."""
    length: int
    """Placeholder tokens: one per feature row the encoder outputs."""
    data: bytes | None = None
    shape: list[int] = []
    dtype: str = "float32"
    shm_offset: int = -1
    """Where the data lies in the host's shm ring (>= 0 only when ``data`` is None and the cache type is shm)."""
    shm_generation: int = 0
    """The ring entry's generation: the core uses the data only if the entry still has it (docs/multimodal.md)."""
    time_interval: float = 1.0
    """A video's M-RoPE time positions per temporal patch (Qwen2.5-VL: ``tokens_per_second`` x seconds per patch;
    asyncllm/models/mrope.py); 1 for images and the other models."""
    bidirectional: list[int] = []
    """``[start, stop)`` relative to ``offset``: the rows whose tokens attend to each other both ways in a prefill
    (Gemma 3's image tokens), so no prefill chunk ends inside them; empty: causal like text. An item of no rows
    (``length`` 0, no data to encode) is such a span alone: PaliGemma's whole prompt (asyncllm/models/paligemma.py)."""
    rows: list[int] = []
    """``[start, whole]``: the placeholders take rows ``[start, start + length)`` of the encoder's ``whole`` rows of
    this data (a piece of a video or audio laid out in several runs: Qwen2.5-Omni's audio in video,
    asyncllm/models/omni_interleave.py); empty: all its rows."""


class AbortRequests(msgspec.Struct, **_STRUCT):
    request_ids: list[str]


class Goodbye(msgspec.Struct, **_STRUCT):
    """The host is leaving: abort its requests; `shutdown` stops the core too."""

    shutdown: bool = False


class ResetPrefixCache(msgspec.Struct, **_STRUCT):
    """Forget every prefix-cache entry (vLLM's reset_prefix_cache): requests the core handles after this
    message hit nothing computed before it. Running requests keep their blocks."""


class WeightTensor(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of `update_weights_from_tensors` in the host's shared-memory segment: its checkpoint name, torch
    dtype name ("bfloat16"), shape, and byte offset in the segment (contiguous, row-major)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int


class UpdateWeights(msgspec.Struct, **_STRUCT):
    """Reload every weight of the served model in place from ``model_path``, or the weights in ``tensors`` from the
    host's shared-memory ``segment`` (docs/weight-updates.md): the core runs it between steps, after the requests
    the host sent before it; the core passes it on to every worker rank."""

    update_id: str
    model_path: str
    revision: str | None = None
    hf_config_json: str = ""
    """The new checkpoint's config as the host read it (`hf_config_json`; empty: each worker reads it)."""
    segment: str = ""
    """`update_weights_from_tensors`: the /dev/shm segment holding ``tensors`` (``model_path`` is empty)."""
    tensors: list[WeightTensor] = []
    weights_version: int = 0
    """The version to take on success: a restarted core replaying the host's last update keeps its number (0: one
    more than the core's)."""

    def source(self) -> str:
        """What the update loads, for logs and errors."""
        return f"{len(self.tensors)} tensors from the host" if self.segment else repr(self.model_path)


class AwaitWeights(msgspec.Struct, **_STRUCT):
    """To a restarted core whose host last pushed weights from memory (docs/weight-updates.md): those weights died
    with the old core, so it runs no step until updates write every weight again; it is at ``weights_version``."""

    weights_version: int


class Sleep(msgspec.Struct, **_STRUCT):
    """vLLM's sleep mode (docs/sleep-mode.md): free the GPU memory of the weights (level 1: kept in CPU memory;
    level 2: discarded) and of the KV cache. The core runs it between steps, after the host's earlier messages,
    and passes it on to every worker rank."""

    call_id: str
    level: int = 1
    tags: list[str] = []
    """Core -> workers only: the parts to put to sleep ("weights", "kv_cache"); empty: both."""


class WakeUp(msgspec.Struct, **_STRUCT):
    """Take the memory back (docs/sleep-mode.md): the parts named in ``tags`` ("weights", "kv_cache"); empty: all."""

    call_id: str
    tags: list[str] = []


HostMessage = Union[Hello, AddRequest, AbortRequests, Goodbye, ResetPrefixCache, UpdateWeights, AwaitWeights, Sleep,
                    WakeUp]


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

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_gpu_blocks if self.num_gpu_blocks else 0.0


class Ready(msgspec.Struct, **_STRUCT):
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    core_pid: int
    model: str = ""
    """The model folder the core serves: a host that attaches (`AsyncEngine.connect`) loads its tokenizer from it."""
    tokenizer: str = ""
    """Tokenizer folder or hub id (empty: the model folder's)."""
    revision: str | None = None
    """Hub revision of `tokenizer`, if it is a hub id."""
    mm_shm_ring_mapped: bool = False
    """The core mapped the ring named in the host's Hello (False: the host sends image data inline)."""
    max_lora_rank: int = 0
    """The core's max_lora_rank when it serves LoRA adapters (0: enable_lora is off), for an attached host."""
    max_loras: int = 1


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


class LogprobsArrays(msgspec.Struct, array_like=True, omit_defaults=True):
    """Logprobs of consecutive positions of one request, packed as little-endian numpy bytes.

    Row p is one position: its own token (the sampled one, or the prompt
    token) first, then the top-N tokens, most likely first; ``width`` = 1 + N.
    Raw bytes keep a step's message small and cheap to encode.
    """

    width: int
    token_ids: bytes
    """int32 ``[num_positions, width]``."""
    logprobs: bytes
    """float32 ``[num_positions, width]``."""
    ranks: bytes
    """int32 ``[num_positions]``: the rank of each row's own token (1 = most likely)."""
    start: int = 0
    """Prompt logprobs: the index of the prompt token of the first row (prompt token 0 has none)."""


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
    """[field, value repr, allowed] when error_type is ConfigError."""


class WeightsUpdated(msgspec.Struct, **_STRUCT):
    """The answer to `UpdateWeights`: from each worker rank to the core, and from the core to the host that asked.

    ``error_type`` empty: it succeeded. Otherwise nothing was copied, and the error is rebuilt from
    ``error_type`` (InvalidRequestError or NotBuiltError), ``error_field``, ``error_value`` and ``error``.
    """

    update_id: str
    weights_version: int = 0
    """The core's weights version after the update (core -> host only)."""
    rank: int = 0
    weights_unwritten: int = 0
    """Worker -> core: how many of this rank's weights nothing has written since they stopped being real (a
    level-2 sleep, dummy weights); partial `update_weights_from_tensors` calls count down to 0."""
    error_type: str = ""
    error_field: str = ""
    error_value: str = ""
    """NotBuiltError only: the refused value (a str: a field's name or a path)."""
    error: str = ""
    """InvalidRequestError's message, NotBuiltError's feature."""


class SleepModeDone(msgspec.Struct, **_STRUCT):
    """The answer to `Sleep` or `WakeUp`: from each worker rank to the core, and from the core to the host.

    ``error_type`` empty: it was done. Otherwise nothing changed, and the error is rebuilt from ``error_type``
    (ConfigError, InvalidRequestError or NotBuiltError), ``error_field``, ``error_value`` and ``error``
    (asyncllm/engine/sleep.py).
    """

    call_id: str
    rank: int = 0
    sleep_level: int = 0
    """The core's `SchedulerStats.sleep_level` after the call (core -> host only)."""
    error_type: str = ""
    error_field: str = ""
    error_value: str = ""
    error: str = ""
    """InvalidRequestError's message, NotBuiltError's feature, ConfigError's allowed values."""


CoreMessage = Union[Ready, Outputs, EngineFailed, WeightsUpdated, SleepModeDone]


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
    eos_token_ids: list[int] = []
    """The tokenizer's EOS ids: masked until min_tokens outputs exist (unless ignore_eos)."""
    mm_items: list[MultiModalItem] = []
    """The prompt's images, with their data (the worker encodes the ones a step reaches)."""
    lora: LoRARequest | None = None
    """The request's adapter (the worker puts it in a slot for the steps that run the request)."""
    pooling: PoolingParams | None = None
    """An embedding request: the step that samples its token also returns its embedding."""
    prompt_embeds: PromptEmbeds | None = None
    """A prompt given as embeddings: the rows of its prompt positions (workers/prompt_embeds.py)."""


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """The step's requests that the workers know, as parallel lists: only what changed since the last step.

    One struct per step, not one per request: a decode step of a thousand
    requests costs the core two list appends per request and no object.
    """

    req_ids: list[str] = []
    num_computed_tokens: list[int] = []
    """``num_computed_tokens[i]``: tokens of ``req_ids[i]`` computed before this step."""
    new_block_ids: dict[str, list[int]] = {}
    """Blocks appended to a request's block table this step; only requests that got some are listed."""


class SchedulerOutput(msgspec.Struct, **_STRUCT):
    """One step, from the scheduler to every worker."""

    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    """Aborted or finished since the last step: workers drop their state."""
    preempted_req_ids: list[str] = []
    """Preempted since the last step (recompute or swap): workers drop their state."""
    blocks_to_swap_out: list[list[int]] = []
    """[gpu_block, cpu_block] pairs to copy to the CPU swap space before this step's forward."""
    blocks_to_swap_in: list[list[int]] = []
    """[gpu_block, cpu_block] pairs to copy back from the CPU after the swap-outs, before the forward."""
    grammar_bitmask: "GrammarBitmask | None" = None
    """Allowed tokens of the structured-output requests that sample in this step (None: no such request)."""
    spec_token_ids: dict[str, list[int]] = {}
    """Speculative decoding: each drafted request's drafts. Such a request's scheduled tokens are its last
    token and these; the workers verify them and sample the accepted drafts and one token more."""
    state_loads: dict[str, int] = {}
    """Hybrid models with prefix caching: a request admitted on a prefix-cache hit -> the checkpoint slot holding
    its state layers' states at the hit's end (asyncllm/kv/state_checkpoints.py)."""
    state_saves: dict[str, list[list[int]]] = {}
    """Hybrid models with prefix caching: request -> [tokens computed, checkpoint slot] pairs: save its states
    once that many of its tokens are computed (in this step), in that slot."""


class GrammarBitmask(msgspec.Struct, array_like=True, omit_defaults=True):
    """xgrammar's int32 token bitmask rows, packed: bit j of word w allows token 32 * w + j."""

    req_ids: list[str]
    """The request of each row, in row order."""
    bitmask: bytes
    """len(req_ids) rows of ceil(vocab_size / 32) little-endian int32 words."""
    positions: list[int] = []
    """Speculative decoding: each row's position in its request's step (0: before its first draft; its number of
    drafts: its last row). Empty: every row is its request's last."""


class InitCache(msgspec.Struct, **_STRUCT):
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    """Blocks of the CPU swap space to allocate (preemption_mode='swap' only)."""


class ShutdownWorker(msgspec.Struct, **_STRUCT):
    pass


WorkerCommand = Union[SchedulerOutput, InitCache, ShutdownWorker, UpdateWeights, Sleep, WakeUp]


# ------------------------------------------------------------- workers -> core
class WorkerReady(msgspec.Struct, **_STRUCT):
    rank: int
    num_available_blocks: int
    """Blocks this rank can hold in its memory budget (the core takes the min)."""
    num_cpu_blocks: int = 0
    """Blocks of swap_space GiB on this rank (preemption_mode='swap' only; the core takes the min)."""
    vocab_size: int = 0
    """Rows of the model's embedding: the core refuses token ids outside [0, vocab_size) (0: unknown)."""
    state_checkpoints: int = 0
    """Checkpoint slots the model's state layers keep for prefix caching (hybrid models; 0: none)."""
    num_offload_blocks: int = 0
    """Of ``num_cpu_blocks``, those of kv_offloading_size (the CPU prefix-cache tier; after the swap space's)."""
    mm_piece_merge: int = 0
    """The model lays a video with its audio in pieces (`MultiModalItem.rows`, the Qwen-Omni thinkers'
    ``mm_audio_in_video``): its vision tower's spatial merge, which the core checks the pieces by (0: it takes none)."""
    first_stage_reports: bool = False
    """This rank (a pipeline's first stage's rank 0, of an image-text model) sends a `FirstStageReport` every step."""
    mm_piece_audio_window: int = 0
    """The audio encoder window by which the core checks an audio piece's whole rows (Qwen3-Omni's ``n_window``:
    the model's ``mm_piece_audio_window``; 0: Qwen2.5-Omni's pooling)."""
    architectures: list[str] | None = None
    """The served config's ``architectures`` (hf_overrides applied), by which the core checks what requests it
    serves (`asyncllm.engine.validation.served_tasks`); None: a test runner without a config."""


class CacheReady(msgspec.Struct, **_STRUCT):
    rank: int


class ModelRunnerOutput(msgspec.Struct, **_STRUCT):
    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """One list per scheduled request; empty for a prefill chunk that samples nothing. A drafted request's
    list is its accepted drafts, then the token sampled after them."""
    logprobs: dict[str, LogprobsArrays] = {}
    """Logprobs of the sampled tokens, for the requests that asked."""
    prompt_logprobs: dict[str, LogprobsArrays] = {}
    """Logprobs of the prompt tokens this step covered, for the requests that asked."""
    mm_encoder_cache_queries: int = 0
    """Images this step's prefills reached for the first time (looked up in the worker's encoder cache)."""
    mm_encoder_cache_hits: int = 0
    """Of those, images not run through the encoder again (asyncllm/mm/encoder_cache.py)."""
    embeddings: dict[str, bytes] = {}
    """The embedding requests that sampled this step: their embeddings, little-endian float32."""
    failed_requests: dict[str, str] = {}
    """Requests the workers could not run (their LoRA adapter could not be read), with the error: the core ends
    them with it and drops whatever they sampled."""
    draft_token_ids: dict[str, list[int]] = {}
    """Speculative decoding with a draft model: the drafts proposed after this step's tokens, for the next step
    (every sampling request that may be drafted; workers/draft_runner.py)."""


class FirstStageReport(msgspec.Struct, **_STRUCT):
    """What a pipeline's first stage's rank 0 alone knows of a step of an image-text model (the step's output comes
    from the last stage, which encodes nothing), sent every step: the executor adds it to that step's output."""

    step_id: int
    queries: int
    """Its encoder-cache lookups (`ModelRunnerOutput.mm_encoder_cache_queries`)."""
    hits: int
    failed_requests: dict[str, str] = {}
    """Requests with an item whose placeholders disagree with its data's encoder rows (as in
    `ModelRunnerOutput.failed_requests`)."""


class WorkerError(msgspec.Struct, **_STRUCT):
    rank: int
    message: str
    error_type: str = ""
    """Class name of the worker's exception, so the core re-raises ConfigError as ConfigError."""
    config_error: list[str] = []
    """[field, value repr, allowed] when the exception is a ConfigError (as in EngineFailed)."""


WorkerMessage = Union[WorkerReady, CacheReady, ModelRunnerOutput, WorkerError, WeightsUpdated, SleepModeDone,
                      FirstStageReport]


# ------------------------------------------------------------- error helpers
def config_error_parts(exc: BaseException) -> list[str]:
    """A ConfigError as [field, value repr, allowed] for the wire; [] for anything else."""
    if isinstance(exc, ConfigError):
        return [exc.field, repr(exc.value), exc.allowed]
    return []


def config_error_from_parts(parts: list[str], where: str = "") -> ConfigError | None:
    """Rebuild a ConfigError sent with `config_error_parts`; None if there is none."""
    if len(parts) != 3:
        return None
    field, value_repr, allowed = parts
    return ConfigError(field, value_repr, allowed + where, value_repr=value_repr)


def call_error_fields(exc: AsyncLLMError) -> dict[str, str]:
    """A refused call's typed error as the ``error_*`` fields `WeightsUpdated` and `SleepModeDone` carry."""
    if isinstance(exc, NotBuiltError):  # before ConfigError: its subclass; the values refused are str
        return {"error_type": "NotBuiltError", "error_field": exc.field, "error_value": str(exc.value),
                "error": exc.feature}
    if isinstance(exc, ConfigError):
        return {"error_type": "ConfigError", "error_field": exc.field, "error_value": repr(exc.value),
                "error": exc.allowed}
    if isinstance(exc, EngineDeadError):
        return {"error_type": "EngineDeadError", "error": str(exc)}
    assert isinstance(exc, InvalidRequestError), exc
    return {"error_type": "InvalidRequestError", "error_field": exc.field, "error": exc.message}


def call_error(reply: "WeightsUpdated | SleepModeDone", default_field: str = "") -> AsyncLLMError | None:
    """The typed error `call_error_fields` sent; None when the call succeeded."""
    if not reply.error_type:
        return None
    if reply.error_type == "NotBuiltError":
        return NotBuiltError(reply.error_field, reply.error_value, reply.error)
    if reply.error_type == "ConfigError":
        return ConfigError(reply.error_field, reply.error_value, reply.error, value_repr=reply.error_value)
    if reply.error_type == "EngineDeadError":
        return EngineDeadError(reply.error)
    return InvalidRequestError(reply.error_field or default_field, reply.error)
