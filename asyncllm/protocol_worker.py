"""The step messages between the engine core and its workers, and the payloads they share with the host messages.

Part of the wire protocol (asyncllm/protocol.py, which re-exports every name here): `WorkerCommand` goes down
(shared-memory broadcast), `WorkerMessage` comes back up (zmq). A request's images (`MultiModalItem`), prompt
embeddings (`PromptEmbeds`) and logprobs (`LogprobsArrays`) ride on host messages too.
"""

from __future__ import annotations

from typing import Union

import msgspec

from asyncllm.lora import LoRARequest
from asyncllm.pooling import PoolingParams
from asyncllm.protocol_control import (_STRUCT, LoRAPinned, PinLoRA, Sleep, SleepModeDone, UpdateWeights, WakeUp,
                                       WeightsUpdated)
from asyncllm.sampling import SamplingParams

__all__ = [
    "PromptEmbeds", "MultiModalItem", "LogprobsArrays",
    "NewRequestData", "CachedRequestData", "SchedulerOutput", "GrammarBitmask", "InitCache", "ShutdownWorker",
    "JoinRendezvous", "WorkerCommand",
    "RendezvousOpened", "WorkerReady", "CacheReady", "ModelRunnerOutput", "FirstStageReport", "WorkerError",
    "WorkerMessage",
]


# ------------------------------------------------------------- payloads of host and step messages
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

    def first_rows(self, num_rows: int) -> "LogprobsArrays | None":
        """The first `num_rows` rows (those of the tokens a delta keeps); None for none."""
        if num_rows == 0:
            return None
        row_bytes = self.width * 4  # int32 ids and float32 logprobs per row; one int32 rank
        return msgspec.structs.replace(self, token_ids=self.token_ids[: num_rows * row_bytes],
                                       logprobs=self.logprobs[: num_rows * row_bytes], ranks=self.ranks[: num_rows * 4])


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
    """The tokenizer's EOS ids: masked until min_tokens outputs exist (with ignore_eos too, as vLLM)."""
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


class JoinRendezvous(msgspec.Struct, **_STRUCT):
    """The first command to a world of more than one rank: the port of rank 0's torch.distributed store
    (`RendezvousOpened`), which every rank joins (workers/worker.py, `rendezvous_store`)."""

    port: int


WorkerCommand = Union[SchedulerOutput, InitCache, ShutdownWorker, UpdateWeights, Sleep, WakeUp, JoinRendezvous,
                      PinLoRA]


# ------------------------------------------------------------- workers -> core
class RendezvousOpened(msgspec.Struct, **_STRUCT):
    """Rank 0 serves the torch.distributed store on ``port``, bound when the kernel picked it (port 0): the
    executor passes it on to every rank (`JoinRendezvous`)."""

    port: int


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
    kv_budget_field: str = ""
    """What sized this rank's KV cache (kv_cache_memory_bytes, gpu_memory_utilization, or on the CPU
    ASYNCLLM_CPU_KVCACHE_SPACE_GB), which the core advises raising when max_model_len does not fit ("": unknown)."""


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
    """Class name of the worker's exception, so the core re-raises ConfigError as ConfigError (NotBuiltError as
    NotBuiltError)."""
    config_error: list[str] = []
    """[field, value repr, allowed] when the exception is a ConfigError (as in EngineFailed)."""


WorkerMessage = Union[WorkerReady, CacheReady, ModelRunnerOutput, WorkerError, WeightsUpdated, SleepModeDone,
                      FirstStageReport, RendezvousOpened, LoRAPinned]
