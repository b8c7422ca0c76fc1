"""`SpecDecodingStats`: how many drafts the workers accepted (vLLM's spec_decode counters)."""

from __future__ import annotations

__all__ = ["SpecDecodingStats"]


class SpecDecodingStats:
    """Cumulative counters of the core; they ride on every `SchedulerStats`."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        """Request-steps that carried drafts."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens
        """``accepted_per_pos[i]``: drafts accepted at draft position i (the i+1-th draft of a step)."""

    def observe(self, num_drafts: int, token_ids: list[int]) -> int:
        """Count one request's verified step (``token_ids``: the accepted drafts, then the target's token);
        returns the tokens whose KV stays: the last known one and the accepted drafts."""
        accepted = len(token_ids) - 1
        assert 0 <= accepted <= num_drafts, (accepted, num_drafts)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        per_pos = self.accepted_per_pos
        for i in range(accepted):
            per_pos[i] += 1
        return accepted + 1
