"""`SamplingParams`: how one request is sampled and when it stops.

A msgspec Struct so that it crosses the host -> core -> worker wire as is.
`validate()` raises `InvalidRequestError` naming the field; the host calls it
before a request leaves the process.
"""

from __future__ import annotations

import math

import msgspec

from asyncllm.errors import InvalidRequestError

__all__ = ["SamplingParams"]

_MAX_SEED = 2**63 - 1


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """Sampling and stopping parameters of one request (vLLM's names and defaults)."""

    n: int = 1
    """Number of samples to return (only 1 is built so far)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 means all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is batched."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to max_model_len."""
    min_tokens: int = 0
    """Tokens to generate before EOS or stop_token_ids may end the request."""
    stop: list[str] = []
    """Strings that end generation; they are not included in the text."""
    stop_token_ids: list[int] = []
    """Token ids that end generation (the token is kept in token_ids)."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the decoded text."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first bad field."""
        _check_int("n", self.n, 1, 1, "only n=1 is built so far")
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError("top_p", "must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, -1, 2**31 - 1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, _MAX_SEED)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _check_int("min_tokens", self.min_tokens, 0, 2**31 - 1)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"{self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop", "must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be a list of non-negative token ids")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be a bool, got {getattr(self, name)!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(field: str, value: object, lo: int, hi: int, why: str = "") -> None:
    if not _is_int(value):
        raise InvalidRequestError(field, f"must be an int, got {value!r}")
    if not lo <= value <= hi:  # type: ignore[operator]
        raise InvalidRequestError(field, why or f"must be in [{lo}, {hi}], got {value}")


def _check_float(field: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(field, f"must be a number, got {value!r}")
    if math.isnan(value) or not lo <= value <= hi:
        raise InvalidRequestError(field, f"must be in [{lo}, {hi}], got {value}")
