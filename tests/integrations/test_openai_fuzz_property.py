"""Property: bad input to the OpenAI-compatible server gets a typed 4xx naming what was wrong, never a 500.

Hypothesis draws a route (/v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /pooling,
/tokenize, /detokenize, /v1/score, /v1/rerank, /invocations), starts from its valid minimal body and changes one to
three fields to drawn values (wrong types, None, negative and huge ints, whole and fractional floats, NaN and
infinities as Python's json writes them, numeric strings, unknown enum strings, token ids past the vocabulary, long
strings, nested lists and dicts, shaped-but-wrong messages, tools, schemas), sometimes adds an unknown field (vLLM's
old ``guided_*`` among them) or drops a required one. The app runs over the shared bundled engine with
``ServerLimits(max_tokens=4, max_n=2, max_prompts=4)``, so that whatever is drawn generates at most 4 tokens for at
most 2 x 4 sequences (a larger valid value is a 400 naming its field). Rules checked for every response:

1. Never a 5xx, and the app never raises through the ASGI transport (which would be a dropped connection).
2. A 4xx is a 400, or a 404 for an unknown ``model`` or previous response, with the body ``{"error": {"message",
   "type", "param", "code"}}``: a non-empty message and type.
3. A 400's ``param`` names a field the draw changed (added, dropped or set). Naming rules (`_allowed_params`):
   an error inside a field (``messages[0].content``, ``stream_options.include_usage``, ``documents[1].text``) names
   the top-level field or a path under it (``response_format.name``: an unknown key); a body Python's json wrote
   NaN or Infinity into (or a lone surrogate) is not JSON:
   ``body`` (or a changed field before the bad token: the parser stops at the first fault); a prompt past
   max_model_len names vLLM's ``input_tokens`` with code ``context_length_exceeded`` (or the max-tokens field); two
   fields that go together (``prompt`` and ``prompt_embeds``, ``input`` and ``messages``, a score's ``text_1`` and
   ``text_2``: `Route.partners`) may be named by either; an /invocations body whose keys choose no route: ``body``;
   a 404 names ``model`` (``model_not_found``) or the Responses API's ``previous_response_id``
   (``response_not_found``).
4. A 200 of a non-streamed request has the route's documented shape (`SHAPES`).
5. A streamed request (``stream`` true) fails with a 4xx before streaming, or is a well-formed SSE stream: chat and
   completions chunks ending with ``data: [DONE]`` (an error after the first token is a ``data: {"error": ...}``
   event just before it); the Responses API's typed events from ``response.created`` to ``response.completed``,
   ``response.incomplete`` or an ``error`` event.

Afterwards (`test_engine_serves_after_the_fuzz`): /health is 200, a greedy completion equals the engine's own, and
the engine holds no request (stats and the Prometheus gauges: nothing running or waiting, no KV block in use).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from asyncllm import SamplingParams
from asyncllm.integrations.openai_protocol import ServerLimits
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client
from engine_helpers import wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
VOCAB = 4096  # the bundled tokenizer's ids are in [0, 4096)
LIMITS = ServerLimits(max_tokens=4, max_n=2, max_prompts=4)
CONTEXT_FIELDS = {"input_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens"}


@pytest.fixture(scope="module")
def fuzz_app(bundled_engine):
    """The app over the shared engine, bounded so that no drawn request generates more than 4 tokens x 8 sequences."""
    return create_app(bundled_engine, manage_engine=False, limits=LIMITS)


# ---------------------------------------------------------------- drawn values
HUGE = [2**31, 2**32 + 1, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**70)]
TEXT = st.one_of(st.text(max_size=8), st.sampled_from(["", " ", "x" * 3000, "<|eos|>", "{{ x }}", "\x00", "4",
                                                         "-1", "1e9", "true", "null", "bogus", "NaN"]))
NUMBER = st.one_of(st.integers(-3, 6), st.sampled_from(HUGE), st.floats(-3, 3),
                   st.sampled_from([0.5, -0.0, 1e-300, 1e308, -1e308, 4.0, 1e9]))
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
LEAF = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
JUNK = st.one_of(  # non-finite floats (the body no JSON) in one draw of 8
    LEAF, LEAF, LEAF, LEAF, LEAF, LEAF, NON_FINITE,
    st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=6),
)
TOKEN = st.one_of(st.integers(0, 60), st.sampled_from([-1, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**64]))
TOKENS = st.lists(TOKEN, max_size=4)
SCHEMA = st.one_of(
    st.just({"type": "object"}),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["object", "string", "integer", "array", "bogus"]), JUNK)},
                          optional={"properties": st.dictionaries(st.text(max_size=3), JUNK, max_size=2),
                                    "enum": st.lists(JUNK, max_size=2), "pattern": TEXT, "minLength": NUMBER,
                                    "items": JUNK, "$ref": TEXT}),
    JUNK,
)
TOOL = st.one_of(st.fixed_dictionaries({
    "type": st.one_of(st.just("function"), JUNK),
    "function": st.one_of(st.fixed_dictionaries({"name": st.one_of(st.just("f"), TEXT, JUNK)},
                                                optional={"parameters": SCHEMA, "description": JUNK,
                                                          "strict": JUNK}), JUNK)}), JUNK)
PART = st.one_of(st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "image_url", "input_audio", "video_url", "audio_url", "refusal",
                                        "input_text", "bogus"]), JUNK)},
    optional={"text": st.one_of(TEXT, JUNK), "image_url": st.one_of(st.fixed_dictionaries({"url": TEXT}), JUNK),
              "input_audio": JUNK}), JUNK)
TOOL_CALL = st.fixed_dictionaries({"id": st.one_of(TEXT, JUNK), "type": st.one_of(st.just("function"), JUNK),
                                   "function": st.one_of(st.fixed_dictionaries({"name": TEXT, "arguments": TEXT}),
                                                         JUNK)})
MESSAGE = st.one_of(st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus"]), JUNK),
    "content": st.one_of(TEXT, st.lists(PART, max_size=2), JUNK), "name": JUNK,
    "tool_calls": st.one_of(st.lists(TOOL_CALL, max_size=2), JUNK), "tool_call_id": JUNK}), JUNK)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=3), JUNK)
PROMPT = st.one_of(TEXT, st.lists(TEXT, max_size=5), TOKENS, st.lists(TOKENS, max_size=3),
                   st.lists(st.one_of(TEXT, TOKENS), max_size=3), JUNK)
ENUM = st.one_of(st.sampled_from(["bogus", "", "auto", "none", "required", "text", "json_object", "json_schema",
                                  "float", "base64", "bytes", "float16", "bfloat16", "big", "little", "embed",
                                  "classify", "token_embed", "low", "high", "default", "flex", "disabled"]), JUNK)
FORMAT = st.one_of(st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "json_object", "json_schema", "regex", "bogus"]), JUNK)},
    optional={"json_schema": st.one_of(st.fixed_dictionaries({"name": TEXT}, optional={"schema": SCHEMA,
                                                                                        "strict": JUNK}), JUNK),
              "schema": SCHEMA, "name": TEXT}), JUNK)
STRUCTURED = st.one_of(st.dictionaries(
    st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
                     "whitespace_pattern", "bogus"]),
    st.one_of(SCHEMA, TEXT, st.lists(TEXT, max_size=2), st.sampled_from(["[a-z]+", "(", "root ::= \"a\"", "x{2,"])),
    max_size=2), JUNK)
DICT = st.one_of(st.dictionaries(st.one_of(st.sampled_from(["enable_thinking", "add_generation_prompt", "messages",
                                                            "tools", "bos_token", "reasoning_effort", "include_usage",
                                                            "continuous_usage_stats", "include_obfuscation",
                                                            "format", "effort", "type"]), st.text(max_size=70)),
                                 JUNK, max_size=3), JUNK)
LOGIT_BIAS = st.one_of(st.dictionaries(st.one_of(st.sampled_from(["0", "5", "-1", "4095", "4096", "99999", "abc", ""]),
                                                 st.text(max_size=3)), NUMBER, min_size=1, max_size=3), JUNK)

EDGES: dict[str, st.SearchStrategy] = {  # a field's shaped values; every field draws `JUNK` too
    "prompt": PROMPT, "input": st.one_of(PROMPT, st.lists(MESSAGE, max_size=2)), "messages": MESSAGES,
    "tokens": TOKENS, "stop_token_ids": TOKENS, "allowed_token_ids": TOKENS, "documents": st.lists(
        st.one_of(TEXT, st.fixed_dictionaries({"text": st.one_of(TEXT, JUNK)})), max_size=5),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)), "bad_words": st.lists(TEXT, max_size=3),
    "logit_bias": LOGIT_BIAS, "tools": st.one_of(st.lists(TOOL, max_size=2), JUNK),
    "tool_choice": st.one_of(ENUM, st.fixed_dictionaries({"type": st.one_of(st.just("function"), JUNK),
                                                          "function": st.one_of(st.fixed_dictionaries({"name": TEXT}),
                                                                                JUNK)})),
    "response_format": FORMAT, "text": st.one_of(st.fixed_dictionaries({"format": FORMAT}), DICT),
    "structured_outputs": STRUCTURED, "stream_options": DICT, "chat_template_kwargs": DICT, "metadata": DICT,
    "reasoning": DICT, "mm_processor_kwargs": DICT, "prediction": DICT, "web_search_options": DICT,
}
for _name in ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "seed", "min_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens",
              "logprobs", "top_logprobs", "prompt_logprobs", "best_of", "priority", "truncate_prompt_tokens",
              "length_penalty", "dimensions", "top_n", "max_tool_calls"):
    EDGES[_name] = NUMBER
for _name in ("model", "user", "suffix", "cache_salt", "request_id", "chat_template", "instructions", "query",
              "text_1", "text_2", "previous_response_id", "prompt_cache_key", "safety_identifier"):
    EDGES[_name] = st.one_of(TEXT, st.sampled_from([MODEL, "", "a", "x" * 2000]))
for _name in ("encoding_format", "embed_dtype", "endianness", "task", "reasoning_effort", "service_tier",
              "verbosity", "truncation", "modalities", "include"):
    EDGES[_name] = st.one_of(ENUM, st.lists(ENUM, max_size=2))


def _value(name: str, wild: bool) -> st.SearchStrategy:
    """A drawn value for the field `name`: shaped for it (`EDGES`, booleans for the rest); when `wild`, anything
    (`JUNK`) one time in three."""
    shaped = EDGES.get(name, st.booleans())
    return st.one_of(shaped, shaped, JUNK) if wild else shaped


# ---------------------------------------------------------------- routes
SAMPLING = ["model", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words",
            "min_tokens", "ignore_eos", "max_tokens", "stream", "stream_options", "prompt_logprobs",
            "structured_outputs", "response_format", "truncate_prompt_tokens", "skip_special_tokens",
            "include_stop_str_in_output", "priority", "cache_salt", "request_id", "use_beam_search", "length_penalty",
            "return_token_ids", "add_special_tokens", "user", "spaces_between_special_tokens",
            "return_tokens_as_token_ids"]
POOLING = ["model", "input", "messages", "user", "truncate_prompt_tokens", "priority", "cache_salt", "request_id",
           "add_special_tokens", "encoding_format", "embed_dtype", "endianness", "dimensions", "normalize",
           "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template",
           "mm_processor_kwargs"]
SCORING = ["model", "user", "request_id", "truncate_prompt_tokens", "priority", "cache_salt", "use_activation",
           "softmax", "activation"]


@dataclass(frozen=True)
class Route:
    path: str
    base: dict[str, Any]
    """A valid minimal body."""
    fields: list[str]
    """The fields a draw may set."""
    required: tuple[str, ...] = ()
    """The fields a draw may drop."""
    partners: dict[str, str] = field(default_factory=dict)
    """Fields checked together (one excludes the other, or counts must match): an error of one changed may name
    the other."""


ROUTES = [
    Route("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
          [*SAMPLING, "prompt", "echo", "best_of", "suffix", "logprobs", "prompt_embeds"], ("prompt",),
          {"prompt_embeds": "prompt"}),
    Route("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
          [*SAMPLING, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
           "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
           "chat_template", "reasoning_effort", "echo", "include_reasoning", "metadata", "service_tier", "store",
           "modalities", "verbosity", "prediction", "web_search_options", "mm_processor_kwargs"], ("messages",)),
    Route("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
          ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
           "tool_choice", "text", "store", "metadata", "previous_response_id", "background", "include", "truncation",
           "reasoning", "service_tier", "seed", "top_k", "min_p", "repetition_penalty", "priority", "stop",
           "logit_bias", "top_logprobs", "max_tool_calls", "structured_outputs", "cache_salt", "request_id",
           "parallel_tool_calls", "chat_template_kwargs", "ignore_eos", "prompt_cache_key"], ("input",)),
    Route("/v1/embeddings", {"model": MODEL, "input": "Hello"}, POOLING, ("input",), {"messages": "input"}),
    Route("/pooling", {"model": MODEL, "input": "Hello"}, [*POOLING, "task", "use_activation", "softmax"], ("input",),
          {"messages": "input"}),
    Route("/tokenize", {"model": MODEL, "prompt": "Hello"},
          ["model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt",
           "continue_final_message", "chat_template_kwargs", "chat_template", "return_token_strs"], ("prompt",),
          {"messages": "prompt"}),
    Route("/detokenize", {"model": MODEL, "tokens": [5, 6]}, ["model", "tokens"], ("tokens",)),
    Route("/v1/score", {"model": MODEL, "text_1": "a", "text_2": "b"}, [*SCORING, "text_1", "text_2"],
          ("text_1", "text_2"), {"text_1": "text_2", "text_2": "text_1"}),
    Route("/v1/rerank", {"model": MODEL, "query": "a", "documents": ["b", "c"]},
          [*SCORING, "query", "documents", "top_n", "return_documents"], ("query", "documents")),
    Route("/invocations", {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
          ["model", "prompt", "max_tokens", "n", "temperature", "stream", "logprobs", "echo", "stop"], ("prompt",)),
]
BY_PATH = {route.path: route for route in ROUTES}
WEIGHTED = [*ROUTES, *ROUTES[:3], *ROUTES[:2]]
"""Routes as drawn: the generation routes, with four times the fields of the others, three (two) times as often."""
UNKNOWN = st.sampled_from(["guided_json", "guided_regex", "guided_choice", "guided_grammar", "bogus", "Prompt",
                           "max_token", "extra_body", "functions", "temprature"])


@dataclass(frozen=True)
class Draw:
    """One request: its route, its body, and the fields the draw changed (set, added or dropped)."""

    path: str
    body: dict[str, Any]
    changed: frozenset[str]

    def encoded(self) -> bytes:
        return json.dumps(self.body).encode()  # NaN and Infinity as Python writes them (not JSON)

    def is_json(self) -> bool:
        """Whether the body is JSON a strict parser reads: no NaN or infinity, no lone surrogate."""
        try:
            json.dumps(self.body, allow_nan=False, ensure_ascii=False).encode()
        except (ValueError, UnicodeEncodeError):
            return False
        return True


@st.composite
def draws(draw) -> Draw:
    """A route's valid body with one to three fields set to drawn values (half the draws shaped values only, which
    pass the type checks more often and reach the deeper ones), maybe an unknown field, maybe a required field
    dropped."""
    route, wild = draw(st.sampled_from(WEIGHTED)), draw(st.booleans())
    body, changed = dict(route.base), set()
    for name in draw(st.lists(st.sampled_from(route.fields), min_size=1, max_size=3, unique=True)):
        body[name] = draw(_value(name, wild))
        changed.add(name)
    if draw(st.integers(0, 9)) == 0:
        name = draw(UNKNOWN)
        body[name] = draw(_value(name, wild))
        changed.add(name)
    if draw(st.integers(0, 9)) == 0:
        name = draw(st.sampled_from(route.required))
        body.pop(name, None)
        changed.add(name)
    return Draw(route.path, body, frozenset(changed))


# ---------------------------------------------------------------- checks
def _allowed_params(case: Draw, error: dict[str, Any]) -> set[str]:
    """The names a 400 of `case` may give in ``param`` (the module docstring's rule 3)."""
    route = BY_PATH[case.path]
    allowed = set(case.changed) | {route.partners[name] for name in case.changed if name in route.partners}
    if not case.is_json():
        allowed.add("body")  # the parser stops at the first fault, in the body's order: the bad token or a field
    if error.get("code") == "context_length_exceeded":
        allowed |= CONTEXT_FIELDS
    if case.path == "/invocations" and not {"prompt", "messages", "input", "text_1", "query"} & set(case.body):
        allowed.add("body")  # no key chooses a route
    return allowed


def _check_error(case: Draw, status: int, payload: Any) -> None:
    """Rule 2 and 3: a typed OpenAI error body naming a changed field."""
    assert status in (400, 404), (status, payload)
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    if status == 404:  # an unknown model, or (Responses API) an unknown previous response
        assert (error["param"], error["code"]) in (("model", "model_not_found"),
                                                   ("previous_response_id", "response_not_found")), error
        assert error["param"] in case.changed, (error, sorted(case.changed))
        return
    assert error["type"] == "invalid_request_error", error
    top = re.split(r"[.\[]", error["param"], maxsplit=1)[0] if isinstance(error["param"], str) else error["param"]
    assert top in _allowed_params(case, error), (error, sorted(case.changed))


def _is_list_of(value: Any, keys: set[str]) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, dict) and keys <= set(x) for x in value)


def _usage(body: dict[str, Any]) -> bool:
    return isinstance(body.get("usage"), dict) and isinstance(body["usage"].get("prompt_tokens"), int)


SHAPES = {  # rule 4: a non-streamed 200's documented shape, by route
    "/v1/completions": lambda b: b["object"] == "text_completion" and _usage(b)
    and _is_list_of(b["choices"], {"index", "text", "finish_reason"}),
    "/v1/chat/completions": lambda b: b["object"] == "chat.completion" and _usage(b)
    and _is_list_of(b["choices"], {"index", "message", "finish_reason"}),
    "/v1/responses": lambda b: b["object"] == "response" and b["status"] in ("completed", "incomplete")
    and isinstance(b["output"], list),
    "/v1/embeddings": lambda b: b["object"] == "list" and _is_list_of(b["data"], {"index", "embedding"}) and _usage(b),
    "/pooling": lambda b: b["object"] == "list" and _is_list_of(b["data"], {"index", "data"}),
    "/tokenize": lambda b: b["count"] == len(b["tokens"]) and isinstance(b["max_model_len"], int),
    "/detokenize": lambda b: isinstance(b["prompt"], str),
    "/v1/score": lambda b: _is_list_of(b["data"], {"index", "score"}) and _usage(b),
    "/v1/rerank": lambda b: isinstance(b["results"], list) and _usage(b),
    "/invocations": lambda b: "error" not in b and ("choices" in b or "data" in b or "results" in b),
}


def _check_chunks_stream(text: str) -> None:
    """Rule 5, chat and completions: ``data: {...}`` chunks, an error event only last, then ``data: [DONE]``."""
    blocks = [block for block in text.split("\n\n") if block]
    assert blocks and blocks[-1] == "data: [DONE]", text[-300:]
    events = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        events.append(json.loads(block[len("data: "):]))
    for i, chunk in enumerate(events):
        if "error" in chunk:
            assert i == len(events) - 1 and chunk["error"]["message"], events
        else:
            assert isinstance(chunk["choices"], list), chunk


def _check_responses_stream(text: str) -> None:
    """Rule 5, the Responses API: ``event: T`` / ``data: {"type": T, ...}`` from response.created to its end."""
    kinds = []
    for block in (block for block in text.split("\n\n") if block):
        match = re.fullmatch(r"event: (\S+)\ndata: (.+)", block, re.DOTALL)
        assert match, block
        payload = json.loads(match.group(2))
        assert payload["type"] == match.group(1) and payload["sequence_number"] == len(kinds), payload
        kinds.append(payload["type"])
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete", "error"), kinds


async def _send(app, case: Draw) -> None:
    """Post `case` and check the answer against rules 1 to 5."""
    async with asgi_client(app) as client:
        try:
            response = await client.post(case.path, content=case.encoded(),
                                         headers={"content-type": "application/json"})
        except Exception as exc:  # noqa: BLE001 - the app raised: a dropped connection, not an answer
            raise AssertionError(f"the app raised {exc!r} for {case}") from exc
    event(f"{case.path} {response.status_code}")
    assert response.status_code < 500, (response.status_code, response.text[:500], case)
    if response.status_code != 200:
        _check_error(case, response.status_code, response.json())
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        check = _check_responses_stream if case.path == "/v1/responses" else _check_chunks_stream
        check(response.text)
        return
    assert case.body.get("stream") is not True, case  # asked for a stream, got JSON
    assert SHAPES[case.path](response.json()), response.text[:500]


# ---------------------------------------------------------------- the property
@settings(max_examples=1500, deadline=None,  # ~8 ms each; a 12000-example hunt passed (~95 s)
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=draws())
# Python's json writes NaN: not JSON, a 400 naming the body
@example(case=Draw("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": math.nan},
                   frozenset({"temperature"})))
# a token id past the vocabulary
@example(case=Draw("/v1/completions", {"model": MODEL, "prompt": [5, VOCAB], "max_tokens": 2}, frozenset({"prompt"})))
# a message's content of a wrong type: named by the top-level field
@example(case=Draw("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
                   frozenset({"messages"})))
# vLLM's removed guided_json is an unknown field, named
@example(case=Draw("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                            "guided_json": {"type": "object"}}, frozenset({"guided_json"})))
# the required messages dropped
@example(case=Draw("/v1/chat/completions", {"model": MODEL, "max_tokens": 2}, frozenset({"messages"})))
# a bad nested stream option on a stream: a 400 before streaming, named by its parent
@example(case=Draw("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stream": True,
                                       "stream_options": {"include_usage": 3}},
                   frozenset({"stream", "stream_options"})))
# a huge n, and a numeric string max_tokens past the server's limit
@example(case=Draw("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": "1000", "n": 2**70},
                   frozenset({"max_tokens", "n"})))
# a valid streamed chat: well-formed SSE ending with [DONE]
@example(case=Draw("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 2, "stream": True, "n": 2}, frozenset({"stream", "n"})))
# a valid streamed response (the Responses API's typed events)
@example(case=Draw("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True},
                   frozenset({"stream"})))
# a prompt past max_model_len: vLLM's input_tokens, context_length_exceeded
@example(case=Draw("/v1/completions", {"model": MODEL, "prompt": "x " * 3000, "max_tokens": 2}, frozenset({"prompt"})))
# a bool where a number is expected, and a lone surrogate (not UTF-8: the body)
@example(case=Draw("/v1/embeddings", {"model": MODEL, "input": "Hello", "dimensions": True}, frozenset({"dimensions"})))
@example(case=Draw("/tokenize", {"model": MODEL, "prompt": "\ud800"}, frozenset({"prompt"})))
# token ids past the vocabulary and past int64
@example(case=Draw("/detokenize", {"model": MODEL, "tokens": [2**64]}, frozenset({"tokens"})))
# vLLM's older name of use_activation, refused on a bi-encoder: named as the client wrote it (was use_activation)
@example(case=Draw("/v1/score", {"model": MODEL, "text_1": "a", "text_2": "b", "softmax": False},
                   frozenset({"softmax"})))
@example(case=Draw("/v1/rerank", {"model": MODEL, "query": "a", "documents": ["b"], "activation": False},
                   frozenset({"activation"})))
# an unknown key inside a field is named by its path (response_format.name), as OpenAI's do
@example(case=Draw("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                       "response_format": {"type": "text", "name": ""}},
                   frozenset({"response_format"})))
# an unknown model is a 404 naming model
@example(case=Draw("/v1/rerank", {"model": "gpt-4", "query": "a", "documents": ["b"]}, frozenset({"model"})))
async def test_bad_input_gets_a_typed_4xx_naming_the_field(fuzz_app, case: Draw) -> None:
    """Every drawn request is answered by rules 1 to 5 of the module docstring."""
    await _send(fuzz_app, case)


async def test_engine_serves_after_the_fuzz(fuzz_app, bundled_engine) -> None:
    """After the fuzz the engine is healthy, serves a greedy completion exactly, and holds no request."""
    expected = await bundled_engine.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=4))
    async with asgi_client(fuzz_app) as client:
        health = await client.get("/health")
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "def add(a, b):",
                                                            "temperature": 0, "max_tokens": 4})
        await wait_idle(bundled_engine)
        metrics = (await client.get("/metrics")).text
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected.text
    stats = bundled_engine.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting, stats.num_used_blocks) == (0, 0, 0), stats
    assert stats.engine_alive
    for gauge in ("asyncllm:num_requests_running", "asyncllm:num_requests_waiting"):
        values = re.findall(rf"^{gauge}{{[^}}]*}} (\S+)$", metrics, re.MULTILINE)
        assert values and all(float(v) == 0 for v in values), (gauge, values)
