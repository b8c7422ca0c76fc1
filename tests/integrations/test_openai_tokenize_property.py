"""Property: ``/tokenize`` and ``/detokenize`` agree exactly with the tokenizer, and with what the engine runs.

vLLM's routes (integrations/openai_tokenize.py; docs/integrations/openai-server.md) are how clients count and
inspect a prompt before sending it, so they must give exactly the ids a completion or a chat completion runs.
The reference model is the bundled tokenizer used directly (transformers' ``encode``, ``apply_chat_template``,
``convert_ids_to_tokens``, ``decode``) plus the documented defaults, never the module under test:

1. ``{"prompt": text}``: ``tokens == encode(text, add_special_tokens=flag)`` with the flag's default true (an explicit
   null too); ``count == len(tokens)``; ``max_model_len`` is the engine's; ``token_strs`` is
   ``convert_ids_to_tokens(tokens)`` when ``return_token_strs`` is true, else null. Drawn text: unicode, whitespace,
   the template's special-token strings, empty.
2. ``{"messages": [...]}``: the chat template rendered to text (``add_generation_prompt`` default true,
   ``continue_final_message``, ``chat_template_kwargs`` winning over the request's fields as vLLM's, tools dumped as
   vLLM's ``model_dump``: ``type``, then ``function`` with ``name``, ``description``, ``parameters``), a content
   list's text parts joined with ``"\\n"``, then encoded with ``add_special_tokens`` (default false for chat).
3. The central property: a completion (``max_tokens`` 1, ``return_token_ids``) of the same prompt with the same
   flag runs exactly those ids (``prompt_token_ids`` and ``usage.prompt_tokens``); an empty id list is a 400
   (vLLM's empty decoder prompt). The same for chat messages and ``/v1/chat/completions``.
4. ``/detokenize`` of ids in the vocabulary is ``decode(ids)`` (special tokens kept, as the docs say); one id past
   the vocabulary or negative makes it a 400 naming ``tokens``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asgi_helpers import asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "50"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
MISSING = object()  # a field left out of the body

# ---------------------------------------------------------------- drawn values
PIECE = st.one_of(st.text(max_size=12), st.sampled_from(SPECIALS),
                  st.sampled_from(["", " ", "  \n\t ", "\n\n", "é 中文 🙂", "\x00", "hello world", " x ", "\u00a0"]))
TEXT = st.lists(PIECE, max_size=4).map("".join)
FLAG = st.sampled_from([MISSING, None, True, False])  # nullable bool fields
BOOL = st.sampled_from([MISSING, True, False])  # plain bool fields (null is a 400)
PART = st.one_of(TEXT, TEXT.map(lambda text: {"type": "text", "text": text}))  # vLLM takes both forms
CONTENT = st.one_of(TEXT, st.lists(PART, min_size=1, max_size=3))  # a string or text parts
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": CONTENT})
NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
PARAMETERS = st.sampled_from([{"type": "object", "properties": {"x": {"type": "integer"}}},
                              {"type": "object", "properties": {}}])
FUNCTION = st.fixed_dictionaries({"name": NAME}, optional={"description": TEXT, "parameters": PARAMETERS})
TOOL = st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION}),
                 st.fixed_dictionaries({"function": FUNCTION}))
KWARGS = st.sampled_from([MISSING, {}, {"unused_variable": "x"}, {"add_generation_prompt": False},
                          {"add_generation_prompt": True}])


def _body(**fields: Any) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not MISSING}


# ---------------------------------------------------------------- the reference model
def expected_prompt_ids(tokenizer, text: str, flag: Any) -> list[int]:
    """A prompt's ids: the tokenizer's special tokens unless ``add_special_tokens`` is false (default true)."""
    return tokenizer.encode(text, add_special_tokens=flag is not False)


def _joined(content: Any) -> str:
    """The ``string`` content format: text parts joined with a newline, as vLLM's."""
    if isinstance(content, str):
        return content
    return "\n".join(part if isinstance(part, str) else part["text"] for part in content)


def _dumped(tool: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``ChatCompletionToolsParam(**tool).model_dump()`` for the drawn tools (no extra keys)."""
    function = tool["function"]
    return {"type": "function", "function": {"name": function["name"], "description": function.get("description"),
                                             "parameters": function.get("parameters")}}


def chat_flags(agp: Any, cfm: Any, kwargs: Any) -> tuple[bool, bool]:
    """The effective ``add_generation_prompt`` and ``continue_final_message``: the template kwargs win (vLLM's)."""
    kwargs = {} if kwargs is MISSING else kwargs
    return (kwargs.get("add_generation_prompt", agp is not False),
            kwargs.get("continue_final_message", cfm is True))


def expected_chat_ids(tokenizer, messages: list[dict], agp: Any, cfm: Any, special: Any, tools: Any,
                      kwargs: Any) -> list[int]:
    """The rendered chat text, then encoded with ``add_special_tokens`` (default false for chat)."""
    generation, cont = chat_flags(agp, cfm, kwargs)
    extra = {} if kwargs is MISSING else {k: v for k, v in kwargs.items() if k != "add_generation_prompt"}
    plain = [{"role": m["role"], "content": _joined(m["content"])} for m in messages]
    text = tokenizer.apply_chat_template(plain, tools=None if tools is MISSING else [_dumped(t) for t in tools],
                                         add_generation_prompt=generation, continue_final_message=cont,
                                         tokenize=False, **extra)
    return tokenizer.encode(text, add_special_tokens=special is True)


# ---------------------------------------------------------------- checks
def check_tokenized(reply: dict, ids: list[int], strs: Any, tokenizer, max_model_len: int) -> None:
    assert reply["tokens"] == ids and all(type(t) is int for t in reply["tokens"])
    assert reply["count"] == len(reply["tokens"]) == len(ids)
    assert reply["max_model_len"] == max_model_len
    assert reply["token_strs"] == (tokenizer.convert_ids_to_tokens(ids) if strs is True else None)


async def check_detokenize(client, ids: list[int], tokenizer) -> None:
    reply = await client.post("/detokenize", json={"tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": tokenizer.decode(ids)}


async def check_runs(client, path: str, body: dict, ids: list[int], choice: bool) -> None:
    """The engine runs exactly ``ids`` for the same request (greedy, 1 token); no ids: a 400."""
    reply = await client.post(path, json={**body, "max_tokens": 1, "temperature": 0, "return_token_ids": True})
    if not ids:
        assert reply.status_code == 400, reply.text
        return
    assert reply.status_code == 200, reply.text
    data = reply.json()
    run = data["choices"][0]["prompt_token_ids"] if choice else data["prompt_token_ids"]
    assert run == ids
    assert data["usage"]["prompt_tokens"] == len(ids)


# ---------------------------------------------------------------- properties
@SETTINGS
@given(text=TEXT, special=FLAG, strs=FLAG)
@example(text="", special=MISSING, strs=True)  # BOS alone
@example(text="", special=False, strs=MISSING)  # no ids at all: the completion is a 400
@example(text="<|bos|><|eos|>hi", special=True, strs=True)  # special-token strings are the special ids
@example(text="  \n\t ", special=None, strs=None)  # explicit nulls are the defaults
@example(text="é 中文 🙂\x00", special=False, strs=True)
async def test_tokenize_prompt_is_the_tokenizer_and_the_completion(app, bundled_engine, bundled_tokenizer, text,
                                                                    special, strs) -> None:
    ids = expected_prompt_ids(bundled_tokenizer, text, special)
    async with asgi_client(app) as client:
        reply = await client.post("/tokenize", json=_body(prompt=text, add_special_tokens=special,
                                                          return_token_strs=strs))
        assert reply.status_code == 200, reply.text
        check_tokenized(reply.json(), ids, strs, bundled_tokenizer, bundled_engine.config.max_model_len)
        await check_detokenize(client, ids, bundled_tokenizer)
        await check_runs(client, "/v1/completions", _body(prompt=text, add_special_tokens=special), ids, True)


@st.composite
def chats(draw) -> dict[str, Any]:
    """A chat /tokenize body's fields; `continue_final_message` only where it may be (no generation prompt)."""
    fields = {"messages": draw(st.lists(MESSAGE, min_size=1, max_size=3)), "add_special_tokens": draw(FLAG),
              "tools": draw(st.one_of(st.just(MISSING), st.lists(TOOL, min_size=1, max_size=2))),
              "chat_template_kwargs": draw(KWARGS), "add_generation_prompt": draw(BOOL),
              "continue_final_message": draw(BOOL), "return_token_strs": draw(FLAG)}
    if fields["continue_final_message"] is True and (fields["add_generation_prompt"] is not False or chat_flags(
            False, True, fields["chat_template_kwargs"])[0]):  # a 400 here and in vLLM: not this property
        fields["continue_final_message"] = MISSING
    return fields


HI = [{"role": "user", "content": "hi"}]


@SETTINGS
@given(fields=chats())
@example(fields={"messages": HI, "add_special_tokens": MISSING, "tools": MISSING, "chat_template_kwargs": MISSING,
                 "add_generation_prompt": MISSING, "continue_final_message": MISSING, "return_token_strs": True})
@example(fields={"messages": HI, "add_special_tokens": True, "tools": MISSING, "chat_template_kwargs": MISSING,
                 "add_generation_prompt": False, "continue_final_message": True, "return_token_strs": MISSING})
@example(fields={"messages": [{"role": "system", "content": ["a", {"type": "text", "text": "b"}]},
                              {"role": "assistant", "content": "Sure, "}],
                 "add_special_tokens": None, "tools": [{"function": {"name": "f"}}], "return_token_strs": None,
                 "chat_template_kwargs": {"add_generation_prompt": False}, "add_generation_prompt": True,
                 "continue_final_message": MISSING})
@example(fields={"messages": [{"role": "user", "content": "hi <|eos|>"}], "add_special_tokens": MISSING,
                 "tools": MISSING, "chat_template_kwargs": MISSING, "add_generation_prompt": False,
                 "continue_final_message": True, "return_token_strs": MISSING})  # the template's EOS in the text
@example(fields={"messages": [{"role": "assistant", "content": ["", " \n"]}], "add_special_tokens": MISSING,
                 "tools": MISSING, "chat_template_kwargs": {"unused_variable": "x"}, "add_generation_prompt": False,
                 "continue_final_message": True, "return_token_strs": MISSING})  # whitespace continued
async def test_tokenize_messages_is_the_template_and_the_chat(app, bundled_engine, bundled_tokenizer,
                                                              fields) -> None:
    ids = expected_chat_ids(bundled_tokenizer, fields["messages"], fields["add_generation_prompt"],
                            fields["continue_final_message"], fields["add_special_tokens"], fields["tools"],
                            fields["chat_template_kwargs"])
    async with asgi_client(app) as client:
        reply = await client.post("/tokenize", json=_body(**fields))
        assert reply.status_code == 200, reply.text
        check_tokenized(reply.json(), ids, fields["return_token_strs"], bundled_tokenizer,
                        bundled_engine.config.max_model_len)
        chat = _body(**{**fields, "return_token_strs": MISSING})
        if "tools" in chat:
            chat["tool_choice"] = "none"  # the tools still reach the template (vLLM's default)
        await check_runs(client, "/v1/chat/completions", chat, ids, False)


BAD_ID = st.one_of(st.integers(-(2**31), -1), st.integers(4096, 2**31), st.sampled_from([-1, 4096, 4097]))


@SETTINGS
@given(ids=st.lists(st.integers(0, 4095), max_size=6), bad=st.none() | BAD_ID, at=st.integers(0, 6))
@example(ids=[], bad=None, at=0)
@example(ids=[0, 1, 2, 3, 4, 5], bad=None, at=0)  # every special token kept
@example(ids=[10], bad=4096, at=1)
@example(ids=[10], bad=-1, at=0)
async def test_detokenize_is_decode_and_refuses_ids_past_the_vocabulary(app, bundled_engine, bundled_tokenizer,
                                                                       ids, bad, at) -> None:
    assert bundled_engine.vocab_size == len(bundled_tokenizer) == 4096  # no padded vocabulary here
    async with asgi_client(app) as client:
        if bad is None:
            await check_detokenize(client, ids, bundled_tokenizer)
            return
        reply = await client.post("/detokenize", json={"tokens": ids[:at] + [bad] + ids[at:]})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tokens"
