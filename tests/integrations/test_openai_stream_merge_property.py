"""Property: a streamed completion or chat completion, merged, is the same request's non-streamed body.

Hypothesis draws a /v1/completions request (a prompt or a list of 1-3 prompts, text or token ids; ``n`` 1-2;
``echo``; ``logprobs`` 0-2; ``max_tokens`` 1-4, or 0 with ``echo``; ``stop`` strings) or a /v1/chat/completions
request (``n``; ``logprobs`` with ``top_logprobs`` 0-2; ``max_tokens`` or ``max_completion_tokens`` 1-4; ``stop``;
vLLM's chat ``echo`` of a last assistant message), greedy (temperature 0) or sampled with a drawn ``seed`` at
temperature 1, so that both runs give the same tokens; and the stream's ``stream_options`` (left out, ``{}``,
``include_usage`` true, false or null, ``continuous_usage_stats``). The app runs over the shared bundled engine with
``ServerLimits(max_tokens=4, max_n=2, max_prompts=6)``. The same request is posted without ``stream`` and with it
(`integrations/openai_streaming.py`, `integrations/openai_responses.py`); the rules (`_check_stream`):

1. The stream is ``data:`` chunks ending with ``data: [DONE]``; every chunk has one ``id``, ``created`` and
   ``model``, the object ``text_completion`` (``chat.completion.chunk``); a chunk of choices has exactly one, whose
   ``index`` is a choice's of the request (prompt index * n + sample index), and each choice index appears.
2. Merged per choice ``index``, the stream equals the body: text (``delta.content``, after the role chunk's role)
   concatenated; logprobs entries concatenated (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``;
   chat's ``content``; logprobs equal to 1e-4: the two runs agree to ~1e-6, not bit for bit); one chunk of a choice,
   its last, has its ``finish_reason`` (and vLLM's ``stop_reason``), the body's.
3. Completions' ``echo``: each choice's first chunk is its prompt's text (a token-id prompt's decoded text) and, with
   ``logprobs``, the prompt's logprobs (one entry per prompt token, the first ``null``), as the body's choice starts.
4. Usage: without ``stream_options`` (or ``include_usage`` false or null) no chunk has a ``usage`` key; else every
   chunk's ``usage`` is null, or with ``continuous_usage_stats`` its choice's prompt's tokens and that choice's
   completion tokens so far (0 in role and echo chunks; with logprobs, each chunk adds its logprob entries), and a
   last chunk of no choices has the body's usage. The body's ``prompt_tokens`` counts each prompt's tokens once,
   whatever ``n``; a choice that finished by ``length`` generated ``max_tokens`` tokens.

Fixed examples of these paths are in test_openai_echo.py, test_openai_vllm_parity.py and test_openai_asgi.py; this
module draws their combinations.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from asyncllm.integrations.openai_protocol import ServerLimits
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
LIMITS = ServerLimits(max_tokens=4, max_n=2, max_prompts=6)
TOLERANCE = 1e-4
"""Logprobs of the streamed and the non-streamed run agree to about 1e-6 on the CPU, not bit for bit."""


@pytest.fixture(scope="module")
def merge_app(bundled_engine):
    """The app over the shared engine, bounded: at most 4 tokens for each of at most 3 prompts x n = 2."""
    return create_app(bundled_engine, manage_engine=False, limits=LIMITS)


# ---------------------------------------------------------------- drawn requests
TEXTS = ["Hello", "def add(a, b):", "x", "The quick brown fox", "1, 2, 3,", "import os\n"]
ID_PROMPTS = [[9, 5, 6, 7], [300, 12], [42], [1000, 2000, 17]]
STOPS = [" ", "\n", "e", "0", "=", ",", " =", ", ", "00", " '", "\n\n", "zq"]
"""Stop strings: the random bundled model writes the first few often (a stop after one token, or mid-reply); text
that may begin one of several characters is held back (a token's chunk of no text, its logprobs only) until the
next token tells."""
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
STREAM_OPTIONS = [None, {"include_usage": False}, {"include_usage": None},  # no usage
                  {"include_usage": False, "continuous_usage_stats": True},
                  {}, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": False},  # the last
                  CONTINUOUS, CONTINUOUS, {"continuous_usage_stats": True}, {"continuous_usage_stats": True}]
"""Drawn alike: a third no usage, a third the usage chunk, a third continuous usage too."""


@dataclass(frozen=True)
class Case:
    path: str
    body: dict[str, Any]
    """The non-streamed request."""
    stream_options: dict[str, Any] | None
    """The streamed request's ``stream_options`` (None: left out)."""

    @property
    def chat(self) -> bool:
        return self.path == "/v1/chat/completions"

    def prompts(self) -> list[str | list[int]]:
        """Completions: the request's prompts as a list."""
        prompt = self.body["prompt"]
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def num_choices(self) -> int:
        return (1 if self.chat else len(self.prompts())) * self.body.get("n", 1)

    def usage_mode(self) -> str:
        """The docs': "none", "last" or "continuous" (``include_usage`` left out is true, null false)."""
        options = self.stream_options
        if options is None or not options.get("include_usage", True):
            return "none"
        return "continuous" if options.get("continuous_usage_stats") else "last"

    def wants_logprobs(self) -> bool:
        return bool(self.body.get("logprobs")) if self.chat else self.body.get("logprobs") is not None

    def max_tokens(self) -> int:
        return self.body.get("max_tokens", self.body.get("max_completion_tokens"))


def _sampling(draw) -> dict[str, Any]:
    """Greedy, or seeded sampling at temperature 1 (reproducible between the two runs)."""
    if draw(st.booleans()):
        return {"temperature": 0}
    return {"temperature": 1.0, "seed": draw(st.integers(0, 2**16))}


def _stop(draw) -> dict[str, Any]:
    choice = draw(st.integers(0, 2))
    if choice == 0:
        return {}
    if choice == 1:
        return {"stop": draw(st.sampled_from(STOPS))}
    return {"stop": draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=2, unique=True))}


@st.composite
def completions(draw) -> Case:
    if draw(st.booleans()):
        prompts = draw(st.lists(st.sampled_from(TEXTS), min_size=1, max_size=3))
    else:
        prompts = draw(st.lists(st.sampled_from(ID_PROMPTS), min_size=1, max_size=3))
    prompt = prompts[0] if len(prompts) == 1 and draw(st.booleans()) else prompts  # one prompt, or a list of one
    echo = draw(st.booleans())
    max_tokens = draw(st.integers(0 if echo else 1, 4))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "n": draw(st.integers(1, 2)),
            **_sampling(draw)}
    body.update(_stop(draw))  # echo alone (max_tokens 0): its one sampled token, dropped, may stop it
    if echo or draw(st.booleans()):
        body["echo"] = echo
    logprobs = draw(st.one_of(st.none(), st.integers(0, 2)))
    if logprobs is not None:
        body["logprobs"] = logprobs
    return Case("/v1/completions", body, draw(st.sampled_from(STREAM_OPTIONS)))


@st.composite
def chats(draw) -> Case:
    messages = [{"role": "user", "content": draw(st.sampled_from(TEXTS))}]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "n": draw(st.integers(1, 2)), **_sampling(draw),
                            **_stop(draw)}
    body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(st.integers(1, 4))
    if draw(st.booleans()):  # vLLM's echo: the last assistant message starts the reply's content
        messages.append({"role": "assistant", "content": draw(st.sampled_from(["Sure", "x = "]))})
        body.update(echo=True, add_generation_prompt=False)
    if draw(st.booleans()):
        body["logprobs"] = True
        top = draw(st.one_of(st.none(), st.integers(0, 2)))
        if top is not None:
            body["top_logprobs"] = top
    return Case("/v1/chat/completions", body, draw(st.sampled_from(STREAM_OPTIONS)))


# ---------------------------------------------------------------- merging and comparing
def _events(text: str) -> list[dict[str, Any]]:
    """The chunks of an SSE body, which must be ``data:`` events ending with ``data: [DONE]``."""
    blocks = [block for block in text.split("\n\n") if block]
    assert blocks and blocks[-1] == "data: [DONE]", text[-500:]
    assert all(block.startswith("data: {") for block in blocks[:-1]), text[:500]
    events = [json.loads(block[len("data: "):]) for block in blocks[:-1]]
    assert all("error" not in event for event in events), events
    return events


def _close(got: Any, want: Any, where: str = "") -> None:
    """`got` equals `want`, floats to `TOLERANCE` (dict keys, ints, strings and None exactly)."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, (int, float)) and isinstance(want, (int, float)), (where, got, want)
        assert math.isclose(got, want, rel_tol=TOLERANCE, abs_tol=TOLERANCE), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, got, want)
        for key in want:
            _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def _join_logprobs(parts: list[dict[str, Any] | None], chat: bool) -> dict[str, Any] | None:
    """A choice's chunks' logprobs, entries concatenated (None when no chunk had any)."""
    parts = [part for part in parts if part is not None]
    if not parts:
        return None
    keys = ["content"] if chat else ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    for part in parts:
        assert set(part) == set(keys), part
    return {key: [entry for part in parts for entry in part[key]] for key in keys}


def _merge(case: Case, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The choices of `chunks` merged per index by the module docstring's rule 2, in index order."""
    by_index: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk["index"], []).append(chunk)
    merged = []
    for index in sorted(by_index):
        parts = by_index[index]
        finishing = [i for i, part in enumerate(parts) if part["finish_reason"] is not None]
        assert finishing == [len(parts) - 1], (index, parts)  # one finishing chunk, the choice's last
        last = parts[-1]
        for part in parts[:-1]:
            assert part.get("stop_reason") is None, part
        logprobs = _join_logprobs([part["logprobs"] for part in parts], case.chat)
        choice: dict[str, Any] = {"index": index}
        if case.chat:
            opening = parts[0]["delta"]
            assert set(opening) == {"role", "content"} and opening["content"] == "", parts[0]
            for part in parts[1:]:
                assert set(part["delta"]) <= {"content"}, part
            content = "".join(part["delta"].get("content") or "" for part in parts)
            choice["message"] = {"role": opening["role"], "content": content}
        else:
            choice["text"] = "".join(part["text"] for part in parts)
        choice.update(logprobs=logprobs, finish_reason=last["finish_reason"], stop_reason=last["stop_reason"])
        merged.append(choice)
    return merged


def _prompt_tokens(case: Case, tokenizer) -> list[int]:
    """Completions: each prompt's token count (text tokenized as the server does, with its special tokens)."""
    return [len(p) if isinstance(p, list) else len(tokenizer(p).input_ids) for p in case.prompts()]


def _check_body(case: Case, body: dict[str, Any], tokenizer) -> None:
    """The non-streamed body's usage, by independent counts."""
    n, max_tokens = case.body.get("n", 1), case.max_tokens()
    assert [c["index"] for c in body["choices"]] == list(range(case.num_choices())), body
    if not case.chat:  # each prompt counted once, whatever n
        assert body["usage"]["prompt_tokens"] == sum(_prompt_tokens(case, tokenizer)), (body["usage"], case)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert usage["completion_tokens"] <= max_tokens * case.num_choices(), usage
    if case.wants_logprobs():  # one entry per generated token (after an echoed prompt's)
        echoed = [0] * case.num_choices()
        if not case.chat and case.body.get("echo"):
            echoed = [count for count in _prompt_tokens(case, tokenizer) for _ in range(n)]
        entries = [len(c["logprobs"]["content" if case.chat else "tokens"]) - echoed[c["index"]]
                   for c in body["choices"]]
        assert sum(entries) == usage["completion_tokens"], (entries, usage)
        for choice, count in zip(body["choices"], entries):
            if choice["finish_reason"] == "length" and max_tokens:
                assert count == max_tokens, (choice, count)
    if not case.chat and case.wants_logprobs():
        for choice in body["choices"]:  # offsets: each token's text starts where the one before ends
            offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
            assert offsets[:1] in ([], [0]), choice
            assert all(offsets[i + 1] == offsets[i] + len(tokens[i]) for i in range(len(tokens) - 1)), choice


def _check_usage(case: Case, events: list[dict[str, Any]], body: dict[str, Any], openings: set[int],
                 tokenizer) -> None:
    """Rule 4 of the module docstring; `openings`: the positions of role and echo chunks (no token yet)."""
    mode = case.usage_mode()
    if mode == "none":
        assert all("usage" not in event for event in events), events
        return
    final = events[-1]
    assert final["choices"] == [] and final["usage"] == body["usage"], (final, body["usage"])
    chunks = events[:-1]
    if mode == "last":
        assert all(event["usage"] is None for event in chunks), chunks
        return
    n = case.body.get("n", 1)
    prompt_tokens = ([body["usage"]["prompt_tokens"]] if case.chat else _prompt_tokens(case, tokenizer))
    so_far: dict[int, int] = {}
    for position, item in enumerate(chunks):
        [choice] = item["choices"]
        index, usage = choice["index"], item["usage"]
        before = so_far.get(index, 0)
        assert usage["prompt_tokens"] == prompt_tokens[index // n], (item, prompt_tokens)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
        if position in openings:
            assert usage["completion_tokens"] == 0, item
        elif case.wants_logprobs() and choice["logprobs"] is not None:  # each token's entry comes with it
            added = len(choice["logprobs"]["content" if case.chat else "tokens"])
            assert usage["completion_tokens"] == before + added, (item, before)
        else:
            assert usage["completion_tokens"] >= before, (item, before)
        so_far[index] = usage["completion_tokens"]
    assert sum(so_far.values()) == body["usage"]["completion_tokens"], (so_far, body["usage"])
    for choice in body["choices"]:
        if choice["finish_reason"] == "length" and case.max_tokens():
            assert so_far[choice["index"]] == case.max_tokens(), (so_far, choice)


def _check_stream(case: Case, events: list[dict[str, Any]], body: dict[str, Any], app, tokenizer) -> None:
    """Rules 1 to 4 of the module docstring."""
    meta = {(event["id"], event["object"], event["created"], event["model"]) for event in events}
    assert len(meta) == 1, meta
    [(stream_id, kind, _, model)] = meta
    assert kind == ("chat.completion.chunk" if case.chat else "text_completion") and model == body["model"] == MODEL
    assert stream_id.startswith("chatcmpl-" if case.chat else "cmpl-") and stream_id != body["id"]
    assert body["object"] == ("chat.completion" if case.chat else "text_completion")
    with_usage = case.usage_mode() != "none"
    chunks = events[:-1] if with_usage else events
    assert all(len(event["choices"]) == 1 for event in chunks), chunks  # one choice a chunk
    choices = [event["choices"][0] for event in chunks]
    count = case.num_choices()
    assert {c["index"] for c in choices} == set(range(count)), (sorted({c["index"] for c in choices}), count)

    # the chunks that precede a choice's tokens: a chat's role (and echo) chunk, completions' echo chunk
    openings: set[int] = set()
    seen: dict[int, int] = {}
    for position, choice in enumerate(choices):
        seen[choice["index"]] = seen.get(choice["index"], 0) + 1
        if case.chat and (seen[choice["index"]] == 1 or (case.body.get("echo") and seen[choice["index"]] == 2)):
            openings.add(position)
        elif not case.chat and case.body.get("echo") and seen[choice["index"]] == 1:
            openings.add(position)
    if case.chat and case.body.get("echo"):
        echoed = case.body["messages"][-1]["content"]
        for position in openings:
            if "role" not in choices[position]["delta"]:
                assert choices[position]["delta"] == {"content": echoed}, choices[position]
    if not case.chat and case.body.get("echo"):  # rule 3
        decode = app.state.openai_server.engine.tokenizer.decode
        texts = [p if isinstance(p, str) else decode(p) for p in case.prompts()]
        counts = _prompt_tokens(case, tokenizer)
        n = case.body.get("n", 1)
        for position in openings:
            choice = choices[position]
            assert choice["text"] == texts[choice["index"] // n] and choice["finish_reason"] is None, choice
            assert body["choices"][choice["index"]]["text"].startswith(choice["text"]), (choice, body)
            logprobs = choice["logprobs"]
            if case.wants_logprobs():
                assert len(logprobs["tokens"]) == counts[choice["index"] // n], (choice, counts)
                assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None, choice
                assert logprobs["text_offset"][0] == 0, choice
            else:
                assert logprobs is None, choice

    merged = _merge(case, choices)
    want = [{key: choice[key] for key in ("index", "message" if case.chat else "text", "logprobs",
                                           "finish_reason", "stop_reason")} for choice in body["choices"]]
    if case.chat:
        for choice in want:
            message = dict(choice["message"])
            assert all(value in (None, []) for key, value in message.items() if key not in ("role", "content")), message
            choice["message"] = {"role": message["role"], "content": message["content"] or ""}
    _close(merged, want, "choices")
    _check_usage(case, events, body, openings, tokenizer)


async def _run(app, case: Case, tokenizer) -> None:
    streamed = {**case.body, "stream": True}
    if case.stream_options is not None:
        streamed["stream_options"] = case.stream_options
    async with asgi_client(app) as client:
        whole = await client.post(case.path, json=case.body)
        stream = await client.post(case.path, json=streamed)
    assert whole.status_code == 200, (whole.text, case)
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream"), (
        stream.text[:500], case)
    body = whole.json()
    if currently_in_test_context():  # not in the plain tests
        event(f"{case.path} usage {case.usage_mode()}, finish {sorted({c['finish_reason'] for c in body['choices']})}")
    _check_body(case, body, tokenizer)
    _check_stream(case, _events(stream.text), body, app, tokenizer)


# ---------------------------------------------------------------- the properties
SETTINGS = settings(max_examples=40, deadline=None,  # ~75 ms each (two requests); 400 each passed (~60 s)
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(case=completions())
# echo with logprobs, n=2 and a prompt list: every choice's first chunk the prompt and its logprobs
@example(case=Case("/v1/completions", {"model": MODEL, "prompt": ["def add(a, b):", "x"], "max_tokens": 3, "n": 2,
                                       "temperature": 0, "echo": True, "logprobs": 1}, CONTINUOUS))
# seeded sampling, token-id prompts, a stop string, echo with max_tokens 0 (the prompt alone)
@example(case=Case("/v1/completions", {"model": MODEL, "prompt": [[9, 5, 6, 7], [300, 12]], "max_tokens": 4, "n": 2,
                                       "temperature": 1.0, "seed": 7, "stop": [" ", "e"], "logprobs": 2}, {}))
@example(case=Case("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 0, "n": 1,
                                       "temperature": 0, "echo": True, "logprobs": 0}, CONTINUOUS))
# a stop string's first character held back: a chunk of the token's logprobs and no text
@example(case=Case("/v1/completions", {"model": MODEL, "prompt": ["Hello", "1, 2, 3,"], "max_tokens": 2, "n": 1,
                                       "temperature": 1.0, "seed": 0, "stop": [" ="], "logprobs": 0}, None))
async def test_streamed_completions_merge_to_the_body(merge_app, bundled_tokenizer, case: Case) -> None:
    await _run(merge_app, case, bundled_tokenizer)


@SETTINGS
@given(case=chats())
@example(case=Case("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
                                            "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3,
                                            "logprobs": True, "top_logprobs": 2}, CONTINUOUS))
@example(case=Case("/v1/chat/completions", {"model": MODEL, "messages": [
    {"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure"}], "max_completion_tokens": 3, "n": 2,
    "temperature": 0, "stop": "\n", "echo": True, "add_generation_prompt": False, "logprobs": True}, {}))
async def test_streamed_chat_completions_merge_to_the_body(merge_app, bundled_tokenizer, case: Case) -> None:
    await _run(merge_app, case, bundled_tokenizer)


async def test_echo_alone_stopped_streams_as_whole(merge_app, bundled_tokenizer) -> None:
    """Echo with ``max_tokens`` 0 whose one sampled token (dropped) hits a stop string (or is EOS): the body's choice
    finishes by ``length`` with no stop_reason, and so must the stream's (until 2026-12-07 it sent the dropped
    token's ``stop`` and its stop string)."""
    await _run(merge_app, Case("/v1/completions", {"model": MODEL, "prompt": [[9, 5, 6, 7], [300, 12]],
                                                   "max_tokens": 0, "temperature": 0, "echo": True, "stop": " "},
                               None), bundled_tokenizer)
