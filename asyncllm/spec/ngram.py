"""`NgramProposer`: drafts copied from where the request's latest tokens appeared before.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n
tokens of the request (prompt and outputs) are looked up earlier in the same
tokens; for the longest n that matches, the drafts are the tokens that
followed its latest occurrence with k tokens after it (else its earliest
occurrence, which has the most tokens after it: vLLM's proposer always takes the earliest). Repeated
text (code edits, quoting the prompt, lists, loops of a small model) is where the drafts get accepted.

Each request keeps its tokens as a bytearray of little-endian int32 (extended
by the tokens added since its last proposal), so the lookup is a C-speed
``bytearray.rfind`` (and, without k tokens after, a ``find`` over the last k + n) per n; a match at an offset
that is not a whole token is skipped.
"""

from __future__ import annotations

from array import array

from asyncllm.spec.config import SpeculativeConfig

__all__ = ["NgramProposer"]

_WIDTH = array("i").itemsize


class NgramProposer:
    """Proposes each step's drafts from the request's own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self.min_size = config.prompt_lookup_min

    def propose(self, token_ids: list[int], buffer: bytearray, max_drafts: int) -> list[int]:
        """Up to ``min(k, max_drafts)`` drafts for the tokens after ``token_ids``; ``buffer`` holds a prefix of
        them as int32 bytes and is brought up to date here."""
        num_tokens = len(token_ids)
        known = len(buffer) // _WIDTH
        if known < num_tokens:
            buffer += array("i", token_ids[known:]).tobytes()
        k = min(self.k, max_drafts)
        if k <= 0 or num_tokens <= self.min_size:
            return []
        for n in self.sizes:
            if n >= num_tokens:
                continue
            pattern = bytes(buffer[(num_tokens - n) * _WIDTH :])
            # the latest occurrence followed by k tokens; else the earliest, which has the most tokens after it
            # (every occurrence then starts past num_tokens - k - n, where the rfind looked)
            start = -1
            if num_tokens - k >= n:
                start = _rfind_token_aligned(buffer, pattern, (num_tokens - k) * _WIDTH)
            if start < 0:
                start = _find_token_aligned(buffer, pattern, max(0, num_tokens - k - n + 1), num_tokens - 1)
            if start >= 0:
                follow = start + n
                return token_ids[follow : follow + k]
        return []


def _find_token_aligned(buffer: bytearray, pattern: bytes, first: int, end: int) -> int:
    """The token index of the first whole-token occurrence of ``pattern`` in tokens ``[first, end)``, or -1."""
    at = first * _WIDTH
    while True:
        at = buffer.find(pattern, at, end * _WIDTH)
        if at < 0:
            return -1
        if at % _WIDTH == 0:
            return at // _WIDTH
        at += 1  # a match starting after this one


def _rfind_token_aligned(buffer: bytearray, pattern: bytes, end: int) -> int:
    """The token index of the last whole-token occurrence of ``pattern`` in ``buffer[:end]``, or -1."""
    while True:
        at = buffer.rfind(pattern, 0, end)
        if at < 0:
            return -1
        if at % _WIDTH == 0:
            return at // _WIDTH
        end = at + len(pattern) - 1  # a match starting before this one
