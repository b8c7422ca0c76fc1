"""OpenAI's request fields beyond the generation itself, which the official client offers as typed arguments:
``stream_options`` (completions', chat completions' and the Responses API's) and the hosted service's fields.

Each is declared, so that the client's arguments are not unknown fields, and each value is either one that a
self-hosted server honours by doing nothing (accepted, not used), or a 400 naming the field; one option is accepted
and not read although it asks for something: chat's ``verbosity``, as vLLM (docs/integrations/openai-server.md,
"Parameters"):

- accepted, not used: ``metadata`` within OpenAI's bounds (`METADATA_LIMITS`; the Responses API echoes it),
  ``service_tier`` any of OpenAI's `SERVICE_TIERS` (this server has one tier; vLLM's Responses API takes and echoes
  them, its chat completions ignore the field), ``prompt_cache_key`` (prefix caching needs no key; vLLM ignores it),
  ``safety_identifier`` (as ``user``: the caller's abuse tracking), and
  ``stream_options.include_obfuscation: false`` (no padding is sent); chat's ``store: false`` (nothing is kept),
  ``modalities: ["text"]`` and ``verbosity`` (as the Responses API's ``text.verbosity``: read by no template here,
  as in vLLM);
- refused: ``include_obfuscation: true`` (the padding against size side channels is not built), a
  ``service_tier`` not OpenAI's, chat's ``store: true`` (stored chat completions are not built), ``modalities``
  other than ``"text"`` (audio output), ``prediction`` (predicted outputs) and ``web_search_options`` (web search); the
  Responses API's ``prompt`` and ``conversation`` (responses_api.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from asyncllm.errors import InvalidRequestError

__all__ = ["METADATA_LIMITS", "SERVICE_TIERS", "Metadata", "Verbosity", "BaseStreamOptions", "StreamOptions",
           "check_stream_options", "check_service_fields", "check_chat_service_fields", "refuse_failed"]

METADATA_LIMITS = (16, 64, 512)
"""OpenAI's bounds of ``metadata``: pairs, characters of a key, of a value."""
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
"""OpenAI's ``service_tier`` values (vLLM's ``ResponsesRequest``'s): each accepted and served alike."""

Metadata = dict[str, str] | None
"""OpenAI's ``metadata``: string pairs within `METADATA_LIMITS` (`check_service_fields`)."""
Verbosity = Literal["low", "medium", "high"] | None
"""OpenAI's ``verbosity`` (chat's, the Responses API's ``text.verbosity``): accepted and not read."""


class BaseStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The field every endpoint's ``stream_options`` has: the Responses API's whole (`StreamOptions` adds usage)."""

    include_obfuscation: bool | None = None
    """OpenAI's random ``obfuscation`` padding of stream events (against size side channels): not built, so only
    false or null (`check_stream_options`)."""


class StreamOptions(BaseStreamOptions, forbid_unknown_fields=True):
    """vLLM's (``include_usage: bool | None = True``): ``{}`` asks for the usage chunk, null reads as false (vLLM's
    ``bool(include_usage)``). A field left out is UNSET, so that `check_stream_options` refuses, as vLLM, stream
    options that set anything on a request without ``stream``."""

    include_usage: bool | None | UnsetType = UNSET
    """Send one last chunk with the request's token usage (and no choices); left out: true (`usage`)."""
    continuous_usage_stats: bool | None | UnsetType = UNSET
    """vLLM's: with include_usage, every chunk carries the usage so far (instead of null); left out: false."""

    @property
    def usage(self) -> bool:
        """Whether the stream ends with the usage chunk."""
        return self.include_usage is UNSET or bool(self.include_usage)

    @property
    def continuous(self) -> bool:
        """Whether every chunk carries the usage so far (only with `usage`, as vLLM's ``should_include_usage``)."""
        return self.usage and bool(self.continuous_usage_stats)


def check_stream_options(options: BaseStreamOptions | None, stream: bool) -> None:
    """As vLLM's ``validate_stream_options``, options that set a field without ``stream: true`` are refused ({} and
    null pass); so is ``include_obfuscation: true``."""
    if options is None:
        return
    refuse_failed([
        (not stream and options != type(options)(), "stream_options",
         "Stream options can only be defined when stream=True"),
        (bool(options.include_obfuscation), "stream_options.include_obfuscation",
         "stream obfuscation is not built (false or left out: no obfuscation field is sent)"),
    ])


def check_service_fields(req: Any) -> None:
    """The hosted service's fields chat completions and the Responses API share: ``service_tier`` and ``metadata``
    (``prompt_cache_key`` and ``safety_identifier`` take any string)."""
    refuse_failed([(req.service_tier is not None and req.service_tier not in SERVICE_TIERS, "service_tier",
                    f"must be one of {', '.join(map(repr, SERVICE_TIERS))} (all served alike: this server has one "
                    f"tier), got {req.service_tier!r}")])
    _check_metadata(req.metadata or {})


def check_chat_service_fields(req: Any) -> None:
    """A chat completion's own (`check_service_fields` too): ``store``, ``modalities``, ``prediction`` and
    ``web_search_options`` asking for what is not built."""
    refuse_failed([
        (req.store is True, "store", "storing chat completions is not built (the Responses API stores responses)"),
        (any(kind != "text" for kind in req.modalities or ()), "modalities", "only text output is built (['text'])"),
        (req.prediction is not None, "prediction", "predicted outputs are not built"),
        (req.web_search_options is not None, "web_search_options", "web search is not built"),
    ])
    check_service_fields(req)


def refuse_failed(checks: Iterable[tuple[bool, str, str]]) -> None:
    """`InvalidRequestError` for the first (failed, field, why) that failed."""
    for failed, field, why in checks:
        if failed:
            raise InvalidRequestError(field, why)


def _check_metadata(metadata: dict[str, str]) -> None:
    """OpenAI's bounds (`METADATA_LIMITS`), which also bound what the response store keeps of it."""
    pairs, key_chars, value_chars = METADATA_LIMITS
    if len(metadata) > pairs:
        raise InvalidRequestError("metadata", f"at most {pairs} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > key_chars:
            raise InvalidRequestError("metadata", f"a key has at most {key_chars} characters, got {len(key)}")
        if len(value) > value_chars:
            raise InvalidRequestError("metadata", f"the value of {key!r} has at most {value_chars} characters, "
                                                  f"got {len(value)}")
