"""The chunked-prefill policy: how many tokens one request computes in a step.

- `enable_chunked_prefill=True` (default): a prompt that does not fit what is
  left of the step's token budget runs in chunks across steps, so decodes
  keep running beside long prefills; `long_prefill_token_threshold` (> 0)
  caps one request's chunk, so one long prompt cannot take a whole step.
- `enable_chunked_prefill=False`: a waiting prompt is scheduled whole or not
  at all, and a prompt longer than `max_num_batched_tokens` is refused at
  arrival (`asyncllm.sched.admission.check_request`). The exceptions: a
  `long_prefill_token_threshold` (> 0) still caps a request's chunk, as in
  vLLM's V1 scheduler, so a longer prompt runs in chunks of that size; and a
  request resumed after preemption whose outputs made it longer than a whole
  step is chunked anyway, or it could never run again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncllm.config import EngineConfig

if TYPE_CHECKING:
    from asyncllm.sched.request import Request

__all__ = ["ChunkPolicy", "token_budget", "whole_spans"]


def token_budget(config: EngineConfig, max_model_len: int) -> int:
    """`resolved_max_num_batched_tokens`, using the model's max_model_len when the config has none yet."""
    if config.max_num_batched_tokens is None and not config.enable_chunked_prefill:
        return max(max_model_len, config.max_num_seqs)
    return config.resolved_max_num_batched_tokens


class ChunkPolicy:
    """Chunk sizes under `max_num_batched_tokens`, `enable_chunked_prefill` and `long_prefill_token_threshold`."""

    __slots__ = ("max_num_batched_tokens", "enable_chunked_prefill", "_threshold", "splits_prompts")

    def __init__(self, max_num_batched_tokens: int, enable_chunked_prefill: bool, long_prefill_token_threshold: int):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self._threshold = long_prefill_token_threshold  # as vLLM's V1 scheduler: with or without chunked prefill
        self.splits_prompts = enable_chunked_prefill or 0 < long_prefill_token_threshold <= max_num_batched_tokens
        """Whether a prompt longer than a step runs in several: chunked prefill, or without it chunks of the
        long-prefill threshold."""

    def chunk(self, num_remaining: int, budget: int) -> int:
        """Tokens a request computes this step: capped by the budget and the long-prefill threshold."""
        return min(self._capped(num_remaining), budget)

    def admission_chunk(self, num_remaining: int, budget: int) -> int:
        """Like `chunk`, but 0 (wait) when chunking is off and the rest (capped by the threshold, as vLLM) does not
        fit this step."""
        capped = self._capped(num_remaining)
        if self.enable_chunked_prefill or capped <= budget:
            return min(capped, budget)
        if capped <= self.max_num_batched_tokens:
            return 0
        return budget

    def prefill_chunk(self, request: Request, budget: int) -> int:
        """The tokens a running request's prefill under way computes this step (`chunk`, kept off an image's
        bidirectional rows: `whole_spans`); 0: it waits for a fuller step."""
        num_computed = request.num_computed_tokens
        num_new = self.chunk(request.num_tokens - num_computed, budget)
        return whole_spans(request.mm_items, num_computed, num_new, budget) if request.mm_items else num_new

    def first_chunk(self, request: Request, num_computed: int, budget: int) -> int:
        """The tokens a waiting request computes from `num_computed` (its resume point) on in the step that admits
        it (`admission_chunk`, kept off an image's bidirectional rows); 0: it waits."""
        num_new = self.admission_chunk(request.num_tokens - num_computed, budget)
        return whole_spans(request.mm_items, num_computed, num_new, budget) if request.mm_items else num_new

    def _capped(self, num_remaining: int) -> int:
        return self._threshold if 0 < self._threshold < num_remaining else num_remaining


def whole_spans(mm_items: list[Any], num_computed: int, num_new: int, budget: int) -> int:
    """``num_new`` (a chunk from ``num_computed`` on) adjusted so that it does not end inside an item's bidirectional
    rows (`asyncllm.protocol.MultiModalItem.bidirectional`: Gemma 3's images, whose rows see each other): cut
    before the rows, or stretched to their end (past `long_prefill_token_threshold`) when the chunk starts at or in
    them and the budget holds the rest; 0 (wait for a fuller budget) when it does not."""
    end = num_computed + num_new
    for item in mm_items:
        if not item.bidirectional:
            continue
        start, stop = item.offset + item.bidirectional[0], item.offset + item.bidirectional[1]
        if start < end < stop:
            if num_computed < start:
                end = start
            else:
                end = stop if stop - num_computed <= budget else num_computed
    return end - num_computed
