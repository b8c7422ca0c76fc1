"""What the engine hands back: stream deltas, final outputs, per-request timing."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "StreamDelta", "CompletionOutput", "RequestOutput", "RequestMetrics", "Logprob", "SampleLogprobs", "PromptLogprobs",
]


@dataclass(slots=True, frozen=True)
class Logprob:
    """The log probability of one token at one position (vLLM's `Logprob`)."""

    logprob: float
    """Natural log of the token's probability under the model's raw distribution."""
    rank: int | None = None
    """1 for the most likely token; ties share the larger rank (the count of tokens at least as likely)."""
    decoded_token: str | None = None
    """The token decoded alone with special tokens kept, as vLLM V1's: a SentencePiece piece keeps the leading spaces
    of its ``▁`` marks, and a byte token of a split character is what it adds after the tokens before it ("" until
    the character's last byte, which names it: docs/sampling.md)."""


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token: the token itself, then the top-N, each id -> `Logprob`."""
PromptLogprobs = list["dict[int, Logprob] | None"]
"""One entry per prompt token; the first is None (nothing predicts it)."""


@dataclass(slots=True)
class StreamDelta:
    """New text and tokens of one sample since the previous delta of the stream.

    When the consumer is slower than the engine, consecutive deltas are merged,
    so one delta may carry several tokens.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """None while running; then 'stop', 'length' or 'abort'."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the sample, if any."""
    logprobs: SampleLogprobs | None = None
    """One dict per token of ``token_ids`` when the request asked for logprobs."""
    prompt_logprobs: PromptLogprobs | None = None
    """Set on the first delta of sample 0 when the request asked for prompt_logprobs."""
    cumulative_logprob: float | None = None
    """With logprobs: the sum of the sample's token logprobs so far, up to this delta's last token (vLLM's running
    total, in DELTA streams too); None without logprobs."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life, and derived latencies."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    # Scheduling timestamps come from the engine core's clock (the same machine's time.time()).
    queued_time: float | None = None
    """When the engine core queued the request."""
    first_scheduled_time: float | None = None
    """When the scheduler first admitted the request into the running batch."""
    last_token_time: float | None = None
    """When the latest output token reached the host."""
    num_preemptions: int = 0
    """Times the request was preempted (its KV cache freed, recomputed later)."""

    @property
    def queue_time(self) -> float | None:
        """Queued until first scheduled (vLLM's time_in_queue)."""
        if self.queued_time is None or self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.queued_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled until the first token."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """First token until the latest token (the whole decode once finished)."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        """First scheduled until the latest token: prefill plus decode."""
        if self.first_scheduled_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_scheduled_time


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (``index`` 0 .. n-1)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    """vLLM's: the sum of the sampled tokens' logprobs (as ``logprobs_mode`` gives them) when the request asked for
    ``logprobs`` (0 included), else None."""

    def finished(self) -> bool:
        """Whether the sample has ended (vLLM's method)."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The final result of `AsyncEngine.generate`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_logprobs: PromptLogprobs | None = None
    """One entry per prompt token when the request asked for prompt_logprobs (the first is None)."""

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> SampleLogprobs | None:
        return self.outputs[0].logprobs


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (see `AsyncEngine.stats`).

    The gauges and the preemption / prefix-cache counters are engine-wide (from
    the engine core's latest report); the token and request counters count the
    requests of this `AsyncEngine` (this host process), as its Prometheus
    series do. docs/observability.md explains why.
    """

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV-cache blocks in use, 0.0 to 1.0."""
    num_gpu_blocks: int = 0
    num_used_blocks: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_requests: int = 0
    """Requests that looked them up (the stats line's hit rate is over the most recent 1000)."""
    prefix_cache_hits: int = 0
    """Prompt tokens found there."""
    cpu_prefix_cache_hits: int = 0
    """Of those, the tokens loaded back from the CPU tier (``kv_offloading_size``)."""
    preempted_prefix_cache_hits: int = 0
    """Tokens preempted requests found again at their readmission: no query, no hit above (vLLM keeps them apart)."""
    prompt_tokens_total: int = 0
    """Prompt tokens of this host's requests, counted when their first token arrives (once per sample of an
    n > 1 request, as vLLM's child requests: the Prometheus ``prompt_tokens_total``)."""
    generation_tokens_total: int = 0
    """Tokens generated for this host's requests."""
    engine_alive: bool = True
    num_steps_total: int = 0
    """Steps the engine core has run (each a batch of the running requests' tokens), engine-wide."""
    extra: dict = field(default_factory=dict)
    request_success_total: dict[str, int] = field(default_factory=dict)
    """This host's finished requests by finish reason ("stop", "length", "abort", ...)."""
    num_swapped_total: int = 0
    """Preemptions that swapped the victim's KV to the CPU (preemption_mode='swap'); the rest recomputed."""
    mm_cache_queries: int = 0
    """Images this host looked up in the multimodal processor cache."""
    mm_cache_hits: int = 0
    """Images found there: they crossed to the core as their key only."""
    mm_encoder_cache_queries: int = 0
    """Images the workers looked up in their encoder cache, engine-wide (each time a prefill reached one)."""
    mm_encoder_cache_hits: int = 0
    """Images found there: the vision tower ran ``mm_encoder_cache_queries - mm_encoder_cache_hits`` times."""
    spec_decode_num_drafts: int = 0
    """Speculative decoding, engine-wide: request-steps that carried drafts."""
    spec_decode_num_draft_tokens: int = 0
    """Drafts proposed."""
    spec_decode_num_accepted_tokens: int = 0
    """Drafts the model accepted (each one a token generated without a step of its own)."""
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)
    """Drafts accepted at each draft position (num_speculative_tokens entries)."""
    weights_version: int = 0
    """Successful `AsyncEngine.update_weights` of the engine core (0: the weights it started with); with
    data_parallel_size > 1 the lowest over the replicas (docs/weight-updates.md)."""
    is_sleeping: bool = False
    """Some of the engine's memory (weights, KV cache) sleeps: `AsyncEngine.sleep` and not every part woken up
    (docs/sleep-mode.md); with data_parallel_size > 1, any replica's."""
    sleep_level: int = 0
    """The level of the last sleep while sleeping (1 or 2), else 0; with data_parallel_size > 1 the highest."""
    awaiting_weights: bool = False
    """Woken after sleep(level=2) with no `update_weights` since: requests queue until one succeeds."""
    replicas: list[EngineStats] = field(default_factory=list)
    """data_parallel_size > 1: one snapshot per replica (engine core), in replica order; the fields above are
    their sums (docs/parallelism.md). Empty with one engine core."""

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0.0 before any draft)."""
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens if self.spec_decode_num_draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
