"""Property tests of vLLM's chat template *content format* (asyncllm/chat_content.py) on drawn messages and templates.

The model, from the module's docstrings and docs/sampling.md, docs/multimodal.md (not from its code):

- ``"string"``: a message's content is one string, its text parts joined with ``"\\n"``; each image, video or audio
  part is its placeholder text (the model's mark for its kind), one per medium the text does not already hold,
  each ahead of the text and followed by ``"\\n"`` (in the order of the kinds' first parts; with no text, the marks
  alone, joined with ``"\\n"``, as vLLM since its separator option); a text holding more of
  a mark than the message has such media is an `InvalidRequestError`, and so is any media part without a
  multimodal model (no placeholder).
- ``"openai"``: a list of ``{"type": "text", "text": ...}`` parts with the media parts in place, a string content
  as one text part.
- Either way a content of None is no parts (``""`` / ``[]``) and a ``tool`` message of text parts only is one joined
  string.
- What is text (`text_part_text`): a bare string, a ``text`` / ``input_text`` / ``output_text`` part's ``text``, a
  ``refusal``'s ``refusal``, a ``thinking``'s ``thinking``; a ``text`` or ``refusal`` part whose text is None (or
  missing) is dropped; any other missing or non-str text is an `InvalidRequestError` on ``messages`` naming the
  part's field; a part that is neither a str nor a dict is one too.
- ``"auto"`` (`detect_content_format`): ``"openai"`` exactly when the template loops over a message's content,
  i.e. ``for x in M['content']`` / ``M["content"]`` / ``M.content`` (through filters and slices) where ``M`` is a
  loop variable over ``messages`` or a name ``{% set %}`` from it (through filters and slices, transitively), or
  ``for x in content`` (vLLM's literal-name rule); a tuple loop target over messages, or a template that does not
  parse, is ``"string"``.

Rules: the references below are written from that text; templates are generated from a small grammar of shapes
(each shape carrying its expected answer); rendering through the engine's own path (`multimodal_prompt`, else
`render_chat`) must equal transformers' rendering of the reference's content, and bad parts must be
`InvalidRequestError` on ``messages`` (never a KeyError / TypeError). ``CHAT_CONTENT_NO_SHRINK=1`` skips shrinking
(for mutation runs).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from asyncllm.bundled import bundled_model_path
from asyncllm.chat_content import content_format_of, detect_content_format, formatted_messages, is_text_part
from asyncllm.errors import InvalidRequestError
from asyncllm.mm.host import multimodal_prompt
from asyncllm.tokenizer import render_chat

settings.register_profile("chat_content_mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
if os.environ.get("CHAT_CONTENT_NO_SHRINK"):
    settings.load_profile("chat_content_mutations")

SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}

# ------------------------------------------------------------------ reference (from the docs)

TEXT_FIELD_OF = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                 "thinking": "thinking"}
"""Text-like part types (docs/sampling.md) and the field each carries its text in."""
DROPPED_WHEN_NONE = ("text", "refusal")
"""Part types vLLM skips when their text is None (docs/sampling.md)."""
MEDIA_KINDS = ("image", "video", "audio")


class RefError(Exception):
    """The reference's verdict: message `index` is refused; `field` the part field the error names (or None)."""

    def __init__(self, index: int, field: str | None = None) -> None:
        super().__init__(index, field)
        self.index, self.field = index, field


def ref_part(i: int, part: Any) -> tuple[str, Any]:
    """One content part as ("text", str), ("skip", None) or ("media", part); RefError for a bad one."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise RefError(i)
    kind = part.get("type")
    if not isinstance(kind, str) or kind not in TEXT_FIELD_OF:
        return "media", part
    field = TEXT_FIELD_OF[kind]
    value = part.get(field)
    if value is None and kind in DROPPED_WHEN_NONE:
        return "skip", None
    if not isinstance(value, str):
        raise RefError(i, field)
    return "text", value


def ref_string(i: int, texts: list[str], media: list[dict], marks: dict[str, str] | None) -> str:
    """The "string" content: marks the joined text lacks (by kind's first part, one per medium), then the text."""
    text = "\n".join(texts)
    if media and marks is None:
        raise RefError(i)
    order: list[str] = []
    for part in media:
        if marks[part["type"]] not in order:
            order.append(marks[part["type"]])
    ahead: list[str] = []
    for mark in order:
        if mark == "":  # an empty mark: the text always "holds" it
            continue
        wanted = sum(1 for part in media if marks[part["type"]] == mark)
        if text.count(mark) > wanted:
            raise RefError(i)
        ahead.extend([mark] * (wanted - text.count(mark)))
    return "\n".join([*ahead, text] if text else ahead)


def ref_content(i: int, message: dict, fmt: str, marks: dict[str, str] | None) -> Any:
    """What the template gets as message `i`'s content in `fmt` ("string" or "openai")."""
    content = message.get("content")
    if content is None:
        items: list[tuple[str, Any]] = []
    elif isinstance(content, str):
        items = [("text", content)]
    else:
        items = [item for item in (ref_part(i, part) for part in content) if item[0] != "skip"]
    texts = [value for kind, value in items if kind == "text"]
    media = [value for kind, value in items if kind == "media"]
    if fmt == "string" or message.get("role") == "tool" and not media:
        return ref_string(i, texts, media, marks)
    return [{"type": "text", "text": value} if kind == "text" else value for kind, value in items]


def ref_formatted(messages: list[dict], fmt: str, marks: dict[str, str] | None) -> list[dict]:
    """Every message with its reference content (RefError for the first refused message)."""
    return [{**message, "content": ref_content(i, message, fmt, marks)} for i, message in enumerate(messages)]


# ------------------------------------------------------------------ drawn messages

MARK_SETS = [
    {"image": "<I>", "video": "<V>", "audio": "<A>"},
    {"image": "<M>", "video": "<M>", "audio": "<A>"},  # two kinds share one mark
    {"image": "", "video": "<V>", "audio": "<A>"},  # a model whose image prompt writes no mark
]
FRAGMENTS = ["a", "b c", " ", "", "\n", "é", "<I>", "<V>", "<A>", "<M>", "{{ x }}"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=3).map("".join)


def text_parts() -> st.SearchStrategy[Any]:
    """Every text-like part vLLM reads (and text / refusal parts whose text is None or missing: dropped)."""
    return st.one_of(
        texts,
        st.builds(lambda kind, text: {"type": kind, "text": text}, st.sampled_from(["text", "input_text",
                                                                                   "output_text"]), texts),
        texts.map(lambda text: {"type": "refusal", "refusal": text}),
        texts.map(lambda text: {"type": "thinking", "thinking": text}),
        st.sampled_from([{"type": "text", "text": None}, {"type": "text"}, {"type": "refusal", "refusal": None},
                         {"type": "refusal"}]),
    )


def media_parts(extra: bool) -> st.SearchStrategy[dict]:
    """Media parts as the template sees them (`extra`: with more fields, which "openai" keeps as they are)."""
    canonical = st.sampled_from([{"type": "image"}, {"type": "video"}, {"type": "audio", "audio": ""}])
    if not extra:
        return canonical
    return st.one_of(canonical, st.builds(lambda kind, uuid: {"type": kind, kind: "data", "uuid": uuid},
                                          st.sampled_from(MEDIA_KINDS), st.sampled_from(["u1", None])))


def contents(media: st.SearchStrategy[dict]) -> st.SearchStrategy[Any]:
    """None, a string, or a list of text and media parts."""
    return st.one_of(st.none(), texts, st.lists(st.one_of(text_parts(), media, media, media), max_size=5))


def messages(media: st.SearchStrategy[dict]) -> st.SearchStrategy[list[dict]]:
    """One to four messages of the four roles."""
    message = st.builds(lambda role, content: {"role": role, "content": content},
                        st.sampled_from(["system", "user", "assistant", "tool"]), contents(media))
    return st.lists(message, min_size=1, max_size=4)


BAD_PARTS = [
    ({"type": "text", "text": 5}, "text"),  # a non-str text
    ({"type": "input_text"}, "text"),  # missing text (only text / refusal parts are dropped)
    ({"type": "output_text", "text": None}, "text"),
    ({"type": "thinking"}, "thinking"),
    ({"type": "thinking", "thinking": ["x"]}, "thinking"),
    ({"type": "refusal", "refusal": 3.5}, "refusal"),
    ({"type": "refusal", "text": "no"}, None),  # a refusal's text is its "refusal" field: missing, dropped
    (5, None), (None, None), (["x"], None),  # neither a str nor a dict
]
UNKNOWN_PARTS = [{"type": "image_file"}, {"type": "foo", "text": "x"}, {"type": 5}, {}, {"text": "no type"}]


# ------------------------------------------------------------------ drawn templates (shapes with their answer)

PART = "{% if p is mapping and p['type'] == 'text' %}{{ p['text'] }}{% elif p is mapping %}<{{ p.type }}>{% else %}?" \
       "{% endif %}"
TAIL = "{% for tail_m in messages %}[{{ tail_m['role'] }}]{% endfor %}"
"""Always printed: a loop over messages that never loops over content (not a reason for "openai")."""


@st.composite
def message_source(draw: st.DrawFn, n: int) -> tuple[str, str, bool]:
    """(prelude, loop iterable, whether the iterable is read from ``messages``) for section `n`."""
    alias, alias2 = f"loop_messages{n}", f"conv{n}"
    wrap = draw(st.sampled_from(["", " | list", "[0:]", " | reverse", "[1:]", " | selectattr('role')"]))
    shape = draw(st.sampled_from(["direct", "alias", "alias-chain", "conditional", "concat", "unrelated"]))
    if shape == "direct":
        return "", "messages" + wrap, True
    if shape == "alias":
        return f"{{% set {alias} = messages{wrap} %}}", alias, True
    if shape == "alias-chain":
        return f"{{% set {alias} = messages %}}{{% set {alias2} = {alias}{wrap} %}}", alias2, True
    if shape == "conditional":  # not followed by vLLM's detection
        return f"{{% set {alias} = messages if messages else [] %}}", alias, False
    if shape == "concat":  # an expression of messages, not messages: not followed either
        return f"{{% set {alias} = messages + [] %}}", alias, False
    return "", "[{'role': 'x', 'content': ['p']}]", False


@st.composite
def content_body(draw: st.DrawFn, var: str) -> tuple[str, bool | None]:
    """(body reading `var`'s content, True: loops over it / False: reads it without a loop / None: loops over the
    literal ``content`` name, "openai" whatever `var` is)."""
    ce = draw(st.sampled_from([f"{var}['content']", f'{var}["content"]', f"{var}.content"]))
    iter_wrap = draw(st.sampled_from(["", " | list", "[0:]"]))
    shape = draw(st.sampled_from(["loop", "nested-loop", "set-content", "set-other", "string-only", "joined",
                                  "is-string", "keys", "role"]))
    if shape == "loop":
        return (f"{{% if {ce} is string %}}S:{{{{ {ce} }}}}{{% else %}}{{% for p in {ce}{iter_wrap} %}}{PART}"
                "{% endfor %}{% endif %}"), True
    if shape == "nested-loop":
        return f"{{% for i in range(1) %}}{{% if true %}}{{% for p in {ce}{iter_wrap} %}}{PART}{{% endfor %}}" \
               "{% endif %}{% endfor %}", True
    if shape == "set-content":  # vLLM's literal-name rule
        return (f"{{% set content = {ce} %}}{{% if content is string %}}S:{{{{ content }}}}{{% else %}}"
                f"{{% for p in content %}}{PART}{{% endfor %}}{{% endif %}}"), None
    if shape == "set-other":  # an alias of the content under another name: vLLM does not follow it
        return (f"{{% set body = {ce} %}}{{% if body is string %}}S:{{{{ body }}}}{{% else %}}"
                f"{{% for p in body %}}{PART}{{% endfor %}}{{% endif %}}"), False
    if shape == "string-only":
        return draw(st.sampled_from([f"{{{{ {ce} }}}}", f"{{{{ {ce} | trim }}}}", f"{{{{ '<' + {ce} | string }}}}"])), \
            False
    if shape == "joined":
        return f"{{{{ {ce} | map(attribute='text') | join('|') }}}}", False
    if shape == "is-string":
        return f"{{% if {ce} is string %}}{{{{ {ce} }}}}{{% else %}}LIST{{{{ {ce} | length }}}}{{% endif %}}", False
    if shape == "keys":  # a loop over the message itself, not its content
        return f"{{% for k in {var} %}}{{{{ k }}}},{{% endfor %}}", False
    return f"{{% for ch in {var}['role'] %}}{{{{ ch }}}}{{% endfor %}}", False


@st.composite
def templates(draw: st.DrawFn, broken_too: bool = True) -> tuple[str, str, bool]:
    """(template, the content format "auto" must detect, whether it renders; `broken_too`: also ones that do not)."""
    sections, openai = [], False
    for n in range(draw(st.integers(1, 2))):
        prelude, iterable, of_messages = draw(message_source(n))
        var = draw(st.sampled_from(["message", "m", "msg", "turn"])) + ("" if n == 0 else str(n))
        body, loops = draw(content_body(var))
        loop = f"{{% for {var} in {iterable} %}}<{{{{ {var}['role'] }}}}>{body}{{% endfor %}}"
        if draw(st.booleans()):  # the message loop nested in another loop
            loop = f"{{% for _ in range(1) %}}{loop}{{% endfor %}}"
        sections.append(prelude + loop)
        openai |= loops is None or loops and of_messages
    template = "".join(sections) + TAIL
    broken = draw(st.sampled_from(["", "", "", "tuple", "content-tuple", "unparsable"])) if broken_too else ""
    if broken == "tuple":  # a tuple target over messages: vLLM's detection gives up
        return "{% for i, tm in messages | batch(1) %}{{ tm }}{% endfor %}" + template, "string", False
    if broken == "content-tuple":  # a tuple target on the first loop over content: vLLM's detection gives up too
        first = draw(st.sampled_from(["{% for tm in messages %}{% for a, b in tm['content'] | batch(2) %}{% endfor %}"
                                      "{% endfor %}", "{% for a, b in content %}{% endfor %}"]))
        return first + template, "string", False
    if broken == "unparsable":
        return template + "{% for m in messages %}{{ m.content", "string", False
    return template, "openai" if openai else "string", True


renderable = templates(broken_too=False)

# ------------------------------------------------------------------ the engine's path


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """The bundled model's tokenizer (its own template is never used here)."""
    return AutoTokenizer.from_pretrained(bundled_model_path())


def engine_render(chat: list[dict], template: str, fmt: str, marks: dict[str, str] | None) -> str:
    """The prompt text the engine renders for `chat`: `multimodal_prompt` (a model whose placeholders are `marks`,
    None: a text model) for a chat with media, else `render_chat`."""
    mm = None if marks is None else SimpleNamespace(tokenizer=tokenizer(), placeholder_text=marks.__getitem__,
                                                    process=lambda token_ids, inputs, field, overrides: token_ids)
    seen: list[str] = []
    if multimodal_prompt(mm, chat, True, chat_template=template, content_format=fmt, check_chat=seen.append) is None:
        return render_chat(tokenizer(), chat, True, chat_template=template, content_format=fmt)
    return seen[0]


def reference_render(chat: list[dict], template: str) -> str:
    """transformers' rendering of messages already in the reference's content."""
    return tokenizer().apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)


def has_media(chat: list[dict]) -> bool:
    """Whether some content list holds a part that is not text-like."""
    return any(isinstance(m["content"], list) and any(not is_text_part(p) for p in m["content"]) for m in chat)


# ------------------------------------------------------------------ properties

@settings(max_examples=300, **SETTINGS)
@given(templates())
# vLLM's literal-name rule: a loop over ``content``, whatever it holds, is "openai"
@example(("{% for p in content %}{{ p }}{% endfor %}", "openai", True))
# a content alias under another name is not followed (vLLM)
@example(("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{% endfor %}{% endfor %}", "string", True))
# the message loop over a twice-aliased slice, content read by attribute through a filter (Llama 4's shape)
@example(("{% set a = messages[1:] %}{% set b = a %}{% for t in b %}{% for p in t.content | list %}{% endfor %}"
          "{% endfor %}", "openai", True))
# a loop over some other dict's content is no loop over a message's
@example(("{% for m in [{'content': []}] %}{% for p in m['content'] %}{% endfor %}{% endfor %}", "string", True))
# a tuple target on the first loop over a message's content: vLLM's detection gives up ("string"); asyncllm said
# "openai" before the fix in asyncllm/chat_content.py's _content_loops
@example(("{% for m in messages %}{% for k, v in m['content'] | map('items') %}{% endfor %}{% endfor %}", "string",
          False))
# a tuple target over messages: "string" even with a content loop elsewhere
@example(("{% for i, x in messages | batch(1) %}{% endfor %}{% for m in messages %}{% for p in m.content %}"
          "{% endfor %}{% endfor %}", "string", False))
def test_auto_detects_exactly_the_templates_that_loop_over_a_messages_content(drawn: tuple[str, str, bool]) -> None:
    """`detect_content_format` (and "auto" through `content_format_of`) says "openai" exactly for the shapes that
    loop over a message's content; a given "string" / "openai" is kept whatever the template."""
    template, expected, _ = drawn
    event(f"expected {expected}")
    assert detect_content_format(template) == expected, template
    assert content_format_of("auto", tokenizer(), template) == expected
    for fmt in ("string", "openai"):
        assert content_format_of(fmt, tokenizer(), template) == fmt


def check_formatted(chat: list[dict], fmt: str, marks: dict[str, str] | None) -> None:
    """`formatted_messages` equals the reference, or both refuse: an `InvalidRequestError` on ``messages`` naming
    the refused item (and the part's field where the reference names one)."""
    try:
        expected = ref_formatted(chat, fmt, marks)
    except RefError as refused:
        with pytest.raises(InvalidRequestError) as info:
            formatted_messages(chat, fmt, None if marks is None else marks.__getitem__)
        assert info.value.field == "messages" and f"item {refused.index}" in info.value.message, info.value
        if refused.field is not None:
            assert f"{refused.field!r}" in info.value.message, info.value
        return
    assert formatted_messages(chat, fmt, None if marks is None else marks.__getitem__) == expected


@settings(max_examples=300, **SETTINGS)
@given(messages(media_parts(extra=True)), st.sampled_from(["string", "openai"]),
       st.one_of(st.none(), st.sampled_from(MARK_SETS)))
# None is no parts: "" / []; a tool message of no parts is one (empty) string
@example([{"role": "user", "content": None}, {"role": "tool", "content": None}], "openai", None)
# a tool message of text parts only is joined even in "openai"; with an image it stays parts
@example([{"role": "tool", "content": ["a", {"type": "output_text", "text": "b"}]},
          {"role": "tool", "content": ["a", {"type": "image"}]}], "openai", None)
# a mark the text already holds is not written again; the other kind's is, ahead of the text
@example([{"role": "user", "content": [{"type": "audio", "audio": ""}, "x <I>", {"type": "image"}]}], "string",
         MARK_SETS[0])
# marks ahead in the order of their kinds' first parts (image before audio here), not sorted
@example([{"role": "user", "content": [{"type": "image"}, "x", {"type": "audio", "audio": ""}, {"type": "image"}]}],
         "string", MARK_SETS[0])
# two kinds sharing one mark: counted together
@example([{"role": "user", "content": [{"type": "image"}, {"type": "video"}, "<M>"]}], "string", MARK_SETS[1])
# more marks in the text than media of that kind: refused
@example([{"role": "user", "content": [{"type": "image"}, "<I><I>"]}], "string", MARK_SETS[0])
# text / refusal parts whose text is None are dropped (not "None", not an empty line)
@example([{"role": "assistant", "content": [{"type": "refusal", "refusal": None}, "a", {"type": "text"}, "b"]}],
         "string", None)
# media without a multimodal model's placeholder: refused in "string", kept in "openai"
@example([{"role": "user", "content": [{"type": "video"}]}], "string", None)
def test_content_handed_to_the_template_is_the_documented_one(chat: list[dict], fmt: str,
                                                              marks: dict[str, str] | None) -> None:
    """Each message's content in "string" / "openai" is the reference's (other keys kept), or both refuse it."""
    check_formatted(chat, fmt, marks)


@settings(max_examples=200, **SETTINGS)
@given(messages(media_parts(extra=False)), st.integers(0, 3), st.integers(0, 5), st.sampled_from(BAD_PARTS),
       st.sampled_from(["string", "openai"]), st.one_of(st.none(), st.sampled_from(MARK_SETS)))
# a thinking part without its "thinking": refused naming 'thinking', never a KeyError
@example([{"role": "user", "content": "x"}], 0, 0, ({"type": "thinking"}, "thinking"), "openai", None)
# a non-str text: refused naming 'text', never a TypeError
@example([{"role": "tool", "content": ["a"]}], 0, 1, ({"type": "text", "text": 5}, "text"), "string", None)
def test_bad_text_parts_are_invalid_requests_naming_the_field(chat: list[dict], at: int, pos: int,
                                                              bad: tuple[Any, str | None], fmt: str,
                                                              marks: dict[str, str] | None) -> None:
    """A bad part put into a drawn chat: `formatted_messages` refuses it as the reference does (an
    `InvalidRequestError` on ``messages`` naming item and field), and so does the engine's rendering."""
    chat = [dict(m) for m in chat]
    target = chat[at % len(chat)]
    content = target["content"] if isinstance(target["content"], list) else []
    target["content"] = [*content[:pos], bad[0], *content[pos:]]
    check_formatted(chat, fmt, marks)
    try:
        ref_formatted(chat, fmt, marks)
    except RefError:
        with pytest.raises(InvalidRequestError) as info:
            engine_render(chat, TAIL + "{% for m in messages %}{{ m.content }}{% endfor %}", fmt, marks)
        assert info.value.field == "messages"


@settings(max_examples=100, **SETTINGS)
@given(messages(media_parts(extra=False)), st.integers(0, 3), st.integers(0, 5), st.sampled_from(UNKNOWN_PARTS),
       st.sampled_from(["auto", "string", "openai"]), st.one_of(st.none(), st.sampled_from(MARK_SETS)))
def test_unknown_part_types_are_invalid_requests(chat: list[dict], at: int, pos: int, unknown: dict, fmt: str,
                                                 marks: dict[str, str] | None) -> None:
    """An unknown part type (or none) is a media part to `formatted_messages`: kept in place by "openai", refused
    without a placeholder by "string"; the engine refuses it (`InvalidRequestError` on ``messages``)."""
    chat = [dict(m) for m in chat]
    target = chat[at % len(chat)]
    content = target["content"] if isinstance(target["content"], list) else []
    target["content"] = [*content[:pos], unknown, *content[pos:]]
    if fmt == "openai" or marks is None:
        check_formatted(chat, fmt if fmt != "auto" else "openai", None if fmt == "string" else marks)
    with pytest.raises(InvalidRequestError) as info:
        engine_render(chat, "{% for m in messages %}{% for p in m['content'] %}{% endfor %}{% endfor %}", fmt, marks)
    assert info.value.field == "messages"


@settings(max_examples=300, **SETTINGS)
@given(renderable, messages(media_parts(extra=False)), st.sampled_from(["auto", "string", "openai"]),
       st.sampled_from([None, *MARK_SETS]))
# Gemma 3's shape with a tool result of parts (joined) and an image in place
@example(("{% for message in messages %}{% if message['content'] is string %}S:{{ message['content'] }}{% else %}"
          "{% for item in message['content'] %}{% if item['type'] == 'image' %}<img>{% else %}{{ item['text'] }}"
          "{% endif %}{% endfor %}{% endif %}{% endfor %}", "openai", True),
         [{"role": "user", "content": [{"type": "image"}, "look"]},
          {"role": "tool", "content": [{"type": "input_text", "text": "a"}, "b"]}], "auto", MARK_SETS[0])
# a string-only template ("auto": "string") gets the placeholder ahead of the joined text
@example(("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "string", True),
         [{"role": "user", "content": ["what", {"type": "audio", "audio": ""}, "is it"]}], "auto", MARK_SETS[0])
def test_engine_rendering_equals_rendering_the_reference_content(drawn: tuple[str, str, bool], chat: list[dict],
                                                                 fmt: str, marks: dict[str, str] | None) -> None:
    """The engine's prompt text for a drawn chat and template (content format given or "auto") is transformers'
    rendering of the reference's content in the format the template's shape calls for; where the reference refuses
    (or a text model gets media) the engine raises an `InvalidRequestError` on ``messages``."""
    template, detected, _ = drawn
    form = detected if fmt == "auto" else fmt
    try:
        if marks is None and has_media(chat):
            raise RefError(0)  # a text model takes no media, whatever the format
        expected = reference_render(ref_formatted(chat, form, marks), template)
    except RefError:
        event("refused")
        with pytest.raises(InvalidRequestError) as info:
            engine_render(chat, template, fmt, marks)
        assert info.value.field == "messages"
        return
    event(f"rendered {form}{' with media' if has_media(chat) else ''}")
    assert engine_render(chat, template, fmt, marks) == expected
