"""The Responses API's ``input`` items as chat messages (integrations/responses_input.py), held by hypothesis to a plain
reference written from the documented rules (the module's docstring; docs/integrations/openai-server.md's "Responses
API"; vLLM's ``_construct_message_from_response_item``), not from the module's code.

Checked on drawn item lists of every kind in any order (messages of each role with text, ``input_text``,
``output_text``, ``refusal``, bare-string and ``input_image`` parts, ``reasoning`` items with content, summary, both or
neither, ``function_call`` and ``function_call_output`` items, with and without ``type`` on messages), with
``instructions`` present, empty or absent:

- the messages equal the reference: a reasoning item fills the ``reasoning`` of the assistant message just before it
  when that has none, an assistant message its ``content``, a function_call appends to its ``tool_calls``; otherwise
  each starts an assistant message; a function_call_output is a tool message whose text parts join with "\\n";
- the items are not changed (the response store shares them between turns) and a second call gives the same;
- a ``previous_response_id``'s stored conversation (`chat_request` with a history) runs as if the history and the
  new input were one ``input`` (the merge crosses the boundary), the previous instructions not carried;
- one invalid item put anywhere (a wrong ``type``, a part of a wrong type, ``encrypted_content``, a missing or
  non-string required field, a malformed reasoning part) is an `InvalidRequestError` naming ``input`` as the client
  sees it (`renamed_fields`), its message naming the item's index and the offending field or type -- never another
  exception.
"""

from __future__ import annotations

import copy
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.errors import renamed_fields
from asyncllm.integrations.responses_api import RESPONSES_FIELDS, ResponsesRequest, chat_request
from asyncllm.integrations.responses_input import input_messages

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TEXT_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
"""The text-like part types vLLM's chat parsing reads, and the key holding each one's text."""

# --- the reference ---------------------------------------------------------------------------------------------


def part_text(part):
    """A text-like part's text; None where vLLM skips it (a text or refusal part whose text is None)."""
    return part if isinstance(part, str) else part.get(TEXT_FIELDS[part["type"]])


def ref_output(output):
    """A function_call_output's output: a string as it is, a list's texts joined with a newline."""
    if isinstance(output, str):
        return output
    return "\n".join(t for t in map(part_text, output) if t is not None)


def ref_content(content):
    """A message's content: a string as it is; a list's text parts as they are, input_image as image_url."""
    if isinstance(content, str):
        return content
    return [{"type": "image_url", "image_url": {"url": p["image_url"]}}
            if isinstance(p, dict) and p["type"] == "input_image" else p for p in content]


def ref_reasoning(item):
    """The first content part's text, else the first summary part's, else ""."""
    for key in ("content", "summary"):
        if item.get(key):
            return item[key][0]["text"]
    return ""


def reference(items, instructions):
    """The documented fold of `items` into chat messages."""
    out = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        turn = out[-1] if out and out[-1]["role"] == "assistant" else None
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turn is None:
                out.append({"role": "assistant", "tool_calls": [call]})
            else:
                turn["tool_calls"] = turn.get("tool_calls", []) + [call]
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": ref_output(item["output"])})
        elif kind == "message" and item["role"] != "assistant":
            out.append({"role": item["role"], "content": ref_content(item["content"])})
        else:
            key, value = ("reasoning", ref_reasoning(item)) if kind == "reasoning" else \
                ("content", ref_content(item["content"]))
            if turn is not None and turn.get(key) is None:
                turn[key] = value
            else:
                out.append({"role": "assistant", key: value})
    return out


# --- strategies ------------------------------------------------------------------------------------------------

texts = st.text(alphabet="ab \n", max_size=4)
ids = st.sampled_from(["call_1", "call_2", "c"])
maybe_none = st.one_of(texts, st.none())


@st.composite
def text_part(draw, none_ok=True):
    kind = draw(st.sampled_from([*TEXT_FIELDS, "bare"]))
    if kind == "bare":
        return draw(texts)
    text = draw(maybe_none if none_ok and kind in ("text", "refusal") else texts)
    extra = {"annotations": []} if kind == "output_text" else {}
    return {"type": kind, TEXT_FIELDS[kind]: text, **extra}


image_part = st.builds(lambda d: {"type": "input_image", "image_url": "data:image/png;base64,AAAA", **d},
                       st.sampled_from([{}, {"detail": "low"}, {"detail": "auto", "file_id": None}]))
content = st.one_of(texts, st.lists(st.one_of(text_part(), image_part), min_size=1, max_size=3))


@st.composite
def message(draw):
    item = {"role": draw(st.sampled_from(["user", "assistant", "assistant", "system", "developer"])),
            "content": draw(content)}
    if draw(st.booleans()):
        item = {"type": "message", **item}
    if item["role"] == "assistant" and draw(st.booleans()):
        item.update(id="msg_1", status="completed")
    return item


def _parts(kind):
    return st.lists(st.builds(lambda t: {"type": kind, "text": t}, texts), max_size=2)


@st.composite
def reasoning(draw):
    item = {"type": "reasoning", "id": "rs_1"}
    for key, kind in (("summary", "summary_text"), ("content", "reasoning_text")):
        if draw(st.booleans()):
            item[key] = draw(_parts(kind))
    if draw(st.booleans()):
        item["encrypted_content"] = None
    return item


function_call = st.builds(lambda c, n, a, extra: {"type": "function_call", "call_id": c, "name": n, "arguments": a,
                                                  **extra},
                          ids, st.sampled_from(["f", "g"]), st.sampled_from(["{}", '{"x": 1}']),
                          st.sampled_from([{}, {"id": "fc_1"}, {"id": "fc_1", "status": "completed"}]))
function_call_output = st.builds(lambda c, o: {"type": "function_call_output", "call_id": c, "output": o},
                                 ids, st.one_of(texts, st.lists(text_part(), max_size=3)))
items = st.lists(st.one_of(message(), reasoning(), function_call, function_call_output), max_size=8)
instructions = st.one_of(st.none(), st.just(""), texts.filter(bool))

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
THINK = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]}
SUMMARY = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}
REPLY = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "r", "annotations": []}]}
OUT = {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "text", "text": None}, "x", "y"]}

# --- properties ------------------------------------------------------------------------------------------------


@SETTINGS
@given(items=items, instructions=instructions)
@example(items=[THINK, SUMMARY, {"type": "reasoning"}, REPLY, REPLY], instructions=None)  # several in a row
@example(items=[CALL, THINK, REPLY, {**CALL, "call_id": "call_2"}, OUT, CALL], instructions="")  # after a call
@example(items=[REPLY, {"role": "user", "content": "u"}, THINK, {"role": "assistant", "content": "a"}],
         instructions="be brief")
@example(items=[{"role": "developer", "content": "d"}, CALL, THINK], instructions="i")
def test_messages_are_the_documented_fold(items, instructions) -> None:
    before = copy.deepcopy(items)
    assert input_messages(items, instructions) == reference(before, instructions)
    assert items == before, "input items were changed"
    assert input_messages(items, instructions) == reference(before, instructions)


@SETTINGS
@given(text=texts, instructions=instructions)
def test_a_string_input_is_one_user_message(text, instructions) -> None:
    assert input_messages(text, instructions) == reference([{"role": "user", "content": text}], instructions)


@SETTINGS
@given(history=items, new=st.one_of(texts, items), instructions=instructions)
@example(history=[{"role": "user", "content": "q"}, THINK], new=[REPLY, CALL], instructions=None)
@example(history=[REPLY], new="next", instructions="again")
def test_a_continued_response_runs_its_history_then_input(history, new, instructions) -> None:
    """`chat_request` with a stored conversation: as if history and input were sent as one ``input``."""
    expected = reference(copy.deepcopy(history) + ([{"role": "user", "content": new}] if isinstance(new, str)
                                                   else copy.deepcopy(new)), instructions)
    request = ResponsesRequest(input=new, instructions=instructions, previous_response_id="resp_1")
    assert chat_request(request, history).messages == expected


# --- invalid items ---------------------------------------------------------------------------------------------

INVALID = [  # (item, a word its message must hold)
    ({"type": "input_file", "file_id": "f"}, "'input_file'"),
    ({"type": "web_search_call", "id": "w"}, "'web_search_call'"),
    ({"type": None, "role": "user", "content": "x"}, "None"),
    ({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}, "encrypted_content"),
    ({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text"}]}, "content"),
    ({"type": "reasoning", "summary": "flat text"}, "summary"),
    ({"type": "reasoning", "summary": [{"type": "summary_text", "text": 3}]}, "summary"),
    ({"type": "reasoning", "content": ["bare"], "summary": []}, "content"),
    ({k: v for k, v in CALL.items() if k != "call_id"}, "call_id"),
    ({k: v for k, v in CALL.items() if k != "name"}, "name"),
    ({**CALL, "arguments": {"x": 1}}, "arguments"),
    ({"type": "function_call_output", "output": "o"}, "call_id"),
    ({"type": "function_call_output", "call_id": 7, "output": "o"}, "call_id"),
    ({"type": "function_call_output", "call_id": "c"}, "content"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]}, "'text'"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "thinking", "thinking": None}]},
     "'thinking'"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "data:"}]},
     "'input_image'"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "'input_file'"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}, "'image_url'"),
    ({"role": "assistant", "content": [{"text": "no type"}]}, "None"),
    ({"role": "user", "content": [5]}, "'int'"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}, "file_id"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "file_1", "image_url": "data:"}]}, "file_id"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": {"url": "data:"}}]}, "image_url"),
    ({"role": "assistant"}, "content"),
    ({"type": "message", "role": "user", "content": {"text": "x"}}, "content"),
    ("not an item", "object"),
    ({"type": "message", "content": "no role"}, "role"),  # vLLM's item models refuse it (until 2026-12-07: role None)
    ({"role": "tool", "content": "x"}, "'tool'"),
    ({"role": ["user"], "content": "x"}, "role"),
]


@SETTINGS
@given(items=items, where=st.integers(0, 8), bad=st.sampled_from(INVALID), instructions=instructions)
def test_an_invalid_item_is_a_400_naming_input_and_the_field(items, where, bad, instructions) -> None:
    where = min(where, len(items))
    item, word = bad
    with pytest.raises(InvalidRequestError) as info, renamed_fields(RESPONSES_FIELDS):
        input_messages([*items[:where], copy.deepcopy(item), *items[where:]], instructions)
    assert info.value.field == "input"
    assert f"item {where}" in info.value.message and word in info.value.message, info.value.message


@pytest.mark.parametrize("item, word", INVALID)
def test_each_invalid_item_alone_and_in_a_continued_response(item, word) -> None:
    """Each is refused as the only item, and in a stored conversation (its index counted from the history's start)."""
    with pytest.raises(InvalidRequestError) as info, renamed_fields(RESPONSES_FIELDS):
        chat_request(ResponsesRequest(input="next", previous_response_id="resp_1"), [REPLY, copy.deepcopy(item)])
    assert info.value.field == "input" and "item 1" in info.value.message and word in info.value.message
