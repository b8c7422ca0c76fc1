"""`SchedulerConfig`: the scheduler's section of `EngineConfig` (asyncllm/config.py re-exports it), vLLM's
`SchedulerConfig` fields under their names; each raises `ConfigError` naming the field, the value and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.config_checks import check_bool, check_choice, check_float, check_int
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.spec.config import SpeculativeConfig

__all__ = ["DEFAULT_MAX_NUM_SEQS", "SchedulerConfig", "default_max_num_seqs"]

DEFAULT_MAX_NUM_SEQS = 256
"""`SchedulerConfig.max_num_seqs` when unset (vLLM's), at most the step's token budget (`default_max_num_seqs`)."""


def default_max_num_seqs(max_num_batched_tokens: int | None) -> int:
    """`SchedulerConfig.max_num_seqs` when unset: `DEFAULT_MAX_NUM_SEQS`, at most the step's token budget (vLLM's)."""
    if max_num_batched_tokens is None:
        return DEFAULT_MAX_NUM_SEQS
    return min(DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = None
    """Most requests in one step; None: 256, at most max_num_batched_tokens (vLLM's default). At most
    max_num_batched_tokens when both are set (vLLM's rule: every running request takes a token a step)."""
    max_num_batched_tokens: int | None = None
    """Most tokens in one step; defaults to max(8192, max_num_seqs) with chunked prefill, else max(max_model_len,
    max_num_seqs) (vLLM's)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so that decodes keep running."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step; 0 means no cap. With enable_chunked_prefill False too (vLLM's V1
    scheduler)."""
    max_num_partial_prefills: int = 1
    """vLLM's cap on requests partially prefilled at once: only 1, its default, is built (vLLM's V1 engine refuses
    other values too); 1 caps nothing, as in vLLM's V1 scheduler (several requests may be mid-prefill in a step)."""
    max_long_partial_prefills: int = 1
    """vLLM's cap on prompts longer than long_prefill_token_threshold partially prefilled at once, at most
    max_num_partial_prefills: only 1, its default, is built (vLLM's V1 engine refuses other values too)."""
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
    """Structured output: a request whose grammar has not compiled this many seconds after a compile thread took it
    fails with InvalidRequestError (waiting behind other grammars, and the first structured request's tokenizer
    loading, do not count)."""
    structured_output_disable_any_whitespace: bool = False
    """vLLM's ``structured_outputs_config.disable_any_whitespace``: JSON output in xgrammar's compact layout (``", "``
    between items, ``": "`` after keys, no other whitespace); False (as vLLM's default) lets the model write any JSON
    whitespace between tokens, still valid JSON against the schema."""
    async_scheduling: bool = True
    """Overlap the core's scheduling of step N+1 with the workers' step N (outputs stay token-exact; some steps
    still run synchronously, see docs/scheduling.md); False runs every step synchronously."""
    stream_interval: int = 1
    """vLLM's: a stream's deltas carry this many tokens (its first token and its last ones come at once); above 1
    the host wakes each stream's consumer that many times less often (docs/sampling.md)."""

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1, optional=True)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        budget = self.max_num_batched_tokens
        if self.max_num_seqs is None:  # vLLM's: the default, at most the budget
            object.__setattr__(self, "max_num_seqs", default_max_num_seqs(budget))
        elif budget is not None and budget < self.max_num_seqs:
            raise ConfigError("max_num_batched_tokens", budget, f"greater than or equal to max_num_seqs "
                                                                f"({self.max_num_seqs}), as vLLM: raise it or lower "
                                                                "max_num_seqs")
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        self._check_partial_prefills()
        check_choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        check_choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        check_int("max_num_queued_requests", self.max_num_queued_requests, 1, optional=True)
        check_int("max_num_queued_tokens", self.max_num_queued_tokens, 1, optional=True)
        check_float("structured_output_compile_timeout_s", self.structured_output_compile_timeout_s, 0.0, 86400.0,
               lo_open=True)
        check_bool("structured_output_disable_any_whitespace", self.structured_output_disable_any_whitespace)
        check_bool("async_scheduling", self.async_scheduling)
        self.speculative  # noqa: B018 - validates speculative_config
        check_int("stream_interval", self.stream_interval, 1)

    def _check_partial_prefills(self) -> None:
        """vLLM's SchedulerConfig rules (each >= 1, the long ones at most the others), then vLLM V1's refusal of
        concurrent partial prefills (its `_check_feature_supported`: "Concurrent Partial Prefill is not supported")."""
        check_int("max_num_partial_prefills", self.max_num_partial_prefills, 1)
        check_int("max_long_partial_prefills", self.max_long_partial_prefills, 1)
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ConfigError("max_long_partial_prefills", self.max_long_partial_prefills,
                              f"at most max_num_partial_prefills ({self.max_num_partial_prefills}), as vLLM")
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            if getattr(self, name) != 1:
                raise NotBuiltError(name, getattr(self, name), "concurrent partial prefills (vLLM's V1 engine refuses "
                                    "any value but 1 too: 'Concurrent Partial Prefill is not supported')")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` read and checked; None when off."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
