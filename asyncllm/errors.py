"""The exception tree of asyncllm.

Every error the library raises on purpose derives from :class:`AsyncLLMError`;
third-party exceptions are mapped to one of these at the edge::

    AsyncLLMError
     +-- ConfigError              bad EngineConfig field, unknown model, unbuilt feature
     |    +-- NotBuiltError       a configured feature that asyncllm does not implement yet
     +-- InvalidRequestError      bad prompt or sampling parameter (``.field`` names it)
     +-- EngineOverloadedError    admission control refused the request
     +-- RequestTimeoutError      the request's deadline passed
     +-- RequestAbortedError      `AsyncEngine.abort` (or the engine's close) ended a request that has no partial result
     +-- EngineDeadError          the engine core or a worker died and was not recovered
     +-- EventLoopError           an AsyncEngine used from an event loop other than the one it started in
                                  (or from a loop that is not asyncio's: `running_asyncio_loop`)

`check_context_length` raises the one error clients branch on by its code and words (vLLM's, with OpenAI's
``context_length_exceeded``; a pooling request's prompt may fill the context, its API named in
`POOLING_OPERATIONS`' word); it lives here so that the host and the OpenAI server (its beam search) share it
without importing asyncllm.engine. ``__all__`` is the exception tree (which ``asyncllm`` re-exports).
"""

from __future__ import annotations

import asyncio

__all__ = [
    "AsyncLLMError",
    "ConfigError",
    "NotBuiltError",
    "InvalidRequestError",
    "EngineOverloadedError",
    "RequestTimeoutError",
    "RequestAbortedError",
    "EngineDeadError",
    "EventLoopError",
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
        self.value_repr = value_repr if value_repr is not None else repr(value)
        """How the message shows the value (a worker's error keeps its repr across processes)."""
        super().__init__(f"{field}={self.value_repr} is not allowed: {allowed}")


class NotBuiltError(ConfigError):
    """The configuration asks for a feature asyncllm does not implement yet; ``where`` (a worker's
    " (worker rank 0)") follows the sentence, so ``feature`` names the feature alone."""

    def __init__(self, field: str, value: object, feature: str, *, value_repr: str | None = None,
                 where: str = "") -> None:
        super().__init__(field, value, f"{feature} is not built yet in asyncllm{where}", value_repr=value_repr)
        self.feature = feature
        self.where = where


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


class RequestAbortedError(AsyncLLMError):
    """`AsyncEngine.abort` (or the engine's close) ended a request whose result cannot be partial: an embedding,
    classification or score request aborted before it was pooled. (An aborted generation returns what it has,
    finish_reason "abort".)"""


class EngineDeadError(AsyncLLMError, RuntimeError):
    """The engine core or a worker died and could not be recovered."""


class EventLoopError(AsyncLLMError, RuntimeError):
    """An `AsyncEngine` was used from an event loop other than the one it started in while that one is still open
    (its outputs are delivered there), or from a loop that is not asyncio's (trio); a RuntimeError, as asyncio's own
    "attached to a different loop"."""


def running_asyncio_loop() -> asyncio.AbstractEventLoop:
    """The running asyncio event loop; under another async library (trio, anyio's trio backend), whose coroutines
    find none, an `EventLoopError` saying so where asyncio's bare "no running event loop" would not."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise EventLoopError(
            "no asyncio event loop is running here, and asyncllm runs on asyncio only (trio, and anyio's trio "
            "backend, are not supported): run it under asyncio.run, or anyio.run(main) with the default asyncio "
            "backend (see docs/integrations/task-runners.md, \"Event loops\")") from None


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's error code of a request longer than the model's context (clients detect overflow by it)."""


POOLING_OPERATIONS = {"embed": "embedding generation", "classify": "classification", "score": "score",
                      "rerank": "embedding generation", "pooling": "embedding generation",
                      "token_embed": "embedding generation", "token_classify": "embedding generation"}
"""A pooling API's operation in vLLM's context-length error, by the API whatever the model (vLLM keys the word by
the request's type: /score says "score" on an embedding model too, and /rerank, not in its mapping, "embedding
generation" on a cross-encoder too, as /pooling, whose request is an embedding request's subclass, whatever its
task). `embed` and `classify` are also the `PoolingParams.task`s."""


def check_context_length(max_model_len: int, prompt_tokens: int, max_tokens: int | None = None, *,
                         operation: str | None = None, field: str = "prompt", echo_only: bool = False) -> None:
    """`InvalidRequestError` (code `CONTEXT_LENGTH_EXCEEDED`, in vLLM's words, which clients detecting context
    overflow match) for a request that does not fit in `max_model_len`: a prompt that leaves no room for one
    generated token, else, with `max_tokens` (a request that set it), a prompt plus `max_tokens` past it. vLLM's
    order: the prompt alone first. `operation`: a pooling request's (a `POOLING_OPERATIONS` word): it generates
    nothing, so its prompt may fill `max_model_len`; so may an `echo_only` one's (the OpenAI server's echo with
    max_tokens 0, which drops its one sampled token: vLLM's server counts its max_tokens as 0). `field`: the
    prompt's (``prompt.prompt_embeds`` for rows of embeddings)."""
    if operation is not None or echo_only:
        if prompt_tokens > max_model_len:
            amount = f"{prompt_tokens} {'tokens' if operation is not None else 'input tokens'}"
            raise prompt_too_long(max_model_len, amount, operation, field)
        return
    if prompt_tokens >= max_model_len:
        raise prompt_too_long(max_model_len, f"{prompt_tokens} input tokens", None, field)
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError("max_tokens", f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                                                f"This model's maximum context length is {max_model_len} tokens and "
                                                f"your request has {prompt_tokens} input tokens ({max_tokens} > "
                                                f"{max_model_len} - {prompt_tokens}).", code=CONTEXT_LENGTH_EXCEEDED)


def prompt_too_long(max_model_len: int, amount: str, operation: str | None,
                    field: str = "prompt") -> InvalidRequestError:
    """The error of a prompt of `amount` ("9 tokens") past `max_model_len`, in vLLM's words: a pooling request's
    names its `operation` (a `POOLING_OPERATIONS` word), a generation's (None) does not."""
    if operation is not None:
        said = f"you requested {amount} in the input for {operation}. Please reduce the length of the input."
    else:
        said = f"your request has {amount}. Please reduce the length of the input messages."
    return InvalidRequestError(field, f"This model's maximum context length is {max_model_len} tokens. However, "
                                      f"{said}", code=CONTEXT_LENGTH_EXCEEDED)


def prompt_too_many_chars(max_model_len: int, chars: int, tokens: int, operation: str | None,
                          field: str = "prompt") -> InvalidRequestError:
    """`prompt_too_long` of a text of `chars` characters refused before it was tokenized whole: its parts already
    made at least `tokens` tokens. In its words, the amount "C characters, at least P input tokens" (a pooling
    request's "P tokens"): a generation's reads as any prompt's past `max_model_len`; `field`: "prompt", a chat's
    "messages"."""
    unit = "tokens" if operation is not None else "input tokens"
    return prompt_too_long(max_model_len, f"{chars} characters, at least {tokens} {unit}", operation, field=field)


def check_remote_code(exc: Exception, trust_remote_code: bool, path: str, what: str) -> None:
    """`ConfigError` naming ``trust_remote_code`` when transformers refused to load `what` ("configuration",
    "tokenizer") at `path` because it needs the checkpoint's own code (its ``auto_map``) and the flag is off."""
    if not trust_remote_code and "trust_remote_code" in str(exc):
        raise ConfigError("trust_remote_code", False, f"True to run {path}'s own {what} code (its auto_map), if "
                                                      "you trust it") from exc
