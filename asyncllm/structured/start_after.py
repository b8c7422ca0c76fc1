"""A constraint's ``start_after`` text resolved against the prompt on the host's processor thread.

A reasoning model's constraint starts after its thinking (``start_after="</think>"``): the core needs the
marker as token ids. When the prompt's end already wrote it (a template that turned thinking off ends the
prompt with ``<think>\\n\\n</think>\\n\\n``), the constraint applies from the first generated token instead.
`prompt_wrote_marker` is that rule; the server's reasoning parsers read such a prompt's reply as all answer with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from asyncllm.engine.validation import check_params_vocab
from asyncllm.sampling import SamplingParams

__all__ = ["with_start_after_ids", "marker_ids", "prompt_wrote_marker"]

_SLACK = 8
"""Tokens after the marker at the prompt's end that still count as "already written" (Qwen3 without thinking)."""


def marker_ids(tokenizer: Any, marker: str) -> list[int]:
    """`marker`'s token ids (no special tokens added)."""
    return [int(t) for t in tokenizer.encode(marker, add_special_tokens=False)]


def prompt_wrote_marker(prompt_ids: Sequence[int], ids: Sequence[int]) -> bool:
    """Whether the prompt's end already wrote the marker `ids` (within `_SLACK` tokens of its end)."""
    ids = list(ids)
    tail = list(prompt_ids[-len(ids) - _SLACK:])
    return bool(ids) and any(tail[i:i + len(ids)] == ids for i in range(len(tail) - len(ids) + 1))


def with_start_after_ids(params: SamplingParams, prompt_ids: list[int], tokenizer: Any,
                         vocab_size: int) -> SamplingParams:
    """``params`` with its constraint's ``start_after`` as token ids, or dropped when the prompt's end wrote it."""
    structured = params.structured
    if structured is None or structured.start_after is None or structured.start_after_token_ids:
        return params
    ids = marker_ids(tokenizer, structured.start_after)
    done = prompt_wrote_marker(prompt_ids, ids)
    structured = msgspec.structs.replace(structured, start_after=None) if done else msgspec.structs.replace(
        structured, start_after_token_ids=ids)
    params = msgspec.structs.replace(params, structured=structured)
    check_params_vocab(params, vocab_size)
    return params
