"""OpenAI response bodies and stream chunks, built from the engine's `StreamDelta`s.

One `Choices` object follows a whole request (every prompt, every sample):
it accumulates text, token counts and logprobs per choice, so the same code
serves the non-streaming body (everything at the end) and the SSE chunks (one
per delta; `Choices.streaming` keeps no text, token ids or logprobs, only
counts and offsets). OpenAI counts a prompt's tokens once however many samples it has;
completion tokens are every generated token of every choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import ToolMode
from asyncllm.outputs import Logprob, PromptLogprobs, StreamDelta
from asyncllm.reasoning import ReasoningParser
from asyncllm.sampling import SamplingParams
from asyncllm.structured.start_after import Marker

__all__ = ["Choices", "chat_chunk", "chat_stream_choices", "sse_event", "usage"]

Entries = list["dict[int, Logprob] | None"]
"""One logprob entry per token; None for an echoed prompt's first token (nothing predicts it)."""


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """vLLM's: the stop string or stop token id that ended the choice (None: EOS, length, or running)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Entries = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    """The generated token ids, with vLLM's ``return_token_ids`` (`token_ids` also holds an echoed prompt's)."""
    text_offset: int = 0
    """Characters of this choice's text before the next logprob's token (completions' text_offset)."""
    reply: ChatReply | None = None
    """A streamed chat choice's reply (its reasoning and tool calls)."""
    sent_prompt_ids: bool = False
    """Streaming completions with ``return_token_ids``: whether a chunk carried this choice's prompt_token_ids."""


class Choices:
    """Every choice of one request: choice index = prompt index * n + sample index."""

    def __init__(self, num_prompts: int, n: int, top_logprobs: int | None, chat: bool,
                 token_text: Callable[[int], str] | None = None, echo_only: bool = False,
                 tool_mode: ToolMode | None = None, reasoning: ReasoningParser | None = None,
                 num_prompt_logprobs: int | None = None, token_ids_as_text: bool = False,
                 include_reasoning: bool = True, return_token_ids: bool = False, chat_echo: str = "",
                 chat_role: str = "assistant", prompt_tokens_details: bool = False,
                 reasoning_end: Marker | None = None, thinking_off: bool = False,
                 counts_reasoning: bool = False, message_starts: bool = False,
                 sampling: SamplingParams | None = None) -> None:
        self.n = n
        self.top_logprobs = top_logprobs
        self.chat = chat
        self._choices = [_Choice() for _ in range(num_prompts * n)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens: list[int] | None = [0] * num_prompts if prompt_tokens_details else None
        """Each prompt's tokens served from the prefix cache, reported in `usage` (vLLM's
        --enable-prompt-tokens-details); None: not reported."""
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * num_prompts
        self._token_text = token_text
        """A token id's text, for an echoed prompt's first token (it has no logprob entry)."""
        self._name = _token_id_name if token_ids_as_text else _token_text
        """How logprobs name a token: its text, or (vLLM's --return-tokens-as-token-ids) ``token_id:N``."""
        self.echo_only = echo_only
        """Completions' ``echo`` with ``max_tokens`` 0: the prompt is the whole choice, generated tokens are dropped."""
        self.tool_mode = tool_mode or ToolMode("none")
        """Chat: how replies are read for tool calls (openai_tools.py)."""
        self.reasoning = reasoning
        """Chat: the server's reasoning parser, or None."""
        self.num_prompt_logprobs = num_prompt_logprobs
        """The request's ``prompt_logprobs`` (None: no such field): vLLM's field, on each completion choice, at the
        top of a chat response, with as many entries per token as it asked for (`prompt_logprobs_body`)."""
        self.include_reasoning = include_reasoning
        """Chat (vLLM's ``include_reasoning``): false leaves the ``reasoning`` deltas out (and `hides_metadata`)."""
        self.return_token_ids = return_token_ids
        """vLLM's: ``token_ids`` on each choice, ``prompt_token_ids`` on each completion choice (chat: at the top)."""
        self.prompt_token_ids: list[list[int] | None] = [None] * num_prompts
        """Each prompt's token ids, kept with `return_token_ids` (the server sets them)."""
        self.chat_echo = chat_echo
        """Chat (vLLM's ``echo``): the text each choice's content starts with (the last message's); "" for none."""
        self.chat_role = chat_role
        """Chat: the reply's role (vLLM's: the last message's with ``add_generation_prompt`` false, `chat_role`)."""
        self.reasoning_end = reasoning_end
        """Chat: the reasoning parser's end tag (None: no parser, or no tokenizer)."""
        self.counts_reasoning = counts_reasoning and reasoning_end is not None
        """The Responses API's: the generated ids are kept for `reasoning_tokens` (chat completions report none)."""
        self.message_starts = message_starts
        """The Responses API's: a harmony reply's messages come apart (`ChatReply`'s ``message_starts``)."""
        self.sampling = sampling
        """The request's sampling parameters (the Responses API echoes their temperature, top_p and max_tokens)."""
        self.thinking_off = thinking_off
        """Chat: the request turned the thinking off (`ReasoningParser.thinking_off`)."""
        self.prompt_ended_thinking = [thinking_off] * num_prompts
        """Each prompt's replies are all answer (`Marker.starts_answer`: its end wrote `reasoning_end`, or the
        request turned the thinking off and its end did not open it); without `reasoning_end`, `thinking_off`."""
        self.prompt_opened_thinking = [False] * num_prompts
        """Each prompt's end opened the thinking (`Marker.opened_by`): its replies think until the end tag."""
        self.hides_metadata = chat and not include_reasoning and reasoning is not None
        """vLLM's: hidden reasoning leaves out the choices' ``logprobs`` and ``token_ids`` too (they would show it)."""
        self.streaming = False
        """Set by the SSE paths before their first delta: each chunk is built from its delta alone, so no choice keeps
        its text, token ids or logprobs (read only by a whole body: `final_choices`, `reply_deltas`); a stream's
        memory does not grow with its tokens (logprobs=20 kept ~4 KiB a token)."""

    def ended_thinking(self, prompt_index: int, prompt_ids: list[int]) -> None:
        """Note whether prompt `prompt_index` (its ids) ended the thinking: its replies are then all answer; or opened
        it: they think until the end tag."""
        if self.reasoning_end is not None:
            self.prompt_ended_thinking[prompt_index] = self.reasoning_end.starts_answer(prompt_ids, self.thinking_off)
            self.prompt_opened_thinking[prompt_index] = self.reasoning_end.opened_by(prompt_ids)

    def add(self, prompt_index: int, delta: StreamDelta) -> tuple[int, dict[str, Any] | None]:
        """Record one delta; its choice index and the logprobs of just these tokens (or None)."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = delta.prompt_logprobs
        if self.echo_only:
            finish = None if delta.finish_reason is None else "length"
            delta = StreamDelta(delta.index, "", [], finish)
        index = prompt_index * self.n + delta.index
        choice = self._choices[index]
        if not self.streaming:
            choice.text.append(delta.text)
        choice.num_tokens += len(delta.token_ids)
        if (self.return_token_ids and not self.streaming) or self.counts_reasoning:
            choice.output_token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        logprobs = None
        if self.top_logprobs is not None and delta.logprobs is not None and not self.hides_metadata:
            if not self.streaming:
                choice.token_ids.extend(delta.token_ids)
                choice.logprobs.extend(delta.logprobs)
            logprobs = self._format_logprobs(choice, delta.token_ids, delta.logprobs)
        return index, logprobs

    def stream_token_ids(self, index: int, token_ids: list[int]) -> dict[str, Any]:
        """A stream chunk's fields of vLLM's ``return_token_ids`` for choice `index` sending `token_ids`: those ids
        (none of an echo-only request's generated token), and on a completion choice's first chunk its prompt's
        ``prompt_token_ids`` (a chat's are at the top of its first chunks)."""
        if not self.return_token_ids:
            return {}
        if self.hides_metadata:
            return {"token_ids": None}
        fields: dict[str, Any] = {"token_ids": [] if self.echo_only else list(token_ids)}
        choice = self._choices[index]
        if not self.chat and not choice.sent_prompt_ids:
            choice.sent_prompt_ids = True
            fields["prompt_token_ids"] = self.prompt_token_ids[index // self.n]
        return fields

    def finish_of(self, index: int) -> tuple[str | None, str | int | None]:
        """Choice `index`'s finish_reason and stop_reason as recorded (echo alone: ``"length"``, as `add` has it)."""
        choice = self._choices[index]
        return choice.finish_reason, choice.stop_reason

    def chat_deltas(self, index: int, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """Streaming chat: the OpenAI deltas of choice `index`'s next text, and the finish_reason to send."""
        choice = self._choices[index]
        if choice.reply is None:
            choice.reply = ChatReply(self.tool_mode, self.reasoning, message_starts=self.message_starts,
                                     prompt_ended_thinking=self.prompt_ended_thinking[index // self.n],
                                     prompt_opened_thinking=self.prompt_opened_thinking[index // self.n])
        deltas = choice.reply.feed(text)
        if finish_reason is not None:
            more, finish_reason = choice.reply.finish(finish_reason)
            deltas += more
        return self._shown(deltas), finish_reason

    def _shown(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The deltas a client sees: without ``reasoning`` ones when the request set include_reasoning false."""
        return deltas if self.include_reasoning else [delta for delta in deltas if "reasoning" not in delta]

    def echo(self, prompt_index: int, text: str, token_ids: list[int]) -> list[tuple[int, dict[str, Any] | None]]:
        """Put the prompt before each choice of this prompt (completions' ``echo``).

        Streaming, call it before the prompt's deltas: it returns (choice index,
        the prompt's logprobs or None) per choice for the first chunks. The
        prompt's logprobs are `prompt_logprobs` (from its first delta).
        """
        entries = self.prompt_logprobs[prompt_index]
        out = []
        for index in range(prompt_index * self.n, (prompt_index + 1) * self.n):
            choice = self._choices[index]
            logprobs = None
            if not self.streaming:
                choice.text.insert(0, text)
            if self.top_logprobs is not None and entries is not None:
                if not self.streaming:
                    choice.token_ids[:0] = token_ids
                    choice.logprobs[:0] = entries
                logprobs = self._format_logprobs(choice, token_ids, entries)
            out.append((index, logprobs))
        return out

    def usage(self, reasoning_tokens: bool = False) -> dict[str, Any]:
        """The request's usage; `reasoning_tokens` adds OpenAI's ``completion_tokens_details`` (the Responses API's
        ``output_tokens_details``)."""
        body = usage(sum(self.prompt_tokens), sum(c.num_tokens for c in self._choices))
        if self.cached_tokens is not None:
            body["prompt_tokens_details"] = {"cached_tokens": sum(self.cached_tokens)}
        if reasoning_tokens:
            body["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens()}
        return body

    def reasoning_tokens(self) -> int:
        """The generated tokens of every choice within its thinking (`Marker.spanned`, as vLLM counts the Responses
        API's ``reasoning_tokens``); 0 without a tag parser (harmony's channels are not counted)."""
        if self.reasoning is None or not self.counts_reasoning:
            return 0
        opened, ended = self.prompt_opened_thinking, self.prompt_ended_thinking
        return sum(self.reasoning_end.spanned(choice.output_token_ids,
                                              self.reasoning.opened_by_prompt or opened[index // self.n])
                   for index, choice in enumerate(self._choices) if not ended[index // self.n])

    def choice_usage(self, index: int) -> dict[str, int]:
        """vLLM's ``continuous_usage_stats`` on a chunk of choice `index`: its prompt's tokens, its own so far."""
        return usage(self.prompt_tokens[index // self.n], self._choices[index].num_tokens)

    def final_choices(self) -> list[dict[str, Any]]:
        """The `choices` of a non-streaming response."""
        out = []
        for index, choice in enumerate(self._choices):
            text = "".join(choice.text)
            logprobs = None
            if self.top_logprobs is not None and not self.hides_metadata:
                choice.text_offset = 0
                logprobs = self._format_logprobs(choice, choice.token_ids, choice.logprobs)
            out.append(self._chat_choice(index, choice, logprobs) if self.chat else
                       self._completion_choice(index, choice, text, logprobs))
            if self.return_token_ids:
                out[-1]["token_ids"] = None if self.hides_metadata else choice.output_token_ids
        return out

    def reply_deltas(self, index: int) -> tuple[list[dict[str, Any]], str | None]:
        """Choice `index`'s whole reply as the deltas a client sees (each call whole), and its finish_reason: a
        chat's message (`merge_deltas`), the Responses API's output items (`response_body`)."""
        choice = self._choices[index]
        reply = ChatReply(self.tool_mode, self.reasoning, stream_arguments=False, message_starts=self.message_starts,
                          prompt_ended_thinking=self.prompt_ended_thinking[index // self.n],
                          prompt_opened_thinking=self.prompt_opened_thinking[index // self.n])
        deltas = reply.feed("".join(choice.text))
        more, finish_reason = reply.finish(choice.finish_reason)
        return self._shown(deltas + more), finish_reason

    def _chat_choice(self, index: int, choice: _Choice, logprobs: Any) -> dict[str, Any]:
        deltas, finish_reason = self.reply_deltas(index)
        message = merge_deltas(deltas, tools=self.tool_mode.kind != "none", reasoning_parser=self.reasoning is not None)
        message["role"] = self.chat_role
        if self.chat_echo:
            message["content"] = self.chat_echo + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": choice.stop_reason}

    def _completion_choice(self, index: int, choice: _Choice, text: str, logprobs: Any) -> dict[str, Any]:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason,
               "stop_reason": choice.stop_reason}
        if self.num_prompt_logprobs is not None:
            entries = self.prompt_logprobs[index // self.n]
            out["prompt_logprobs"] = prompt_logprobs_body(entries, self.num_prompt_logprobs)
        if self.return_token_ids:
            out["prompt_token_ids"] = self.prompt_token_ids[index // self.n]
        return out

    def response_fields(self) -> dict[str, Any]:
        """Fields of a non-streaming response besides its choices: a chat's ``prompt_logprobs`` and (vLLM's
        ``return_token_ids``) ``prompt_token_ids`` when asked."""
        fields: dict[str, Any] = {}
        if self.chat and self.num_prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprobs_body(self.prompt_logprobs[0], self.num_prompt_logprobs)
        if self.chat and self.return_token_ids:
            fields["prompt_token_ids"] = self.prompt_token_ids[0]
        return fields

    def _format_logprobs(self, choice: _Choice, token_ids: list[int], entries: Entries) -> dict[str, Any]:
        top_n = self.top_logprobs or 0
        if self.chat:
            return {"content": [_chat_token(t, e, top_n, self._name) for t, e in zip(token_ids, entries)]}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:  # an echoed prompt's first token: nothing predicts it
                token, logprob, top = self._token_text(token_id) if self._token_text else "", None, None
            else:
                token, logprob = self._name(token_id, entry), _logprob(token_id, entry)
                top = {self._name(t, entry): _finite(lp.logprob) for t, lp in _top(entry, top_n)}
                top.setdefault(token, logprob)  # OpenAI's legacy completions: the sampled token too (up to N+1)
            tokens.append(token)
            token_logprobs.append(logprob)
            tops.append(top)
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_body(entries: PromptLogprobs | None,
                         top_n: int = -1) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt token (an entry's first) and the `top_n` most likely (-1: every entry). The engine may hold more than
    the request asked for (completions' ``echo`` with a larger ``logprobs``): those ranked below `top_n` are left
    out, as vLLM answers."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token_id, lp in _asked(entry, top_n)} for entry in entries]


def _asked(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    """The entry's own token (its first: `LogprobsDecoder.decode`) and those of rank at most `top_n` (-1: all)."""
    items = list(entry.items())
    return items if top_n == -1 else items[:1] + [(t, lp) for t, lp in items[1:] if lp.rank <= top_n]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chat_token(token_id: int, entry: dict[int, Logprob], top_n: int,
                name: Callable[[int, dict[int, Logprob]], str]) -> dict[str, Any]:
    token = name(token_id, entry)
    top = [{"token": name(t, entry), "logprob": _finite(lp.logprob), "bytes": list(name(t, entry).encode())}
           for t, lp in _top(entry, top_n)]
    return {"token": token, "logprob": _logprob(token_id, entry), "bytes": list(token.encode()), "top_logprobs": top}


def _top(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    """The `top_n` most likely tokens (-1: every one, the whole vocabulary): the entry holds them and the sampled
    token (which may be one of them)."""
    ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)
    return ranked if top_n == -1 else ranked[:top_n]


def _token_text(token_id: int, entry: dict[int, Logprob]) -> str:
    """The token's text; vLLM's ``token_id:N`` for a token decoded without a tokenizer (skip_tokenizer_init)."""
    logprob = entry.get(token_id)
    if logprob is None:
        return ""
    return token_id_text(token_id) if logprob.decoded_token is None else logprob.decoded_token


def token_id_text(token_id: int) -> str:
    """vLLM's name of a token by id (``--return-tokens-as-token-ids``, and tokens without a tokenizer)."""
    return f"token_id:{token_id}"


def _token_id_name(token_id: int, entry: dict[int, Logprob]) -> str:
    return token_id_text(token_id)


def _logprob(token_id: int, entry: dict[int, Logprob]) -> float:
    logprob = entry.get(token_id)
    return _finite(logprob.logprob if logprob is not None else float("-inf"))


def _finite(logprob: float) -> float:
    """JSON has no -inf (a token masked out under a processed ``logprobs_mode``): -9999.0, as vLLM's server."""
    return max(logprob, -9999.0)


def chat_stream_choices(choices: Choices, index: int, delta: Any, logprobs: Any) -> list[dict[str, Any]]:
    """The chunks' choices of one delta of a chat: one per OpenAI delta (content, a tool call), logprobs on the
    first (and vLLM's ``token_ids``), the finish_reason on the last; none when there is nothing to send (as for a
    hidden reasoning token: `Choices.hides_metadata`)."""
    parts, finish_reason = choices.chat_deltas(index, delta.text, delta.finish_reason)
    # vLLM's return_token_ids: sent even with no text
    token_ids = choices.stream_token_ids(index, delta.token_ids) if choices.return_token_ids else None
    if not parts:
        if finish_reason is None and logprobs is None and not (token_ids and token_ids["token_ids"]):
            return []
        parts = [{}]
    stop_reason = delta.stop_reason if finish_reason is not None else None
    if len(parts) == 1:  # a token's one OpenAI delta: the per-token case, one dict
        out = [chat_chunk(index, parts[0], logprobs, finish_reason, stop_reason)]
    else:
        out = [chat_chunk(index, part) for part in parts]
        out[0]["logprobs"] = logprobs
        out[-1]["finish_reason"], out[-1]["stop_reason"] = finish_reason, stop_reason
    if token_ids:
        out[0].update(token_ids)
    return out


def chat_chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None,
               stop_reason: str | int | None = None) -> dict:
    """One choice of a chat chunk; vLLM's ``stop_reason`` is null until the choice's finishing chunk."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"
