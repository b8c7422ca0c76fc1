"""`Request`: the engine core's state of one generation request.

The scheduler owns every `Request`; workers see only `NewRequestData` /
`CachedRequestData` diffs. `append_output_token` + `check_stop` run after each
sampled token and decide whether the request is done. The tokens live in one
list, `all_token_ids` (prompt then outputs): a decode step appends once.
"""

from __future__ import annotations

import enum
import functools
import time

from asyncllm import protocol
from asyncllm.kv.hashing import BlockHash, CacheSalt
from asyncllm.lora import LoRARequest
from asyncllm.pooling import PoolingParams
from asyncllm.sampling import SamplingParams
from asyncllm.sched.rows import RequestRows

__all__ = ["RequestStatus", "Request"]


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status after PREEMPTED is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_TIMEOUT = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
}


_NO_LENGTH_LIMIT = 1 << 62


@functools.lru_cache(maxsize=256)
def _shared(value: frozenset[int] | int) -> frozenset[int] | int:
    """One object per distinct value (stop token sets, output limits), shared by the requests that have it.

    The scheduler reads these for every request every step; one shared object stays in the CPU
    cache where a thousand private copies, allocated when each request arrived, would not.
    """
    return value


class Request:
    """One request: its tokens, how far the KV cache covers them, and why it stopped."""

    __slots__ = (
        # read every step by the scheduler's loops: first, so that they share the object's first cache lines
        "status", "request_id", "_rows", "_row", "_num_computed_tokens", "_num_tokens", "num_prompt_tokens",
        "all_token_ids",
        "stop_check_token_ids", "max_output_tokens", "finish_reason", "events", "client_id", "plain_outputs",
        "block_hashes",
        "prompt_token_ids", "num_cached_tokens", "params", "eos_token_ids", "arrival_time",
        "priority", "stop_reason", "num_preemptions", "cache_salt", "timeout",
        "_max_tokens", "_min_tokens", "_stop_token_ids", "_eos_token_id", "mm_items", "lora", "lora_int_id", "pooling",
        "num_lora_skips", "draft_buffer", "prompt_embeds", "num_samples", "admission_group",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        arrival_time: float,
        priority: int = 0,
        client_id: bytes = b"",
        cache_salt: str | None = None,
        timeout: float | None = None,
        mm_items: list[protocol.MultiModalItem] | None = None,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
        prompt_embeds: protocol.PromptEmbeds | None = None,
    ) -> None:
        self.request_id = request_id
        self._rows: RequestRows | None = None
        """The scheduler's rows while the request runs (its counters live there then: asyncllm/sched/rows.py)."""
        self._row = -1
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        """Prompt then outputs (append through the methods below, or keep `num_tokens` in step)."""
        self.num_prompt_tokens = len(prompt_token_ids)
        self._num_tokens = self.num_prompt_tokens
        self._num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Tokens found in the prefix cache at the first admission."""
        self.params = params
        self.eos_token_ids = list(eos_token_ids)
        self.arrival_time = arrival_time
        self.priority = priority
        self.client_id = client_id
        """The DEALER identity of the host that sent the request."""
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        """'stop', 'length', 'abort' or 'timeout' once finished."""
        self.stop_reason: int | None = None
        """The stop token id that ended the request: a stop_token_ids entry or an extra EOS id (None for the
        first EOS id and other reasons)."""
        self.num_preemptions = 0
        self.cache_salt: CacheSalt = (
            cache_salt if prompt_embeds is None else ("prompt_embeds", cache_salt))
        """Requests with different salts never share prefix-cache blocks. A prompt-embeds request's (the host's
        `embeds_salt`: the user's salt and the embeddings' digest) is tagged, so no token prompt's salt equals it:
        its placeholder ids are 0s, a token prompt of 0s with that salt would take its blocks."""
        self.block_hashes: list[BlockHash] = []
        """Prefix-cache hashes of full blocks, filled by the KV manager."""
        self.timeout = timeout
        """Seconds after the core received the request at which it ends with finish_reason 'timeout'."""
        self.mm_items: list[protocol.MultiModalItem] = mm_items or []
        """The prompt's images (data filled in); their hashes and offsets key the prefix cache."""
        self.lora = lora
        """The request's adapter (None: the base model)."""
        self.lora_int_id = 0 if lora is None else lora.lora_int_id
        """Its id (0: none): keys the prefix cache and counts against max_loras."""
        self.num_lora_skips = 0
        """Scheduling steps it has waited skipped for lack of an adapter slot since its last admission
        (asyncllm/sched/schedule_waiting.py)."""
        self.pooling = pooling
        """Set for an embedding request (one output token; the worker returns the embedding with it)."""
        self.prompt_embeds = prompt_embeds
        """A prompt given as embeddings, sent to the workers with the request (again when it resumes)."""
        self.draft_buffer: bytearray | None = None
        """Speculative decoding: the tokens as int32 bytes for the n-gram lookup (asyncllm/spec/ngram.py);
        None when the request is not drafted."""
        self.events: list[protocol.EngineCoreEvent] | None = None
        """Scheduling events not yet sent to the host (see `record_event`)."""
        self.num_samples = 1
        """`protocol.AddRequest.num_samples`: what the queue's limits count it as when it is added."""
        self.admission_group = ""
        """`protocol.AddRequest.admission_group`: the requests it is admitted with ("": none)."""
        self.plain_outputs = params.logprobs is None and params.prompt_logprobs is None and params.structured is None
        """Whether a step's one new token may travel in `StepOutputs.tokens` (nothing attaches to its deltas)."""
        # copies of the stop settings, read once per generated token
        self._max_tokens = params.max_tokens
        self._min_tokens = params.min_tokens
        # vLLM's update_from_generation_config: the first EOS id (the tokenizer's) stops with stop_reason None; the
        # others (generation_config.json's) join stop_token_ids; ignore_eos drops both
        eos = [] if params.ignore_eos else self.eos_token_ids
        self._eos_token_id = eos[0] if eos else None
        self._stop_token_ids = frozenset(params.stop_token_ids).union(eos[1:])
        self.stop_check_token_ids = _shared(self._stop_token_ids.union(eos[:1]))
        """Every token that may stop the request: after any other, only the length limits can
        (the scheduler's decode loop skips `check_stop` then). Requests with equal sets share one
        object, which stays in the CPU cache while the decode loop reads it for every request."""
        self.max_output_tokens = _shared(params.max_tokens if params.max_tokens is not None else _NO_LENGTH_LIMIT)
        """Outputs at which the request stops by length: max_tokens, or fewer (`cap_length`) where the
        sequence would pass the scheduler's longest sequence."""

    @classmethod
    def from_add_request(cls, msg: protocol.AddRequest, client_id: bytes) -> "Request":
        """Build a request from the host's `AddRequest` message."""
        request = cls(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            params=msg.params,
            eos_token_ids=msg.eos_token_ids,
            arrival_time=msg.arrival_time,
            priority=msg.priority,
            client_id=client_id,
            cache_salt=msg.cache_salt,
            timeout=msg.timeout,
            mm_items=msg.mm_items,
            lora=msg.lora,
            pooling=msg.pooling,
            prompt_embeds=msg.prompt_embeds,
        )
        request.num_samples, request.admission_group = msg.num_samples, msg.admission_group
        return request

    # ------------------------------------------------------------ events
    def record_event(self, event_type: protocol.EngineCoreEventType) -> None:
        """Timestamp a scheduling event; it rides on the request's next output delta."""
        event = protocol.EngineCoreEvent(event_type, time.time())
        if self.events is None:
            self.events = [event]
        else:
            self.events.append(event)

    def take_events(self) -> list[protocol.EngineCoreEvent] | None:
        """The events recorded since the last call (None when there are none)."""
        events, self.events = self.events, None
        return events

    # ------------------------------------------------------------ counters (in the scheduler's rows while running)
    @property
    def num_tokens(self) -> int:
        """len(all_token_ids), plus a placeholder while an async-scheduled step samples it (sched/placeholders.py)."""
        rows = self._rows
        return self._num_tokens if rows is None else rows.num_tokens[self._row]

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        rows = self._rows
        if rows is None:
            self._num_tokens = value
        else:
            rows.num_tokens[self._row] = value

    @property
    def num_computed_tokens(self) -> int:
        """Leading tokens whose KV is in the cache (prefix hits included)."""
        rows = self._rows
        return self._num_computed_tokens if rows is None else rows.num_computed[self._row]

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        rows = self._rows
        if rows is None:
            self._num_computed_tokens = value
        else:
            rows.num_computed[self._row] = value

    # ------------------------------------------------------------ tokens
    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy: append through `append_output_token`)."""
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def samples_once(self) -> bool:
        """Whether its first sampled token ends it (pooling, or max_tokens 1): its prompt may fill max_seq_len."""
        return self.pooling is not None or self._max_tokens == 1

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's `Request.skip_reading_prefix_cache`: prompt_logprobs, or MEAN/CLS pooling, need every prompt
        position's row, so the request reads no prefix-cache block (and is no prefix-cache query)."""
        pooling = self.pooling
        return self.params.prompt_logprobs is not None or (pooling is not None and pooling.pooling_type != "LAST")

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def append_sampled_tokens(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """Append sampled tokens up to the first that stops the request; the ones appended.

        The scheduler's decode loop inlines the one-token case (see `update_from_output`).
        """
        appended = []
        for token_id in token_ids:
            self.append_output_token(token_id)
            appended.append(token_id)
            if self.check_stop(max_model_len):
                break
        return appended

    # ------------------------------------------------------------ stopping
    def cap_length(self, max_seq_len: int) -> None:
        """Lower `max_output_tokens` so that the request stops by length at `max_seq_len` tokens at the latest."""
        self.max_output_tokens = _shared(min(self.max_output_tokens, max_seq_len - self.num_prompt_tokens))

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: finish the request if it must stop; True if it did.

        EOS (unless ignore_eos) and stop_token_ids end the request only once
        `min_tokens` outputs exist; they are checked before the length limits,
        so a stop token that is also the last allowed token reports 'stop'. The
        first EOS id is checked first, as vLLM's check_stop: it reports
        stop_reason None even when stop_token_ids lists it too.
        """
        num_output = self.num_tokens - self.num_prompt_tokens
        last = self.all_token_ids[-1]
        if num_output >= self._min_tokens:
            if last == self._eos_token_id:
                self.finish(RequestStatus.FINISHED_STOPPED)
                return True
            if last in self._stop_token_ids:
                self.stop_reason = last
                self.finish(RequestStatus.FINISHED_STOPPED)
                return True
        max_tokens = self._max_tokens
        if (max_tokens is not None and num_output >= max_tokens) or self.num_tokens >= max_model_len:
            self.finish(RequestStatus.FINISHED_LENGTH)
            return True
        return False

    def finish(self, status: RequestStatus) -> None:
        assert status.is_finished, status
        self.status = status
        self.finish_reason = _FINISH_REASONS[status]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
