"""Reasoning parsers: a thinking model's reply split into its reasoning and its answer.

Reasoning models write their thoughts between ``<think>`` and ``</think>``
before the answer. The parsers have vLLM's names (``--reasoning-parser``):

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the template opens
  ``<think>`` in the prompt, so the reply is reasoning up to ``</think>`` (a
  leading ``<think>`` is dropped); a reply without ``</think>`` is all
  reasoning (cut short while thinking).
- ``qwen3`` (Qwen3, Qwen3-Thinking-2507, Qwen3.5): as ``deepseek_r1`` (as
  current vLLM's: newer templates open ``<think>`` in the prompt, older
  models' replies open it themselves and it is dropped), a reply without
  ``</think>`` all reasoning; a ``<tool_call>`` followed by ``<function``
  (Qwen3.5 calling from inside its thinking) ends the reasoning too.
- ``mistral`` (Magistral): reasoning only after a ``[THINK]`` the reply
  writes (a special token, kept in the reply's text by the server) up to
  ``[/THINK]``, the text around it content; a reply without it is all answer,
  streamed as it comes, a ``[/THINK]`` that nothing opened dropped (vLLM's case 3.a;
  vLLM keeps it when a ``[THINK]`` follows: `MistralReasoningStream`); a constraint applies from the first
  token of a reply that does not open ``[THINK]`` with it (`ReasoningParser.opened_first`).
- ``glm45`` (GLM-4.5 / 4.6 / 4.7): reasoning only when the reply opens
  ``<think>``, the whitespace before it free (GLM-4.5 writes ``\\n<think>``); a constraint applies from the first
  other token of a reply that does not, unless the prompt's end opened it (GLM-4.7's template): then the reply
  is reasoning up to ``</think>`` and the constraint applies after it, as ``deepseek_r1`` (current vLLM's glm45)
  (`ReasoningParser.opened_after_space`, `ReasoningParser.stream`'s ``opened``); ``minimax_m2`` (MiniMax-M2): as
  ``deepseek_r1``; ``seed_oss`` (Seed-OSS): as ``deepseek_r1`` with ``<seed:think>`` and ``</seed:think>``;
  ``hunyuan_a13b`` (Hunyuan-A13B): as ``glm45`` with vLLM's markers
  ``<think>\\n`` and ``\\n</think>\\n<answer>\\n``, the answer up to ``\\n</answer>``.
- ``openai_gptoss`` (gpt-oss): harmony channels, not tags (harmony.py): the
  analysis channel is reasoning, the final channel (and commentary without a
  recipient, a preamble) the answer; a message with a recipient (a tool call)
  passes on as written, for the ``openai`` tool-call parser.

The text is kept as written (the newlines after the end tag are the answer's,
as vLLM's). Whatever the tag parser, a reply whose prompt already ended the
thinking (a template with thinking turned off writes ``<think>\\n\\n</think>\\n\\n``
at the prompt's end: Qwen3's and DeepSeek-V3.1's ``enable_thinking: false``,
Qwen3.5's default) is all answer (`ReasoningParser.stream`'s ``answering``), and
so is one whose request turned the thinking off (`ReasoningParser.thinking_off`)
unless its prompt's end opened ``<think>`` anyway (`Marker.starts_answer`) (vLLM's
non-streamed qwen3 parse differs at the edges: `ReasoningParser.thinking_switch`).

`ReasoningParser.parse` splits a whole reply; `ReasoningParser.stream` splits
text deltas as they come, holding back only the characters that may begin a
tag.
"""

from __future__ import annotations

import re

from asyncllm.errors import ConfigError
from asyncllm.harmony import CHANNEL, MESSAGE, HarmonyReasoningStream, MessagePart, joined_parts
from asyncllm.tool_calls import partial_tag_suffix

__all__ = ["ReasoningParser", "ReasoningStream", "REASONING_PARSERS", "get_reasoning_parser"]

_OPEN, _CLOSE = "<think>", "</think>"


class ReasoningStream:
    """One reply's deltas in, (reasoning, content) deltas out."""

    def __init__(self, opened_by_prompt: bool, open_tag: str = _OPEN, close_tag: str = _CLOSE,
                 answering: bool = False) -> None:
        """`answering`: the prompt already ended the thinking (`ReasoningParser.stream`): all of the reply is
        content, as it comes."""
        self._opened_by_prompt = opened_by_prompt
        self._open, self._close = open_tag, close_tag
        self._thinking: bool | None = False if answering else None
        """None until the reply's first characters show whether it opens ``<think>``."""
        self._buffer = ""
        self._blank = False  # undecided, and only whitespace has come (more of it is read once: linear time)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content this delta releases."""
        if self._thinking is False:
            return "", self._answer(text)
        self._buffer += text
        if self._thinking is None:
            if self._blank and text.isspace():
                return "", ""
            head = self._buffer.lstrip()
            if len(head) < len(self._open) and self._open.startswith(head):
                self._blank = not head
                return "", ""  # whitespace, or the opening tag's first characters: wait
            self._thinking = head.startswith(self._open) or self._opened_by_prompt
            if head.startswith(self._open):
                self._buffer = head[len(self._open):]
            elif not self._thinking:
                text, self._buffer = self._buffer, ""
                return "", self._answer(text)
        end, after = self._thinking_end()
        if end >= 0:
            reasoning, rest = self._buffer[:end], self._buffer[after:]
            self._buffer, self._thinking = "", False
            return reasoning, self._answer(rest)
        keep = after
        released, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return released, ""

    def _thinking_end(self) -> tuple[int, int]:
        """Where in the buffer the reasoning ends and the answer starts; (-1, n) when not yet, the last n characters
        held back (they may begin the end)."""
        end = self._buffer.find(self._close)
        if end >= 0:
            return end, end + len(self._close)
        return -1, partial_tag_suffix(self._buffer, self._close)

    def finish(self) -> tuple[str, str]:
        """At the reply's end: what was held back (reasoning when cut short while thinking)."""
        rest, self._buffer = self._buffer, ""
        thinking = self._opened_by_prompt if self._thinking is None else self._thinking
        return (rest, "") if thinking else ("", self._answer(rest))

    def _answer(self, text: str) -> str:
        """Content, as written (the newlines after ``</think>`` too, as vLLM's ``partition`` leaves them)."""
        return text

    def feed_parts(self, text: str) -> list[MessagePart]:
        """`feed` as the reply's parts in order (`HarmonyReasoningStream.feed_parts`'s form): its reasoning, then its
        content; none starts a message (a tag parser's reply is one message)."""
        return joined_parts(*self.feed(text))

    def finish_parts(self) -> list[MessagePart]:
        return joined_parts(*self.finish())


class ReasoningParser:
    """A thinking model's tag convention."""

    start_tag = _OPEN
    """What opens the thinking (in the reply, or in the prompt: `opened_by_prompt`)."""
    end_tag = _CLOSE
    """What ends the thinking: a constraint (structured output, a tool choice) starts after it."""
    end_suffix: str | None = None
    """With it, the thinking ends at `end_tag` then this, with fewer than `end_max_between` tokens between
    (`StructuredOutputs.start_after_suffix`); None: at `end_tag` alone."""
    end_max_between = 0
    opened_by_prompt = True
    """Whether the chat template opens ``<think>`` in the prompt (the reply is reasoning until ``</think>``)."""
    opened_first = False
    """Whether the reply thinks only when its first token opens the thinking (`start_tag`, one special token): a
    constraint then applies from the first token of a reply that does not, which the parser reads as all answer
    (`StructuredOutputs.start_after_only_if_reply_opens`; mistral's), unless the prompt's end opened it
    (`Marker.opened_by`): then the reply thinks until `end_tag`."""
    opened_after_space = False
    """With `opened_first`: the whitespace tokens before the reply's first other token are free and do not decide
    (`StructuredOutputs.start_after_opener_after_space`; glm45's: GLM-4.5 writes ``\\n<think>``)."""
    needs_special_tokens = False
    """Its markers are special tokens (harmony's): the server keeps special tokens in every chat reply's text."""
    prompt_ends_thinking = True
    """Whether a prompt can end the thinking (`stream`'s ``answering``): not harmony's, whose prompt ends with the
    assistant's start."""
    forced_tool_calls = True
    """Whether a named or ``required`` tool choice can be served: its grammar (after `end_tag`) writes the answer,
    which is then the call. Not with harmony, where a call is a message of its own, before any final answer."""
    thinking_switch: str | None = None
    """The ``chat_template_kwargs`` key whose false turns the thinking off (vLLM's qwen3 parser reads
    ``enable_thinking``): the reply is all answer and a constraint applies at once, unless the prompt's end opened
    the thinking anyway (Qwen3-Thinking-2507's template): then the usual split (`Marker.starts_answer`). vLLM's
    non-streamed parse with the switch off differs in two edge cases: it splits at a ``</think>`` whenever the reply
    has one (here, when the prompt did not open the thinking, the reply is all answer, the tag included), and a reply
    without ``</think>`` is all content there (here all reasoning when the prompt opened the thinking, as in vLLM's
    streamed reply)."""

    @property
    def opener(self) -> str | None:
        """What opens the thinking `end_tag` ends (`Marker.of`'s opener): `start_tag`; none with an `end_suffix`
        (harmony's final header). The one opener of the server's prompt rule (`OpenAIServer.reasoning_end`) and of its
        constraints (`StructuredOutputs.start_after_opener`)."""
        return None if self.end_suffix is not None else self.start_tag

    def thinking_off(self, template_kwargs: dict) -> bool:
        """Whether the request's template variables turned the thinking off (`thinking_switch` false)."""
        return self.thinking_switch is not None and template_kwargs.get(self.thinking_switch) is False

    def stream(self, answering: bool = False, apart: bool = False,
               opened: bool = False) -> ReasoningStream | HarmonyReasoningStream:
        """A parser of one reply's deltas; `answering`: its prompt ended with `end_tag` (a template that turned
        thinking off), or its request turned the thinking off and its prompt did not open it (`Marker.starts_answer`),
        so all of it is content, as vLLM reads it (``is_reasoning_end`` on the prompt). `opened`: its prompt's end
        opened the thinking (`Marker.opened_by`, the constraint's rule), so it thinks until `end_tag` whatever
        `opened_by_prompt` says (glm45 with GLM-4.7's template). `apart` (the Responses API's): its ``feed_parts`` keep
        a harmony reply's messages apart; a tag parser's reply is one message either way."""
        return ReasoningStream(self.opened_by_prompt or opened, self.start_tag, self.end_tag, answering)

    def parse(self, text: str, answering: bool = False, opened: bool = False) -> tuple[str | None, str | None]:
        """A whole reply's reasoning and content (None where there is none)."""
        stream = self.stream(answering, opened=opened)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return reasoning + more_reasoning or None, content + more_content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills, QwQ: the template opens ``<think>`` in the prompt."""


class Qwen3ReasoningStream(ReasoningStream):
    """`ReasoningStream` whose thinking also ends at a ``<tool_call>`` followed by ``<function`` (Qwen3.5 may call a
    tool from inside its thinking, without ``</think>``): the call is the answer's, as vLLM's qwen3 parser reads it."""

    CALL = "<tool_call>"
    _FUNCTION = re.compile(r"\s*<function[\s=]")

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self._spaced = 0
        """While a held ``<tool_call>`` starts the buffer: how much of it is that tag and whitespace (read once)."""

    def _thinking_end(self) -> tuple[int, int]:
        if self._spaced and self._buffer[self._spaced:].isspace():  # more whitespace after the held tag: still wait
            self._spaced = len(self._buffer)
            return -1, len(self._buffer)
        self._spaced = 0
        end, after = super()._thinking_end()
        start = 0
        while (call := self._buffer.find(self.CALL, start)) >= 0 and (end < 0 or call < end):
            rest = self._buffer[call + len(self.CALL):]
            if self._FUNCTION.match(rest):
                return call, call
            head = rest.lstrip()
            if "<function".startswith(head):  # what follows may still open the function: wait (held from the tag)
                self._spaced = 0 if head else len(self._buffer) - call
                return -1, len(self._buffer) - call
            start = call + 1
        return (end, after) if end >= 0 else (-1, max(after, partial_tag_suffix(self._buffer, self.CALL)))


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 / Qwen3.5: ``<think>`` opened in the prompt (Qwen3-Thinking-2507, Qwen3.5) or by the reply (dropped);
    reasoning up to ``</think>`` (or a tool call's ``<tool_call><function=``), all of a reply without it (cut short
    while thinking), as vLLM's."""

    thinking_switch = "enable_thinking"

    def stream(self, answering: bool = False, apart: bool = False, opened: bool = False) -> Qwen3ReasoningStream:
        return Qwen3ReasoningStream(self.opened_by_prompt or opened, self.start_tag, self.end_tag, answering)


class MistralReasoningStream(ReasoningStream):
    """vLLM's mistral parser: content until ``[THINK]`` (wherever it comes), reasoning up to ``[/THINK]``, content
    after; a ``[/THINK]`` before any ``[THINK]`` is dropped (vLLM's case 3.a: "EOT without BOT"), the first one only.

    One difference: vLLM's whole-reply parse drops that ``[/THINK]`` only when no ``[THINK]`` follows it, and keeps
    it in the content when one does (its cases 1 and 2: ``[/THINK]a[THINK]b[/THINK]c`` is content ``[/THINK]ac``
    there, ``ac`` here). Telling the two apart would hold the content after a lone ``[/THINK]`` back until a
    ``[THINK]`` or the reply's end, so it is dropped at once, streamed or whole alike."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self._closed_alone = False  # a [/THINK] without [THINK] was dropped

    def feed(self, text: str) -> tuple[str, str]:
        if self._thinking is not None or self._opened_by_prompt:  # opened (up to the end tag) or answering
            return super().feed(text)
        self._buffer += text
        content = self._drop_lone_close()
        opened = self._buffer.find(self._open)
        if opened >= 0:
            content, rest = content + self._buffer[:opened], self._buffer[opened + len(self._open):]
            self._buffer, self._thinking = "", True
            reasoning, more = super().feed(rest)
            return reasoning, content + more
        keep = max(partial_tag_suffix(self._buffer, self._open),
                   0 if self._closed_alone else partial_tag_suffix(self._buffer, self._close))
        released, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return "", content + released

    def _drop_lone_close(self) -> str:
        """The buffer's text before a first ``[/THINK]`` that comes before any ``[THINK]`` (the tag dropped)."""
        closed = -1 if self._closed_alone else self._buffer.find(self._close)
        opened = self._buffer.find(self._open)
        if closed < 0 or 0 <= opened < closed:
            return ""
        content, self._buffer = self._buffer[:closed], self._buffer[closed + len(self._close):]
        self._closed_alone = True
        return content


class MistralReasoningParser(ReasoningParser):
    """Magistral: the reply opens ``[THINK]`` itself and closes it with ``[/THINK]``, both special tokens (kept in
    the text by the server, as for harmony)."""

    start_tag, end_tag = "[THINK]", "[/THINK]"
    opened_by_prompt = False
    opened_first = True
    needs_special_tokens = True

    def stream(self, answering: bool = False, apart: bool = False, opened: bool = False) -> MistralReasoningStream:
        return MistralReasoningStream(self.opened_by_prompt or opened, self.start_tag, self.end_tag, answering)


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss: harmony's channels (``<|channel|>analysis<|message|>``...), special tokens kept in the text; a
    constraint starts with the final channel's message."""

    end_tag, end_suffix, end_max_between = CHANNEL + "final", MESSAGE, 20
    """Harmony may write tokens between the final channel and its message (``<|channel|>final <|constrain|>json
    <|message|>``): vLLM's openai_gptoss ``is_reasoning_end`` takes up to 20 between."""
    needs_special_tokens = True
    forced_tool_calls = False
    prompt_ends_thinking = False
    opened_by_prompt = False  # nothing opens the analysis channel: the Responses API counts 0 reasoning tokens

    def stream(self, answering: bool = False, apart: bool = False, opened: bool = False) -> HarmonyReasoningStream:
        return HarmonyReasoningStream(apart)


class WrappedAnswerStream(ReasoningStream):
    """`ReasoningStream` whose answer ends with ``\\n</answer>`` (Hunyuan-A13B): neither it nor what follows is
    content, as vLLM's ``full_match_reasoning_regex`` reads it (its first characters held back until the next text
    shows whether they are it); the answer's ``<answer>\\n`` is the end tag's. Right after the start tag, the end
    tag without its first newline ends an empty thought too, as vLLM's streaming reads it (``response_start_ids_fast``,
    ``<think>\\n</think>\\n<answer>\\n``)."""

    CLOSE = "\n</answer>"

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self._tail = ""  # what may be the close tag's start
        self._ending = False
        self._closed = False
        self._thought_started = False  # some of the thought was released (the bare end tag no longer applies)

    def _thinking_end(self) -> tuple[int, int]:
        bare = self._close.removeprefix("\n")
        if not self._thought_started:
            if self._buffer.startswith(bare):
                return 0, len(bare)
            if bare.startswith(self._buffer):
                return -1, len(self._buffer)
        end, after = super()._thinking_end()
        self._thought_started = self._thought_started or end >= 0 or after < len(self._buffer)
        return end, after

    def finish(self) -> tuple[str, str]:
        self._ending = True
        reasoning, content = super().finish()
        return reasoning, content + self._unwrapped("")

    def _answer(self, text: str) -> str:
        return self._unwrapped(super()._answer(text))

    def _unwrapped(self, text: str) -> str:
        if self._closed:
            return ""
        text, close, _ = (self._tail + text).partition(self.CLOSE)
        self._closed = bool(close)
        keep = 0 if self._ending or self._closed else partial_tag_suffix(text, self.CLOSE)
        self._tail = text[len(text) - keep:]
        return text[: len(text) - keep]


class HunyuanA13BReasoningParser(ReasoningParser):
    """Hunyuan-A13B: ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>``, the thinking opened by the reply; the
    newlines are the markers' (vLLM's ``think_start_expr`` and ``response_start_expr``), an empty thought is none."""

    start_tag, end_tag = "<think>\n", "</think>\n<answer>\n"
    """A constraint starts after `end_tag`: its ids are those of vLLM's ``response_start_ids_fast``, which end both
    of its sequences (the marker's first newline may be merged into the thought's last token, as in ``\\n\\n``)."""
    opened_by_prompt = False

    def stream(self, answering: bool = False, apart: bool = False, opened: bool = False) -> WrappedAnswerStream:
        return WrappedAnswerStream(self.opened_by_prompt or opened, self.start_tag, "\n" + self.end_tag, answering)


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5 / 4.6 / 4.7: the reply opens ``<think>`` (one special token) itself when it thinks, after a newline
    (GLM-4.5's ``\\n<think>``); GLM-4.7's template opens it in the prompt, whose reply the constraint then reads as
    thinking until ``</think>`` (`Marker.opened_by`), as vLLM's ``is_reasoning_end`` waits for it there, and so does the
    server's parser (`stream`'s ``opened``): reasoning up to ``</think>``, as current vLLM's glm45 (deepseek_r1's)."""

    opened_by_prompt = False
    opened_first = True
    opened_after_space = True


class SeedOssReasoningParser(ReasoningParser):
    """Seed-OSS: as `DeepSeekR1ReasoningParser` with ``<seed:think>`` and ``</seed:think>`` (vLLM's seed_oss: a reply
    may close the thinking without opening it; one without either tag is all reasoning)."""

    start_tag, end_tag = "<seed:think>", "</seed:think>"


class MiniMaxM2ReasoningParser(DeepSeekR1ReasoningParser):
    """MiniMax-M2: the template opens ``<think>`` in the prompt (as DeepSeek-R1's)."""


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser, "openai_gptoss": GptOssReasoningParser,
    "mistral": MistralReasoningParser, "glm45": Glm45ReasoningParser, "seed_oss": SeedOssReasoningParser,
    "minimax_m2": MiniMaxM2ReasoningParser, "hunyuan_a13b": HunyuanA13BReasoningParser,
}
"""Parser name (vLLM's ``--reasoning-parser`` names) -> parser."""


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; a `ConfigError` naming the known ones otherwise."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ConfigError("reasoning_parser", name, f"one of {sorted(REASONING_PARSERS)}")
    return parser()
