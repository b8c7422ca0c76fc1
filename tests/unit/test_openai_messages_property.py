"""Property tests of integrations/openai_messages.py's `chat_messages` (OpenAI chat messages as the engine takes them).

The model is written from the module's docstrings and docs/integrations/openai-server.md, not from its code. Each
drawn piece carries the output the docs promise for it, so the reference is the drawing itself:

- text parts (a bare string, ``text`` / ``input_text`` / ``output_text`` parts' ``text``, a ``refusal``'s
  ``refusal``, a ``thinking``'s ``thinking``) become ``{"type": "text", "text": str}``; a ``text`` or ``refusal``
  part whose text is None (or absent) is dropped; a string content stays a string, None (or absent) is None;
- with ``images``: ``image_url`` / ``video_url`` / ``audio_url`` parts become ``{"type", kind: {"url"}, "uuid"?}``
  (``detail`` dropped; ``data:`` and http(s) URLs as they are, the server fetches nothing here; a ``file://`` URL as
  its resolved path, only strictly inside `media_root`), ``input_audio`` parts keep ``type``, ``input_audio`` and
  ``uuid``;
- message keys whose value is None are dropped; an assistant's ``refusal``, ``annotations``, ``audio`` and
  ``function_call`` are ignored; its first non-empty ``reasoning`` / ``reasoning_content`` goes out under both names;
  ``name``, ``tool_calls`` and ``tool_call_id`` go through; the input is not changed. Assistant history is drawn
  in the official client's ``ChatCompletionMessage.model_dump()`` shape too.

Bad requests (one fault injected into a valid list) must be `InvalidRequestError` naming ``messages`` (or the
media part, ``messages[i].content[j]``) and the culprit, never another exception, through the engine's whole
message path (`chat_messages`, then `formatted_messages` and `template_messages`, which check roles, content types
and tool calls; tool call ``arguments`` JSON text is parsed for the template). ``PROP_EXAMPLES`` sets the number
of examples (mutation runs).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import posixpath
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessage

from asyncllm.chat_content import formatted_messages
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_messages import chat_messages, has_media_parts
from asyncllm.tokenizer import template_messages

SETTINGS = settings(max_examples=int(os.environ.get("PROP_EXAMPLES", "60")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ROOT = Path(tempfile.gettempdir()).resolve() / "asyncllm-media-property"
"""The allowed local media folder (empty, so no symbolic link under it: a resolved path is a normalized one). Its
name is fixed: the parametrized ids name it, and pytest-xdist's workers must collect the same ids."""
ROOT.mkdir(exist_ok=True)

TEXT_FIELD = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
URL_KINDS = ("image_url", "video_url", "audio_url")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
IGNORED = ("refusal", "annotations", "audio", "function_call")
AUDIO = {"id": "a", "data": "", "expires_at": 0, "transcript": "t"}
"""An assistant reply's audio as the official client dumps it."""
texts = st.text(max_size=6)
names = st.text("abcxyz_-09", min_size=1, max_size=4)

# ------------------------------------------------------------------ valid pieces, each with its documented output


@st.composite
def text_parts(draw) -> tuple[Any, list[dict[str, Any]]]:
    """A text-like part and what the docs make of it (no part for a text / refusal part without text)."""
    kind = draw(st.sampled_from([None, *TEXT_FIELD]))
    if kind is None:
        text = draw(texts)
        return text, [{"type": "text", "text": text}]
    if kind in ("text", "refusal") and draw(st.booleans()):
        part = {"type": kind, **draw(st.sampled_from([{TEXT_FIELD[kind]: None}, {}]))}
        return part, []
    text = draw(texts)
    return {"type": kind, TEXT_FIELD[kind]: text}, [{"type": "text", "text": text}]


@st.composite
def file_paths(draw, inside: bool) -> tuple[str, str]:
    """A ``file:`` URL path under ROOT (``.`` / ``..`` segments too) and its normalized form, inside or not."""
    while True:
        segments = draw(st.lists(st.one_of(names, st.sampled_from([".", ".."])), min_size=1, max_size=4))
        path = str(ROOT) + "/" + "/".join(segments)
        norm = posixpath.normpath(path)
        if norm.startswith(str(ROOT) + "/") == inside:
            return path, norm


@st.composite
def good_urls(draw) -> tuple[str, str]:
    """A media url the docs let through and what the engine is handed: data: and http(s) as they are, a file: URL
    inside ROOT as its path."""
    kind = draw(st.sampled_from(["data", "http", "file"]))
    if kind == "data":
        url = "data:image/png;base64," + base64.b64encode(draw(st.binary(max_size=6))).decode()
        return url, url
    if kind == "http":
        url = draw(st.sampled_from(["http://", "https://"])) + "example.com/" + draw(names)
        return url, url
    path, norm = draw(file_paths(True))
    return draw(st.sampled_from(["file://", "file://localhost", "file:"])) + path, norm


@st.composite
def media_parts(draw) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A media part and the engine's part for it (``detail`` dropped, ``uuid`` kept)."""
    kind = draw(st.sampled_from([*URL_KINDS, "input_audio"]))
    uuid = draw(st.sampled_from([{}, {"uuid": "u-1"}, {"uuid": "x"}]))
    if kind == "input_audio":
        audio = {"data": base64.b64encode(draw(st.binary(max_size=6))).decode(), "format": "wav"}
        detail = draw(st.sampled_from([{}, {"detail": "auto"}]))  # the docs: OpenAI's detail hint is dropped
        return {"type": kind, "input_audio": audio, **uuid, **detail}, [{"type": kind, "input_audio": audio, **uuid}]
    url, seen = draw(good_urls())
    detail = draw(st.sampled_from([{}, {"detail": "auto"}, {"detail": "low"}]))
    part = {"type": kind, kind: {"url": url, **detail}, **uuid}
    return part, [{"type": kind, kind: {"url": seen}, **uuid}]


@st.composite
def contents(draw, images: bool) -> tuple[dict[str, Any], Any]:
    """A message's content entry ({} when absent) and its output content."""
    shape = draw(st.sampled_from(["absent", "none", "str", "list"]))
    if shape == "absent":
        return {}, None
    if shape == "none":
        return {"content": None}, None
    if shape == "str":
        text = draw(texts)
        return {"content": text}, text
    part = st.one_of(text_parts(), media_parts()) if images else text_parts()
    drawn = draw(st.lists(part, max_size=5))
    return {"content": [p for p, _ in drawn]}, [out for _, outs in drawn for out in outs]


def calls(draw) -> list[dict[str, Any]]:
    """Tool calls as the client sends them back: arguments JSON text (or a dict, vLLM's other form)."""
    drawn = []
    for n in range(draw(st.integers(0, 2))):
        arguments = draw(st.sampled_from(['{"a": 1}', "{}", {"b": [1]}, "[1, 2]", "not json"]))
        drawn.append({"id": f"call_{n}", "type": "function", "function": {"name": draw(names), "arguments": arguments}})
    return drawn


def assistant_extras(draw) -> tuple[dict[str, Any], dict[str, Any]]:
    """An assistant's model_dump fields (None ones, ignored ones, tool calls, reasoning) and what goes out."""
    given: dict[str, Any] = {key: draw(st.sampled_from([None, value])) for key, value in
                             (("refusal", "no"), ("annotations", []), ("audio", AUDIO),
                              ("function_call", {"name": "f", "arguments": "{}"}))}
    out: dict[str, Any] = {}
    tool_calls = draw(st.sampled_from(["absent", "none", "list"]))
    if tool_calls != "absent":
        given["tool_calls"] = calls(draw) if tool_calls == "list" else None
        if tool_calls == "list":
            out["tool_calls"] = copy.deepcopy(given["tool_calls"])
    reasoning, reasoning_content = draw(st.sampled_from([None, "", "r1", "absent"])), draw(
        st.sampled_from([None, "", "r2", "absent"]))
    given.update({k: v for k, v in (("reasoning", reasoning), ("reasoning_content", reasoning_content))
                  if v != "absent"})
    present = [v for v in (reasoning, reasoning_content) if v not in (None, "absent")]
    read = next((v for v in present if v), present[0] if present else None)  # the first non-empty
    if read is not None:
        out["reasoning"] = out["reasoning_content"] = read
    return given, out


@st.composite
def messages(draw, images: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A valid message of any role and its documented output."""
    role = draw(st.sampled_from(ROLES))
    content, out_content = draw(contents(images))
    message: dict[str, Any] = {"role": role, **content}
    out: dict[str, Any] = {"role": role, "content": out_content}
    for key in ("name", "tool_call_id") if role in ("tool", "function") else ("name",):
        value = draw(st.sampled_from(["absent", None, "n1"]))
        if value != "absent":
            message[key] = value
        if value not in ("absent", None):
            out[key] = value
    if role == "assistant":
        extras, extras_out = assistant_extras(draw)
        message.update(extras)
        out.update(extras_out)
    junk = draw(st.sampled_from([None, "metadata", "weight", "refusal"]))
    if junk is not None and junk not in message:  # a key whose value is None is dropped, whatever its name
        message[junk] = None
    if role == "assistant" and draw(st.booleans()) and isinstance(message.get("content"), (str, type(None))) \
            and all(isinstance(c["function"]["arguments"], str) for c in message.get("tool_calls") or []):
        message = ChatCompletionMessage.model_validate(message).model_dump()  # the official client's history shape
    return message, out


def message_lists(images: bool):
    return st.lists(messages(images), min_size=1, max_size=4)


def engine_path(msgs: list[dict[str, Any]], images: bool, root: Path | None = ROOT) -> list[dict[str, Any]]:
    """The engine's whole message path: this module, the content format ("openai"), the template's checks."""
    return template_messages(formatted_messages(chat_messages(msgs, images, root), "openai"))


def template_arguments(arguments: Any) -> Any:
    """A tool call's arguments as the docs say templates get them: JSON text parsed (not JSON: {}), a dict as is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return {}
    return arguments


# ------------------------------------------------------------------ valid messages


@SETTINGS
@given(drawn=message_lists(images=True), images=st.booleans())
@example(drawn=[({"role": "user", "content": [{"type": "text", "text": None}, {"type": "refusal"}, "a",
                                              {"type": "thinking", "thinking": "t"}]},
                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "t"}]})],
         images=False)
@example(drawn=[({"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
                  "function_call": None, "tool_calls": None, "reasoning_content": "why"},
                 {"role": "assistant", "content": None, "reasoning": "why", "reasoning_content": "why"})],
         images=False)
@example(drawn=[({"role": "assistant", "content": "", "reasoning": "", "reasoning_content": "b"},
                 {"role": "assistant", "content": "", "reasoning": "b", "reasoning_content": "b"})], images=False)
def test_valid_messages_become_what_the_docs_say(drawn, images) -> None:
    msgs = [m for m, _ in drawn]
    has_media = any(isinstance(p, dict) and p.get("type") in (*URL_KINDS, "input_audio")
                    for m in msgs if isinstance(m.get("content"), list) for p in m["content"])
    if has_media and not images:
        images = True  # media parts only where the route takes them (the refusal is tested below)
    before = copy.deepcopy(msgs)
    assert chat_messages(msgs, images, ROOT) == [out for _, out in drawn]
    assert has_media_parts(msgs) == has_media
    assert msgs == before, "the request's messages were changed"


@SETTINGS
@given(drawn=message_lists(images=True))
def test_valid_messages_pass_the_engines_whole_path(drawn) -> None:
    """Through the content format and the template's checks: tool calls' JSON arguments parsed (text that is not
    JSON as {}), a dict as it is, an empty list dropped (as vLLM's _postprocess_messages)."""
    msgs = [m for m, _ in drawn]
    rendered = engine_path(msgs, True)
    assert len(rendered) == len(msgs)
    for (message, out), got in zip(drawn, rendered):
        calls_in = message.get("tool_calls") or []
        assert "tool_calls" not in got if not calls_in else \
            [c["function"]["arguments"] for c in got["tool_calls"]] == \
            [template_arguments(c["function"]["arguments"]) for c in calls_in]
        assert got.get("reasoning") == out.get("reasoning")


# ------------------------------------------------------------------ one fault: a 400 naming the field

BAD_PARTS = [{"type": "file", "file": {"file_id": "f"}}, {"type": "input_image", "image_url": "data:,"},
             {"type": "image"}, {"type": None, "text": "a"}, {"text": "no type"}, {"type": ["text"]}, 5, None,
             ["a"], {"type": "TEXT", "text": "a"}]
BAD_TEXTS = [{"type": "input_text", "text": None}, {"type": "output_text"}, {"type": "thinking", "thinking": None},
             {"type": "text", "text": 3}, {"type": "refusal", "refusal": ["no"]}, {"type": "input_text", "text": b"a"}]
BAD_URLS = ["", None, 5, "DATA:image/png;base64,AA==", " data:,", "/etc/passwd", "ftp://example.com/a",
            "example.com/a.png", "file:///etc/passwd", f"file://{ROOT}", f"file://other{ROOT}/a",
            f"file://{ROOT}/../x", f"file://{ROOT}/a/../../y", "file:relative",
            f"file://{ROOT}/%2e%2e/z", f"file://{ROOT}/a%00b", f"{ROOT}/a.png", f"FILE:{ROOT}/../a"]


def fault_unknown_key(draw, message: dict[str, Any], i: int) -> tuple[str, str]:
    own = ("refusal", "annotations", "audio", "function_call", "reasoning", "reasoning_content")
    choices = ["metadata", "weight", "tool_call", "Role"] + ([] if message.get("role") == "assistant" else list(own))
    key = draw(st.sampled_from([k for k in choices if k not in message]))
    message[key] = draw(st.sampled_from(["x", 0, False, [], {}]))
    return "messages", repr(key)


def fault_reasoning(draw, message: dict[str, Any], i: int) -> tuple[str, str]:
    message["role"] = "assistant"
    key = draw(st.sampled_from(["reasoning", "reasoning_content"]))
    for name in ("reasoning", "reasoning_content"):
        message.pop(name, None)
    if key == "reasoning_content" and draw(st.booleans()):
        message["reasoning"] = "x"  # the other one is read, this one still checked (until 2026-12-07: accepted)
    message[key] = draw(st.sampled_from([1, ["r"], {"text": "r"}, True, b"r"]))
    return "messages", key


def fault_part(draw, message: dict[str, Any], i: int) -> tuple[str, str]:
    kind = draw(st.sampled_from(["type", "text", "media_off", "url", "outside", "no_root"]))
    if kind == "type":
        part, words = draw(st.sampled_from(BAD_PARTS)), "content parts"
    elif kind == "text":
        part = draw(st.sampled_from(BAD_TEXTS))
        words = repr(TEXT_FIELD[part["type"]])
    elif kind == "media_off":
        part = draw(media_parts())[0]
        words = part["type"]
    else:
        media = draw(st.sampled_from(URL_KINDS))
        url = draw(st.sampled_from(BAD_URLS)) if kind == "url" else "file://" + draw(file_paths(kind == "no_root"))[0]
        part = {"type": media, media: {"url": url} if url is not None else {}}
        words = ""
    content = message.get("content")
    parts = list(content) if isinstance(content, list) else []
    j = draw(st.integers(0, len(parts)))
    message["content"] = parts[:j] + [part] + parts[j:]
    return (f"messages[{i}].content[{j}]" if kind in ("url", "outside", "no_root") else "messages"), kind + ":" + words


def fault_template(draw, message: dict[str, Any], i: int) -> tuple[str, str]:
    """Faults the engine's template path finds after this module: a role, a content type, a tool call."""
    kind = draw(st.sampled_from(["no_role", "role", "content", "calls", "call", "name"]))
    if kind == "no_role":
        message.pop("role")
    elif kind == "role":
        message["role"] = draw(st.sampled_from([1, ["user"], {"r": "user"}]))
    elif kind == "content":
        message["content"] = draw(st.sampled_from([1, {"text": "a"}, 2.5, True]))
    elif kind == "calls":
        message["tool_calls"] = draw(st.sampled_from([{"id": "c"}, "call", 1]))
    else:
        bad = {"call": draw(st.sampled_from([{"id": "c", "type": "function"}, "f", None, {"function": "f"}])),
               "name": {"id": "c", "type": "function", "function": {"arguments": "{}", "name": draw(
                   st.sampled_from([None, 1, ["f"]]))}}}[kind]
        message["tool_calls"] = [*(message.get("tool_calls") or []), bad]
    return "messages", ""


def first_part(msgs: list[dict[str, Any]], media: bool) -> tuple[int, int, dict[str, Any]]:
    """The list's first media part (`media`), else its first part with a ``file:`` url."""
    for i, message in enumerate(msgs):
        for j, part in enumerate(message.get("content") if isinstance(message.get("content"), list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in (*URL_KINDS, "input_audio") and (media or part.get(kind, {}).get("url", "").startswith("file:")):
                return i, j, part
    raise AssertionError("no such part")


FAULTS = {"unknown_key": fault_unknown_key, "reasoning": fault_reasoning, "part": fault_part,
          "template": fault_template}


@SETTINGS
@given(data=st.data(), drawn=message_lists(images=True), fault=st.sampled_from(sorted(FAULTS)))
@example(data=None, drawn=[({"role": "user", "content": "a", "refusal": "no"}, {})], fault="none")
@example(data=None, drawn=[({"role": "assistant", "content": "a", "reasoning": 7}, {})], fault="none")
@example(data=None, drawn=[({"content": "a"}, {})], fault="none")
@example(data=None, drawn=[({"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}, {})],
         fault="none")
def test_a_bad_message_is_a_400_naming_its_field(data, drawn, fault) -> None:
    msgs = [copy.deepcopy(m) for m, _ in drawn]
    if fault == "none":  # an @example: the fault is already in place
        field, words, kind, images = "messages", "", "", True
    else:
        i = data.draw(st.integers(0, len(msgs) - 1), label="i")
        field, words = FAULTS[fault](data.draw, msgs[i], i)
        kind, _, words = words.rpartition(":")
        images = kind != "media_off"
        if kind in ("media_off", "no_root"):  # the first media part (file: URL part) of the list is the one named
            i, j, part = first_part(msgs, media=kind == "media_off")
            field, words = ("messages", part["type"]) if kind == "media_off" else (f"messages[{i}].content[{j}]", "")
    with pytest.raises(InvalidRequestError) as caught:
        engine_path(msgs, images, None if kind == "no_root" else ROOT)
    assert caught.value.field == field, (caught.value, msgs)
    assert words in caught.value.message, (caught.value, msgs)


@pytest.mark.parametrize(("url", "path"), [(f"file://{ROOT}/a.png", f"{ROOT}/a.png"),
                                         (f"file://localhost{ROOT}/b/../c.png", f"{ROOT}/c.png"),
                                         (f"file://{ROOT}/a%20b.png", f"{ROOT}/a b.png")])
def test_a_file_url_needs_the_allowed_folder(url, path) -> None:
    """A file: URL is its (percent-decoded, resolved) path inside the allowed folder; without one, a 400."""
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
    assert chat_messages([message], True, ROOT)[0]["content"][0]["image_url"]["url"] == path
    with pytest.raises(InvalidRequestError) as caught:
        chat_messages([message], True, None)
    assert caught.value.field == "messages[0].content[0]"


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("kind", URL_KINDS)
def test_a_refused_media_url_names_its_part(kind, url) -> None:
    """Only data:, http(s) and file: URLs inside the allowed folder, matched literally, go on to the engine."""
    part = {"type": kind, kind: {"url": url} if url is not None else {}}
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": ["a", part, {"type": "text", "text": "b"}]}]
    with pytest.raises(InvalidRequestError) as caught:
        chat_messages(msgs, True, ROOT)
    assert caught.value.field == "messages[1].content[1]"


def test_has_media_parts_looks_only_at_content_lists() -> None:
    assert not has_media_parts(["x", {"content": "image_url"}, {"content": [{"type": "text", "text": "a"}, "b"]}])
    assert has_media_parts([{"content": None}, {"content": ["a", {"type": "input_audio", "input_audio": {}}]}])
