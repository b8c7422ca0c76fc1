"""HTTP status and OpenAI-style error bodies for asyncllm errors, for every web adapter.

``{"error": {"message", "type", "param", "code"}}``, as the official OpenAI
clients parse it (``openai.BadRequestError`` for 400, ``RateLimitError`` for
429, ...). Framework-free: each adapter wraps the body in its own response.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

from asyncllm.errors import (
    CONTEXT_LENGTH_EXCEEDED, AsyncLLMError, ConfigError, EngineDeadError, EngineOverloadedError, InvalidRequestError,
    RequestAbortedError, RequestTimeoutError,
)

__all__ = ["CONTEXT_PARAM", "ApiError", "context_param", "error_body", "renamed_error", "renamed_fields", "status_of",
           "text_stream_end"]

logger = logging.getLogger("asyncllm.integrations")


class ApiError(Exception):
    """An HTTP-level refusal that is not an engine error (auth, routing, body size)."""

    def __init__(self, status: int, message: str, type: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


_STATUS = (
    # (error class, HTTP status, OpenAI error type, code), most specific first
    (InvalidRequestError, 400, "invalid_request_error", None),
    (EngineOverloadedError, 429, "rate_limit_error", "engine_overloaded"),
    (RequestTimeoutError, 408, "timeout_error", "request_timeout"),
    (RequestAbortedError, 500, "server_error", "request_aborted"),  # `AsyncEngine.abort` from the host's own code
    (EngineDeadError, 503, "server_error", "engine_dead"),
    (ConfigError, 503, "server_error", "engine_misconfigured"),
)


def status_of(exc: AsyncLLMError) -> tuple[int, str, str | None]:
    """(HTTP status, OpenAI error type, code) of an asyncllm error; 500 for an unmapped one."""
    for cls, status, kind, code in _STATUS:
        if isinstance(exc, cls):
            return status, kind, code
    return 500, "server_error", None


@contextlib.contextmanager
def renamed_fields(renames: Mapping[str, str], *, uncoded_only: bool = False) -> Iterator[None]:
    """An `InvalidRequestError` raised inside names the field the client wrote (`renames`: the name the engine or
    a translated request gives it -> the client's), as clients read ``param``. A field within a renamed one
    (``messages[0].content[1]``) is named by the client's whole field (``input``): its items need not be the
    translated request's one for one. `uncoded_only`: an error with a ``code`` (``context_length_exceeded``)
    keeps its field, ``prompt`` on every route."""
    try:
        yield
    except InvalidRequestError as exc:
        renamed = renamed_error(exc, renames, uncoded_only=uncoded_only)
        if renamed is exc:
            raise
        raise renamed from None


def renamed_error(exc: InvalidRequestError, renames: Mapping[str, str], *,
                  uncoded_only: bool = False) -> InvalidRequestError:
    """`exc` naming the client's field (`renamed_fields`' rule), or `exc` itself when it names none of `renames`."""
    field = exc.field if exc.field in renames else re.split(r"[\[.]", exc.field, maxsplit=1)[0]
    if field not in renames or (uncoded_only and exc.code is not None):
        return exc
    return InvalidRequestError(renames[field], _renamed_message(exc.message, renames, renames[field]), code=exc.code)


CONTEXT_PARAM = "input_tokens"
"""The ``param`` of a prompt past max_model_len on the OpenAI routes: vLLM's (its ``VLLMValidationError``
parameter since 0.12; 0.11 and earlier name none)."""
_MAX_TOKENS_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})


def context_param(exc: Exception) -> Exception:
    """`exc` naming `CONTEXT_PARAM` when it is a prompt's context-length error (code ``context_length_exceeded``,
    found in ``prompt``, a chat's ``messages``, a pooling ``input``, ...), as vLLM's OpenAI server names it on every
    route; a ``max_tokens`` past the context keeps its field, as there."""
    if (not isinstance(exc, InvalidRequestError) or exc.code != CONTEXT_LENGTH_EXCEEDED
            or exc.field in _MAX_TOKENS_FIELDS or exc.field == CONTEXT_PARAM):
        return exc
    return InvalidRequestError(CONTEXT_PARAM, exc.message, code=exc.code)


def _renamed_message(message: str, renames: Mapping[str, str], client_field: str) -> str:
    """`message` with the quoted names it gives `client_field` (``'max_tokens' or 'max_completion_tokens'``) as
    the client's (``'max_output_tokens'``); as it was where it already quotes the client's name."""
    if f"'{client_field}'" in message:
        return message
    names = "|".join(re.escape(name) for name, to in renames.items() if to == client_field)
    return re.sub(rf"'(?:{names})'(?: or '(?:{names})')*", f"'{client_field}'", message)


def error_body(exc: AsyncLLMError | ApiError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, extra headers): 429 and 503 say ``Retry-After`` so clients back off."""
    if isinstance(exc, ApiError):
        status, kind, code, param, message = exc.status, exc.type, exc.code, exc.param, exc.message
    else:
        status, kind, code = status_of(exc)
        param = exc.field if isinstance(exc, InvalidRequestError) else None
        message = str(exc)
        if isinstance(exc, InvalidRequestError) and exc.code is not None:  # context_length_exceeded
            code, message = exc.code, exc.message  # no "field: " prefix: clients match the message anchored
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, headers


def text_stream_end(exc: Exception) -> str:
    """The end of a text stream (the web adapters' `stream_text`, `text_stream_response`, `stream_response`) that
    `exc` broke off after its status line went out (its request already aborted by the caller): a line of its own
    with the error body a status-line error has, so the client reads why the text stopped, and the body then ends
    as usual (it was a traceback in the framework's log and a connection cut mid-body). An unexpected exception (a
    bug: no asyncllm error) is logged with its traceback and reported as the 500 ``internal error: <type>``."""
    error: AsyncLLMError | ApiError
    if isinstance(exc, AsyncLLMError):
        error = exc
    else:
        logger.error("unexpected error in a text stream", exc_info=exc)
        error = ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
    return "\n" + json.dumps(error_body(error)[1], ensure_ascii=False) + "\n"
