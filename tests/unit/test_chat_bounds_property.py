"""Property test: a chat refused by its size before its template renders it (asyncllm/engine/chat_bounds.py
`check_chat_size` and `message_texts`, with asyncllm/engine/validation.py `check_prompt_chars`, which it calls).

The reference is the render itself. Each drawn chat is written out as vLLM hands it to a template (its ``"string"``
content format: a list's text-like parts joined with ``"\\n"``, a media part's placeholder ahead of them, None as
"") by transformers' ``apply_chat_template`` with one of three templates: the bundled model's (special role
tokens), a ChatML-like one whose role markers are plain text for this vocabulary, and transformers' old GPT-2
default (each content and EOS, no role at all); its text is tokenized as the engine tokenizes a chat (no special
tokens added). The module's claims (its docstrings, docs/security.md):

- soundness: a refusal is `prompt_too_long` on ``messages`` (code ``context_length_exceeded``, ``max_model_len`` in
  its words) and hits only a chat that cannot fit: its render has more than ``max_model_len`` tokens; with
  ``cuttable`` (``truncate_prompt_tokens``, ``/tokenize``) the bound is on the render alone, deliberately: more than
  `CUT_CHAT_MESSAGES` times ``max_model_len`` messages;
- the message bound always refuses: more than ``max_model_len`` messages (times `CUT_CHAT_MESSAGES` when cuttable);
- the text bound costs nothing below ``past`` (``max_prompt_chars``): texts of at most ``past`` characters with one
  separator each are never refused by it, nor is a cuttable chat's text; past it, texts (in one part) that make
  more than ``max_model_len`` tokens by far, tokenized one by one, are refused;
- `message_texts` returns each string content and each string or ``text`` of a content list's parts, in order
  (a reference written from that docstring), on any shape of messages.

Drawn: ``max_model_len`` 1 to 40, chats of about ``max_model_len`` messages (about `CUT_CHAT_MESSAGES` times that
when cuttable) from a pool of a few messages, or a few messages with long texts (up to a few thousand characters;
texts past a part, `PART_CHARS`, which `tokens_at_least` counts part by part, are a plain test's: too slow to draw);
roles user / assistant / system; contents a string (empty, words, any unicode, whitespace runs, repeated units), None,
or a list of bare strings, ``text`` / ``input_text`` / ``refusal`` parts (a ``text`` of None too) and image parts;
``past`` from 0 to past the texts' length, or the engine's own `max_prompt_chars`; an operation (None or a pooling
one); and, for `message_texts`, wild shapes (non-dict messages, contents and parts of other types).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncllm.bundled import bundled_model_path
from asyncllm.engine.chat_bounds import CUT_CHAT_MESSAGES, check_chat_size, message_texts
from asyncllm.engine.validation import PART_CHARS, check_prompt_chars, max_prompt_chars
from asyncllm.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "250"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize="PROP_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GPT2 = "{% for message in messages %}{{ message.content }}{{ eos_token }}{% endfor %}"
TEMPLATES = {"bundled": None, "chatml": CHATML, "gpt2": GPT2}
PLACEHOLDER = "<image>"
"""A multimodal model's image placeholder text: a text model refuses media parts, a real placeholder adds tokens."""
POOLING = "embedding generation"


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_path())


# ---------------------------------------------------------------- the references
def reference_texts(messages: list[Any]) -> list[str]:
    """From `message_texts`' docstring: a dict message's string content, or its content list's string parts and
    the string ``text`` of its dict parts, in order; nothing else."""
    out: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
            continue
        for part in content if isinstance(content, list) else ():
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
    return out


def string_content(content: Any) -> str:
    """vLLM's ``"string"`` content: None "", a list's text-like parts joined by newlines after a placeholder per
    image part."""
    if content is None or isinstance(content, str):
        return content or ""
    texts, images = [], 0
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif part["type"] in ("text", "input_text") and part["text"] is not None:
            texts.append(part["text"])
        elif part["type"] == "refusal":
            texts.append(part["refusal"])
        elif part["type"] == "image_url":
            images += 1
    return "\n".join([PLACEHOLDER] * images + texts)


def rendered_tokens(messages: list[dict[str, Any]], template: str | None) -> int:
    """The chat's token count as the engine makes it: rendered, then tokenized with no special tokens added."""
    flat = [{**message, "content": string_content(message["content"])} for message in messages]
    text = tokenizer().apply_chat_template(flat, chat_template=template, tokenize=False, add_generation_prompt=True)
    return len(tokenizer()(text, add_special_tokens=False).input_ids)


# ---------------------------------------------------------------- the draws
WORDS = st.sampled_from(["a", "hello", " world", "the", "def", "\n", "  ", "\t", ".", "!?", "'s", "é", "e\u0301",
                         "日本語", "🙂", "\u200b", "<|user|>", "<|eos|>", "12345", "x" * 30])
SHORT_TEXTS = st.one_of(st.just(""), st.text(max_size=12), st.lists(WORDS, max_size=8).map("".join))
LONG_TEXTS = st.one_of(st.text(min_size=20, max_size=300),
                       st.builds(lambda unit, n: unit * n, st.lists(WORDS, min_size=1, max_size=4).map("".join),
                                 st.integers(5, 120)))


def contents(texts: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    part = st.one_of(texts, st.builds(lambda t: {"type": "text", "text": t}, texts),
                     st.builds(lambda t: {"type": "input_text", "text": t}, texts),
                     st.builds(lambda t: {"type": "refusal", "refusal": t}, texts),
                     st.just({"type": "text", "text": None}),
                     st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}))
    return st.one_of(texts, st.none(), st.lists(part, max_size=4))


def messages(texts: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda role, content: {"role": role, "content": content},
                     st.sampled_from(["user", "assistant", "system"]), contents(texts))


SHORT_MESSAGES = messages(SHORT_TEXTS)
LONG_MESSAGES = messages(LONG_TEXTS | SHORT_TEXTS)


@st.composite
def chats(draw: st.DrawFn) -> tuple[list[dict[str, Any]], int, bool]:
    """(messages, max_model_len, cuttable): about max_model_len messages (CUT_CHAT_MESSAGES times it when cuttable)
    of short texts from a pool, or a few messages of long texts."""
    cuttable = draw(st.booleans())
    max_model_len = draw(st.integers(1, 40))
    if draw(st.integers(0, 2)) == 0:
        return draw(st.lists(LONG_MESSAGES, min_size=1, max_size=3)), max_model_len, cuttable
    limit = max_model_len * (CUT_CHAT_MESSAGES if cuttable else 1)
    count = draw(st.integers(0, 6)) if draw(st.integers(0, 3)) == 0 else max(0, limit + draw(st.integers(-3, 3)))
    pool = draw(st.lists(SHORT_MESSAGES, min_size=1, max_size=4))
    return [pool[i % len(pool)] for i in range(count)], max_model_len, cuttable


def joined_chars(messages: list[Any]) -> int:
    """The texts' characters with one separator each."""
    texts = reference_texts(messages)
    return sum(map(len, texts)) + len(texts)


def texts_past(messages: list[Any], max_model_len: int, past: int) -> bool:
    """Whether the texts must be refused by their count: more than `past` characters of their own, in one part
    (``max(4 * max_model_len, PART_CHARS)`` characters: a count by parts below the whole text's is only allowed at
    a cut), and making more than `max_model_len` tokens by far: tokenized one by one, two a text spared (a
    separator's merges at either end)."""
    texts = reference_texts(messages)
    chars = sum(map(len, texts))
    if not past < chars < max(4 * max_model_len, PART_CHARS) - len(texts):
        return False
    tokens = sum(len(tokenizer()(text, add_special_tokens=False).input_ids) for text in texts)
    return tokens > max_model_len + 2 * len(texts)


# ---------------------------------------------------------------- the properties
def refusal(messages: list[Any], max_model_len: int, past: int, operation: str | None,
            cuttable: bool) -> InvalidRequestError | None:
    try:
        check_chat_size(tokenizer(), messages, max_model_len, past, operation, cuttable=cuttable)
    except InvalidRequestError as exc:
        return exc
    return None


def check_refusal(error: InvalidRequestError, max_model_len: int, operation: str | None) -> None:
    assert error.field == "messages" and error.code == CONTEXT_LENGTH_EXCEEDED, error
    assert f"maximum context length is {max_model_len} tokens" in error.message, error
    assert (f"for {operation}." in error.message) == (operation is not None), error


@SETTINGS
@given(chat=chats(), template=st.sampled_from(sorted(TEMPLATES)), operation=st.sampled_from([None, POOLING]),
       data=st.data())
def test_a_refused_chat_cannot_fit(chat, template, operation, data) -> None:
    messages, max_model_len, cuttable = chat
    assert message_texts(messages) == reference_texts(messages)
    chars = joined_chars(messages)
    if data.draw(st.integers(0, 3), label="the engine's past") == 0:
        past = max_prompt_chars(tokenizer(), max_model_len)
    else:
        past = data.draw(st.integers(0, chars + 2), label="past")
    error = refusal(messages, max_model_len, past, operation, cuttable)
    limit = max_model_len * (CUT_CHAT_MESSAGES if cuttable else 1)
    assert (error is not None) >= (len(messages) > limit), "more messages than the bound, not refused"
    event("refused" if error else "passed", f"{'cuttable' if cuttable else 'whole'}, {len(messages) > limit}")
    if error is None:
        assert cuttable or not texts_past(messages, max_model_len, past), "texts past max_model_len, not refused"
        return
    check_refusal(error, max_model_len, operation)
    if len(messages) <= limit:  # refused by its texts
        assert not cuttable and chars > past, ("a text bound below past chars or on a cuttable chat", chars, past)
    if not cuttable:
        tokens = rendered_tokens(messages, TEMPLATES[template])
        assert tokens > max_model_len, f"refused a chat of {tokens} tokens ({template}): {error}"


WILD_VALUES = st.one_of(st.text(max_size=5), st.none(), st.integers(), st.just(["x"]))
WILD_PARTS = st.one_of(st.text(max_size=5), st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2),
                       st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "refusal"]),
                                              "text": WILD_VALUES}),
                       st.dictionaries(st.sampled_from(["type", "text", "refusal"]), WILD_VALUES, max_size=3))
WILD_MESSAGES = st.one_of(
    st.builds(lambda content: {"role": "user", "content": content},
              st.one_of(st.text(max_size=5), st.none(), st.integers(), st.lists(WILD_PARTS, max_size=4),
                        st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))),
    st.dictionaries(st.sampled_from(["role", "name"]), st.text(max_size=3), max_size=2),
    st.text(max_size=5), st.none(), st.lists(st.text(max_size=3), max_size=2))


@SETTINGS
@given(messages=st.lists(WILD_MESSAGES, max_size=6), max_model_len=st.integers(1, 8), past=st.integers(0, 20),
       cuttable=st.booleans())
def test_message_texts_of_any_shape(messages, max_model_len, past, cuttable) -> None:
    """Any shape: the docstring's texts, and `check_chat_size` passes or refuses on messages, never crashes."""
    assert message_texts(messages) == reference_texts(messages)
    error = refusal(messages, max_model_len, past, None, cuttable)
    if error is not None:
        check_refusal(error, max_model_len, None)


@SETTINGS
@given(texts=st.lists(LONG_TEXTS | SHORT_TEXTS, min_size=1, max_size=3), spare=st.integers(-3, 3),
       below=st.integers(-2, 400), field=st.sampled_from(["prompt", "messages"]))
def test_check_prompt_chars_refuses_texts_past_max_model_len_by_their_tokens(texts, spare, below, field) -> None:
    """`check_prompt_chars` on texts shorter than a part: past ``past`` characters together, refused exactly when
    their tokens (each tokenized whole, no special tokens) make more than max_model_len; never at or below it."""
    chars = sum(map(len, texts))
    tokens = sum(len(tokenizer()(text, add_special_tokens=False).input_ids) for text in texts)
    max_model_len, past = max(1, tokens + spare), max(0, chars - below)
    try:
        check_prompt_chars(tokenizer(), tuple(texts), max_model_len, past, None, field)
    except InvalidRequestError as exc:
        assert chars > past and tokens > max_model_len, (exc, tokens, chars, past)
        assert exc.field == field and exc.code == CONTEXT_LENGTH_EXCEEDED and f"{chars} characters" in exc.message
        return
    assert not (chars > past and tokens > max_model_len), (tokens, max_model_len, chars, past)


def test_a_text_cut_inside_a_word_is_not_counted_past_its_tokens() -> None:
    """A text with no space in its first part is cut inside a word; its two parts tokenize to 4 more tokens than the
    whole (11,222): with only `PART_CUT_TOKENS` (2) spared, a pooling request of exactly its tokens was refused (now
    the tokens around such a cut are spared, `HARD_CUT_WINDOW`). Reachable only below the engine's
    `max_prompt_chars` for this vocabulary (which spells every character); a tokenizer that drops characters (BERT's
    newlines) could be counted so at the engine's own ``past``."""
    text = "return" * (PART_CHARS // 6 + 300)
    tokens = len(tokenizer()(text, add_special_tokens=False).input_ids)
    check_prompt_chars(tokenizer(), (text,), tokens, 0, POOLING)


@pytest.mark.parametrize("unit", [" ", "        return None\n"], ids=["spaces", "code"])
def test_texts_longer_than_a_part_are_refused_only_past_their_render(unit) -> None:
    """Texts past a part (``max(4 * max_model_len, PART_CHARS)`` characters) are counted part by part
    (`tokens_at_least`; these make more than 4 characters a token, so a second part counts): a chat of exactly
    max_model_len rendered tokens passes, one of twice that many is refused."""
    text = unit * (PART_CHARS * 11 // 5 // len(unit))
    chat = [{"role": "user", "content": text}, {"role": "assistant", "content": [text[:999], {"type": "text",
                                                                                              "text": unit * 9}]}]
    tokens = rendered_tokens(chat, None)
    assert refusal(chat, tokens, 0, None, False) is None
    check_refusal(refusal(chat, tokens // 2, 0, POOLING, False), tokens // 2, POOLING)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_more_messages_than_max_model_len_render_past_it(template) -> None:
    """Each template writes a token a message at least: 9 one-letter messages, refused at 8, render past 8."""
    chat = [{"role": "user", "content": "a"}] * 9
    assert refusal(chat[:8], 8, 10**6, None, False) is None
    assert rendered_tokens(chat, TEMPLATES[template]) > 8
    check_refusal(refusal(chat, 8, 10**6, None, False), 8, None)
