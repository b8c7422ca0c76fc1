"""The exception tree of asyncllm.

Every error the library raises on purpose derives from :class:`AsyncLLMError`;
third-party exceptions are mapped to one of these at the edge::

    AsyncLLMError
     +-- ConfigError              bad EngineConfig field, unknown model, unbuilt feature
     |    +-- NotBuiltError       a configured feature that asyncllm does not implement yet
     +-- InvalidRequestError      bad prompt or sampling parameter (``.field`` names it)
     +-- EngineOverloadedError    admission control refused the request
     +-- RequestTimeoutError      the request's deadline passed
     +-- EngineDeadError          the engine core or a worker died and was not recovered
"""

from __future__ import annotations

__all__ = [
    "AsyncLLMError",
    "ConfigError",
    "NotBuiltError",
    "InvalidRequestError",
    "EngineOverloadedError",
    "RequestTimeoutError",
    "EngineDeadError",
]


class AsyncLLMError(Exception):
    """Root of every error asyncllm raises on purpose."""


class ConfigError(AsyncLLMError, ValueError):
    """An `EngineConfig` field has a value that is not allowed.

    ``field`` names the field, ``value`` is what was given.
    """

    def __init__(self, field: str, value: object, allowed: str, *, value_repr: str | None = None) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        shown = value_repr if value_repr is not None else repr(value)
        super().__init__(f"{field}={shown} is not allowed: {allowed}")


class NotBuiltError(ConfigError):
    """The configuration asks for a feature asyncllm does not implement yet."""

    def __init__(self, field: str, value: object, feature: str) -> None:
        super().__init__(field, value, f"{feature} is not built yet in asyncllm")
        self.feature = feature


class InvalidRequestError(AsyncLLMError, ValueError):
    """A prompt or sampling parameter is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str, *, code: str | None = None) -> None:
        self.field = field
        self.message = message
        """What was wrong, without the field name."""
        self.code = code
        """OpenAI's error code, for clients that branch on it (``context_length_exceeded``); None: none."""
        super().__init__(f"{field}: {message}")


class EngineOverloadedError(AsyncLLMError):
    """Admission control refused the request (the queue is full)."""


class RequestTimeoutError(AsyncLLMError, TimeoutError):
    """The request did not finish before its deadline."""


class EngineDeadError(AsyncLLMError, RuntimeError):
    """The engine core or a worker died and could not be recovered."""
