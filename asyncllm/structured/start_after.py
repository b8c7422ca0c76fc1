"""A constraint's ``start_after`` text resolved against the prompt on the host's processor thread.

A reasoning model's constraint starts after its thinking (``start_after="</think>"``): the core needs the
marker as token ids. When the prompt's end already wrote it (a template that turned thinking off ends the
prompt with ``<think>\\n\\n</think>\\n\\n``), the constraint applies from the first generated token instead.
`Marker.starts_answer` is that rule (with a request that turned the thinking off: at once unless the prompt's end
opened it); the server's reasoning parsers read such a prompt's reply as all answer with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncllm.engine.validation import check_params_vocab
from asyncllm.sampling import SamplingParams
from asyncllm.structured.spec import StructuredOutputs

__all__ = ["Marker", "with_start_after_ids"]

_SLACK = 8
"""Tokens after the marker at the prompt's end that still count as "already written" (Qwen3 without thinking)."""


@dataclass(frozen=True)
class Marker:
    """A closing tag as token ids (``</think>``) and its opening tag's (``<think>``: the text without its first "/",
    unless given: `StructuredOutputs.start_after_opener`, `ReasoningParser.opener`; none for a tag without one). With
    a `suffix`, the marker is `ids` then `suffix` with fewer than `max_between` tokens between (gpt-oss's
    ``<|channel|>final`` ... ``<|message|>``, where harmony may write ``<|constrain|>json`` between: vLLM's
    openai_gptoss ``is_reasoning_end``). `after_space`: the whitespace tokens before the output's first other token
    do not decide whether it opens (`StructuredOutputs.start_after_opener_after_space`, the core's)."""

    ids: tuple[int, ...]
    opener: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    max_between: int = 0
    after_space: bool = False

    @classmethod
    def of(cls, tokenizer: Any, text: str, suffix: str | None = None, max_between: int = 0,
           opener: str | None = None) -> "Marker":
        """`text` (and its `suffix`) as token ids; its `opener` when given (a reasoning parser's start tag, as
        Hunyuan-A13B's ``<think>\\n`` for its ``</think>\\n<answer>\\n``), else `text` without its first "/"."""
        if suffix is not None:
            return cls(_ids(tokenizer, text), (), _ids(tokenizer, suffix), max_between)
        opener = text.replace("/", "", 1) if opener is None else opener
        return cls(_ids(tokenizer, text), _ids(tokenizer, opener) if opener != text else ())

    @classmethod
    def of_structured(cls, structured: StructuredOutputs) -> "Marker":
        """The marker of a constraint whose start_after is in token ids (the core's); its opener only when the output's
        first token decides whether it waits (`StructuredOutputs.start_after_only_if_reply_opens`)."""
        opener = structured.start_after_opener_token_ids if structured.start_after_only_if_reply_opens else []
        return cls(tuple(structured.start_after_token_ids), tuple(opener),
                   tuple(structured.start_after_suffix_token_ids), structured.start_after_max_between,
                   bool(opener) and structured.start_after_opener_after_space)

    @property
    def span(self) -> int:
        """The most tokens the marker takes."""
        return len(self.ids) + (len(self.suffix) + self.max_between - 1 if self.suffix else 0)

    def spans(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """(start, end) of each marker written in `tokens`, in order of their ends."""
        tokens = list(tokens)
        starts = _found(tokens, self.ids) if self.ids else []
        if not self.suffix:
            return [(i, i + len(self.ids)) for i in starts]
        suffixes, by_end = _found(tokens, self.suffix), {}
        for i in starts:  # each start with the first suffix after it (not a later turn's ``<|message|>``)
            after = [j for j in suffixes if j >= i + len(self.ids)]
            if after and after[0] - (i + len(self.ids)) < self.max_between:
                by_end.setdefault(after[0] + len(self.suffix), i)
        return [(i, end) for end, i in by_end.items()]  # starts in order: so are their ends

    def ends(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` end with the marker (checked per sampled token in the core's step loop)."""
        if not self.suffix:
            return bool(self.ids) and tuple(tokens[-len(self.ids):]) == self.ids
        spans = self.spans(tokens[-self.span:])
        return bool(spans) and spans[-1][1] == min(len(tokens), self.span)

    def written_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt's end already wrote the marker (ending within `_SLACK` tokens of its end) and did not
        open it again after it (Qwen3.5 ends a prompt with ``<think>\\n`` after a user text that holds ``</think>``).
        A marker with a suffix (gpt-oss's final header) must end the prompt itself: an earlier turn's, however
        short that turn and the ones after it, is not this reply's."""
        tail = list(prompt_ids[-self.span - _SLACK:])
        spans = self.spans(tail)
        slack = 0 if self.suffix else _SLACK
        return bool(spans) and len(tail) - spans[-1][1] <= slack and not (
            self.opener and _found(tail[spans[-1][1]:], self.opener))

    def opened_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt's end opened the thinking: the opener within `_SLACK` tokens of its end, no marker after
        it (Qwen3-Thinking-2507's template ends every prompt with ``<think>\\n``, whatever ``enable_thinking`` says)."""
        tail = list(prompt_ids[-len(self.opener) - _SLACK:]) if self.opener else []
        opens = _found(tail, self.opener) if tail else []
        return bool(opens) and not any(start >= opens[-1] for start, _ in self.spans(tail))

    def starts_answer(self, prompt_ids: Sequence[int], thinking_off: bool = False) -> bool:
        """Whether a reply to this prompt is all answer (a constraint applies at once): the prompt's end wrote the
        marker, or the request turned the thinking off (`ReasoningParser.thinking_off`) and the prompt's end did not
        open it; otherwise the reply thinks until the marker."""
        return self.written_by(prompt_ids) or (thinking_off and not self.opened_by(prompt_ids))

    def spanned(self, token_ids: Sequence[int], opened: bool) -> int:
        """The tokens between the opening tag and this marker in a reply's `token_ids`, neither counted (vLLM's
        ``count_reasoning_tokens``): from after the first opener, else from the start when `opened` (the prompt
        opened the thinking), to the first marker after, else to the end; 0 when nothing opened it."""
        tokens = list(token_ids)
        starts = _found(tokens, self.opener) if self.opener else []
        if not starts and not opened:
            return 0
        begin = starts[0] + len(self.opener) if starts else 0
        ends = [start for start, _ in self.spans(tokens) if start >= begin]
        return (ends[0] if ends else len(tokens)) - begin


def _ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))


def _found(tokens: list[int], ids: tuple[int, ...]) -> list[int]:
    """Where `ids` start in `tokens`."""
    return [i for i in range(len(tokens) - len(ids) + 1) if tuple(tokens[i:i + len(ids)]) == ids]


def with_start_after_ids(params: SamplingParams, prompt_ids: list[int], tokenizer: Any,
                         vocab_size: int) -> SamplingParams:
    """``params`` with its constraint's ``start_after`` as token ids (the caller's kept), or dropped when the prompt's
    end wrote it; with ``start_after_only_if_reply_opens``, its opener's id when one token (the caller's kept), the
    flag dropped when the prompt's end opened it (the output thinks: it waits)."""
    structured = params.structured
    if structured is None or structured.start_after is None:
        return params
    marker = Marker.of(tokenizer, structured.start_after, structured.start_after_suffix,
                       structured.start_after_max_between, structured.start_after_opener)
    if structured.start_after_only_if_reply_opens and marker.opened_by(prompt_ids):
        structured = msgspec.structs.replace(structured, start_after_only_if_reply_opens=False,
                                             start_after_opener_after_space=False, start_after_opener_token_ids=[])
    opener = structured.start_after_opener_token_ids or (
        list(marker.opener) if structured.start_after_only_if_reply_opens and len(marker.opener) == 1 else [])
    if structured.start_after_token_ids:  # the caller's: the core waits for them (and the suffix's, given or filled)
        suffix = structured.start_after_suffix_token_ids or list(marker.suffix)
        structured = msgspec.structs.replace(structured, start_after_suffix_token_ids=suffix,
                                             start_after_opener_token_ids=opener)
    elif marker.starts_answer(prompt_ids, structured.start_after_only_if_opened):
        structured = msgspec.structs.replace(structured, start_after=None, start_after_suffix=None,
                                             start_after_opener=None, start_after_only_if_opened=False,
                                             start_after_only_if_reply_opens=False,
                                             start_after_opener_after_space=False, start_after_opener_token_ids=[])
    else:
        structured = msgspec.structs.replace(structured, start_after_token_ids=list(marker.ids),
                                             start_after_suffix_token_ids=list(marker.suffix),
                                             start_after_opener_token_ids=opener)
    params = msgspec.structs.replace(params, structured=structured)
    check_params_vocab(params, vocab_size)
    return params
