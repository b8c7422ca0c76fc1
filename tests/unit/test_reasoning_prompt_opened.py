"""A reply whose prompt's end opened the thinking (GLM-4.7's template ends with ``<think>``): reasoning up to the end
tag, content after, as current vLLM's glm45 reads it (its deepseek_r1 split), whatever the parser's own convention."""

from __future__ import annotations

import pytest

from asyncllm.integrations.openai_reply import merge_deltas
from asyncllm.integrations.openai_responses import Choices
from asyncllm.outputs import StreamDelta
from asyncllm.reasoning import get_reasoning_parser
from asyncllm.structured.start_after import Marker

REPLY = "Plan it.</think>\n\nFour."


@pytest.mark.parametrize(("name", "reply", "expected"), [
    ("glm45", REPLY, ("Plan it.", "\n\nFour.")),
    ("glm45", "<think>Plan it.</think>Four.", ("Plan it.", "Four.")),  # the reply opening it again: the tag dropped
    ("glm45", "cut short while thinking", ("cut short while thinking", None)),  # no end tag: all reasoning (R1's)
    ("mistral", "Plan it.[/THINK]Four.", ("Plan it.", "Four.")),
])
def test_a_reply_to_a_prompt_that_opened_the_thinking_splits_at_the_end_tag(
        name: str, reply: str, expected: tuple[str | None, str | None]) -> None:
    parser = get_reasoning_parser(name)
    assert parser.parse(reply, opened=True) == expected
    stream, reasoning, content = parser.stream(opened=True), "", ""
    for i in range(0, len(reply), 3):
        r, c = stream.feed(reply[i:i + 3])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    assert (reasoning + r or None, content + c or None) == expected
    assert parser.parse(reply, answering=True, opened=True) == (None, reply)  # a prompt that ended it: all answer


def test_the_server_reads_each_prompt_with_the_constraints_rule() -> None:
    """`Choices.ended_thinking` notes the prompts whose end opened ``<think>`` (`Marker.opened_by`, the rule the
    constraint's ``start_after`` reads): their replies split, whole and streamed; another prompt's stays all content
    (GLM-4.5's reply that does not open the thinking), and the Responses API counts the thinking's tokens."""
    close = Marker((7, 8), opener=(6, 8))
    choices = Choices(2, 1, None, chat=True, reasoning=get_reasoning_parser("glm45"), reasoning_end=close,
                      counts_reasoning=True)
    choices.ended_thinking(0, [1, 6, 8])
    choices.ended_thinking(1, [1, 2])
    assert choices.prompt_opened_thinking == [True, False] and choices.prompt_ended_thinking == [False, False]
    streamed = []
    for prompt_index in (0, 1):
        choices.add(prompt_index, StreamDelta(0, REPLY, [3, 3, 7, 8, 4], "stop"))
        streamed.append(choices.chat_deltas(prompt_index, REPLY[:5], None)[0]
                        + choices.chat_deltas(prompt_index, REPLY[5:], "stop")[0])
    for index, deltas in enumerate(streamed):
        whole = choices.reply_deltas(index)[0]
        assert merge_deltas(whole, tools=False, reasoning_parser=True) == merge_deltas(
            deltas, tools=False, reasoning_parser=True), index
    opened, plain = (merge_deltas(d, tools=False, reasoning_parser=True) for d in streamed)
    assert (opened["reasoning"], opened["content"]) == ("Plan it.", "\n\nFour.")
    assert plain["content"] == REPLY and "reasoning" not in plain
    assert choices.reasoning_tokens() == 2  # the first reply's two tokens before </think>; none of the second's
