"""`SpeculativeConfig`: the ``speculative_config`` dict, read as vLLM reads it.

Five methods are built: ``ngram`` (prompt lookup: drafts copied from an
earlier place in the request's own tokens, proposed by the core),
``draft_model`` (a small model sharing the target's vocabulary runs in the
workers and proposes its greedy continuation; a ``model`` key without a
method means it, as in vLLM), ``eagle`` / ``eagle3`` (an EAGLE head
reading the target's hidden states: asyncllm/models/eagle.py) and ``mtp``
(``deepseek_mtp``, ``qwen3_next_mtp``, ... too: the target checkpoint's own
multi-token-prediction layer, asyncllm/models/mtp.py). Every other vLLM method is a
`NotBuiltError` naming it; an unknown key is a `ConfigError`, never
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["SPEC_FIELD", "SpeculativeConfig"]

SPEC_FIELD = "speculative_config"
"""The config field errors about speculative decoding name."""
_NGRAM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
_DRAFT_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "max_model_len",
               "quantization", "revision")
_HEAD_METHODS = ("draft_model", "eagle", "eagle3")
"""Methods whose drafts come from a network of their own in the workers (a ``model`` key)."""
_MTP_KEYS = ("method", "num_speculative_tokens")
_MTP_ALIASES = ("mtp", "deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp", "qwen3_5_mtp")
"""vLLM's per-family names of ``mtp`` (it maps them to ``mtp`` too)."""
_MODEL_METHODS = ("medusa", "mlp_speculator", "suffix")
_DEFAULT_LOOKUP = 5
"""vLLM's n-gram size when neither prompt_lookup_min nor prompt_lookup_max is given."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Up to `num_speculative_tokens` drafts per decode step, from n-grams or from a draft model."""

    num_speculative_tokens: int
    """Drafts proposed per request and step (the step computes this many tokens more per request)."""
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    """ngram: shortest suffix of the request's tokens looked up earlier in them."""
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    """ngram: longest such suffix: the longest one that matches decides the drafts."""
    method: str = "ngram"
    """``ngram``, ``draft_model``, ``eagle``, ``eagle3`` or ``mtp``."""
    model: str | None = None
    """draft_model / eagle / eagle3: the draft checkpoint (local folder or hub id; the host resolves it to a
    folder)."""
    revision: str | None = None
    """draft_model: the draft checkpoint's hub revision."""
    max_model_len: int | None = None
    """draft_model: no drafts for a request past this length (default: the target's max_model_len, capped by the
    draft's max_position_embeddings times its rope scaling factor)."""
    quantization: str | None = None
    """draft_model: None, or ``fp8`` (the draft's weights quantized at load, or its pre-quantized fp8 checkpoint)."""
    draft_tensor_parallel_size: int | None = None
    """draft_model: must be the target's tensor_parallel_size (None means that); another size is not built."""

    @property
    def uses_draft_model(self) -> bool:
        """Whether a network in the workers drafts: a draft model, an EAGLE head or the target's MTP layer."""
        return self.method in _HEAD_METHODS or self.method == "mtp"

    @classmethod
    def from_dict(cls, value: Any) -> "SpeculativeConfig":
        """Validate vLLM's dict form: ``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}``
        or ``{"model": "path/or/hub-id", "num_speculative_tokens": 5}``."""
        if not isinstance(value, dict):
            raise ConfigError(SPEC_FIELD, value, "a dict such as {'method': 'ngram', 'num_speculative_tokens': 5}, or None")
        method = value.get("method")
        if method is None and value.get("model") is not None:
            method = "draft_model"  # vLLM: a model without a method is a draft model
        if method in _MODEL_METHODS:
            raise NotBuiltError(SPEC_FIELD, value, f"speculative decoding with method={method!r} (only 'ngram', "
                                                   "'draft_model', 'eagle', 'eagle3' and 'mtp')")
        method = "mtp" if method in _MTP_ALIASES else method
        if method not in ("ngram", "mtp") and method not in _HEAD_METHODS:
            raise ConfigError(SPEC_FIELD, value, "method='ngram', 'mtp', or method='draft_model' / 'eagle' / 'eagle3' "
                                                 "with a 'model' (a draft checkpoint sharing the target's vocabulary)")
        keys = {"ngram": _NGRAM_KEYS, "mtp": _MTP_KEYS}.get(method, _DRAFT_KEYS)
        unknown = sorted(set(value) - set(keys))
        if unknown:
            why = "; the MTP layer is the target checkpoint's own" if method == "mtp" else ""
            raise ConfigError(SPEC_FIELD, value, f"with method={method!r} only the keys {', '.join(keys)} "
                                                 f"(unknown: {', '.join(unknown)}{why})")
        num = value.get("num_speculative_tokens")
        _check_int(value, "num_speculative_tokens", num, 64, "(num_speculative_tokens is required)")
        if method == "mtp":
            return cls(num, method="mtp")
        if method in _HEAD_METHODS:
            return _draft_model_config(value, num, method)
        for key in ("prompt_lookup_min", "prompt_lookup_max"):  # the keys given, each named when it is wrong
            if value.get(key) is not None:
                _check_int(value, key, value[key], 64)
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = _DEFAULT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ConfigError(SPEC_FIELD, value, "prompt_lookup_min <= prompt_lookup_max")
        return cls(num, lo, hi)


def _draft_model_config(value: dict, num: int, method: str) -> SpeculativeConfig:
    model, revision, quantization = value.get("model"), value.get("revision"), value.get("quantization")
    if not isinstance(model, str) or not model:
        raise ConfigError(SPEC_FIELD, value, f"method={method!r} with 'model': the draft checkpoint's folder or hub id")
    for key, item in (("revision", revision), ("quantization", quantization)):
        if item is not None and not isinstance(item, str):
            raise ConfigError(SPEC_FIELD, value, f"{key} a string or None")
    if quantization not in (None, "fp8") or (quantization is not None and method != "draft_model"):
        allowed = "None or 'fp8'" if method == "draft_model" else "None"
        raise NotBuiltError(SPEC_FIELD, value, f"a {method} draft with quantization={quantization!r} ({allowed})")
    max_len, draft_tp = value.get("max_model_len"), value.get("draft_tensor_parallel_size")
    if max_len is not None:
        _check_int(value, "max_model_len", max_len, 2**31)
    if draft_tp is not None:
        _check_int(value, "draft_tensor_parallel_size", draft_tp, 64)
    return SpeculativeConfig(num, method=method, model=model, revision=revision, max_model_len=max_len,
                             quantization=quantization, draft_tensor_parallel_size=draft_tp)


def _check_int(value: dict, key: str, n: Any, hi: int, more: str = "") -> None:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= hi:
        raise ConfigError(SPEC_FIELD, value, f"{key} an int in [1, {hi}] {more}".rstrip())
