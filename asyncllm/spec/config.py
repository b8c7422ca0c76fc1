"""`SpeculativeConfig`: the ``speculative_config`` dict, read as vLLM reads it.

Only the n-gram method (prompt lookup) is built: drafts are copied from an
earlier place in the request's own tokens, so no draft model runs. Every
other vLLM method is a `NotBuiltError` naming it; an unknown key is a
`ConfigError`, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["SpeculativeConfig"]

_FIELD = "speculative_config"
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
_DEFAULT_LOOKUP = 5
"""vLLM's n-gram size when neither prompt_lookup_min nor prompt_lookup_max is given."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram speculation: up to `num_speculative_tokens` drafts per decode step."""

    num_speculative_tokens: int
    """Drafts proposed per request and step (the step computes this many tokens more per request)."""
    prompt_lookup_min: int
    """Shortest suffix of the request's tokens looked up earlier in them."""
    prompt_lookup_max: int
    """Longest such suffix: the longest one that matches decides the drafts."""

    @classmethod
    def from_dict(cls, value: Any) -> "SpeculativeConfig":
        """Validate vLLM's dict form: ``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}``."""
        if not isinstance(value, dict):
            raise ConfigError(_FIELD, value, "a dict such as {'method': 'ngram', 'num_speculative_tokens': 5}, or None")
        if value.get("model") is not None:
            raise NotBuiltError(_FIELD, value, "speculative decoding with a draft model (only method='ngram')")
        unknown = sorted(set(value) - set(_KEYS) - {"model"})
        if unknown:
            raise ConfigError(_FIELD, value, f"only the keys {', '.join(_KEYS)} (unknown: {', '.join(unknown)})")
        method = value.get("method")
        if method in _MODEL_METHODS:
            raise NotBuiltError(_FIELD, value, f"speculative decoding with method={method!r} (only 'ngram')")
        if method != "ngram":
            raise ConfigError(_FIELD, value, "method='ngram' (the one speculation method built)")
        num = value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = _DEFAULT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for key, n in (("num_speculative_tokens", num), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
                raise ConfigError(_FIELD, value, f"{key} an int in [1, 64] (num_speculative_tokens is required)")
        if lo > hi:
            raise ConfigError(_FIELD, value, "prompt_lookup_min <= prompt_lookup_max")
        return cls(num, lo, hi)
