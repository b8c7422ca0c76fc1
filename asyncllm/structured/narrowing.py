"""The fields that narrow a structured request's tokens whatever its grammar allows (allowed_token_ids, bad_words).

The worker's grammar mask and these fields may leave a step no token at all: the
workers then sample token 0, which the grammar refuses. Where the grammar may end
there (it is complete, and they forbid EOS, the only token left, or its other
tokens too) the request ends with finish_reason "stop" before that token
(`stop_before`); anywhere else the request fails naming them (`rejection`).
docs/sampling.md#structured-output.
"""

from __future__ import annotations

from typing import Any

from asyncllm import protocol
from asyncllm.sched.request import Request

__all__ = ["narrowing", "may_end", "rejection", "stop_before"]


def narrowing(request: Request) -> tuple[str, ...]:
    """The request's fields that forbid tokens whatever the grammar allows: allowed_token_ids, bad_words."""
    params = request.params
    return tuple(name for name, value in (("allowed_token_ids", params.allowed_token_ids),
                                          ("bad_words", params.bad_words_token_ids)) if value)


def may_end(matcher: Any, bitmask: Any) -> bool:
    """Whether the grammar may end where `matcher` stands: it allows one of its stop tokens (EOS) next. Fills row 0
    of `bitmask` (an xgrammar int32 token bitmask)."""
    matcher.fill_next_token_bitmask(bitmask, 0)
    row = bitmask[0].tolist()
    return any(row[token // 32] >> (token % 32) & 1 for token in matcher.stop_token_ids)


def rejection(fields: tuple[str, ...], token: int) -> str:
    """The error of a sampled token the grammar refuses where it may not end: the bitmask let through only tokens
    the grammar allows, so the request's narrowing `fields` forbade all of them (the workers then sample token 0)
    and are named, with the grammar; without them, the grammar alone."""
    if not fields:
        return f"structured: token {token} is not allowed by the grammar"
    together = f" (with {' and '.join(fields[1:])})" if fields[1:] else ""
    return (f"{fields[0]}: forbids every token the grammar (structured output) allows next{together}, so nothing "
            f"can be generated (token {token} was sampled): allow some of the grammar's tokens, or drop "
            f"{' and '.join(fields)}")


def stop_before(client_id: bytes, delta: protocol.RequestOutputDelta,
                num_dropped: int) -> list[tuple[bytes, protocol.RequestOutputDelta]]:
    """End `delta`'s request with "stop" without its last `num_dropped` tokens (the refused one and any after it, and
    their logprobs rows):
    on `delta` itself when no token is left, else on an empty delta to send after it, as the host reads the last
    token of a "stop" delta as the EOS that ended it (its text left out)."""
    delta.new_token_ids = delta.new_token_ids[: len(delta.new_token_ids) - num_dropped]
    delta.logprobs = delta.logprobs and delta.logprobs.first_rows(len(delta.new_token_ids))
    delta.stop_reason = None
    if not delta.new_token_ids:
        delta.finish_reason = "stop"
        return []
    delta.finish_reason = None
    return [(client_id, protocol.RequestOutputDelta(delta.request_id, [], "stop"))]

