"""One request's prompt as token ids (asyncllm/engine/prompt_tokens.py, with asyncllm/engine/validation.py's checks)
under drawn requests (hypothesis), against a reference written from vLLM's rules and docs/sampling.md.

Drawn: the bundled tokenizer's engine serving a `max_model_len` of 1 to 40 (its core's the same or up to 8 more:
data parallelism's least), a model vocabulary of the tokenizer's size or a little more, and one prompt: a text
(words, special-token text, any UTF-8, sometimes a lone surrogate), a list of token ids (some out of the vocabulary,
negative, bools or numpy ints), or a chat of 1 to 3 messages; a text or ids sometimes as vLLM's prompt dict (an
empty text one is a bare ``""``: [BOS]). With
it `truncate_prompt_tokens` (None, -1 or 1 to 45), `max_tokens` and `min_tokens`, `add_special_tokens` (None, True,
False), and a generation (the OpenAI server's ``check_max_tokens``, sometimes its ``echo_only``) or a pooling
request. `PromptTokenizer.token_ids` runs on the host alone; no engine starts.

The reference (vLLM's, where docs/sampling.md and docs/pooling.md do not decide otherwise): ``k`` keeps the prompt's
last k tokens, -1 ``max_model_len - 1`` for a generation (one left to generate) and ``max_model_len`` for a pooling
request, and a k outside 1 to that is refused naming ``truncate_prompt_tokens``; a text is cut by the tokenizer, its
special tokens kept (a generation's on the left: BOS and the text's last k - 1 tokens; a pooling request's on the
right); ids keep their last k, and a rendered chat is cut as a text is (no special tokens are added to a chat
unless ``add_special_tokens=True``; those added are kept, `test_a_generations_cut_chat_keeps_added_bos`). Then ids
that are not ints in ``[0, vocab_size)`` are refused naming ``prompt``, and so is an empty prompt; a prompt of
``max_model_len`` tokens or more (a pooling or echo-only request's: more than ``max_model_len``) is refused with code
``context_length_exceeded`` naming ``prompt`` (a chat's: ``prompt`` or, counted before rendering, ``messages``), and
with ``check_max_tokens`` so is a prompt plus ``max_tokens`` past ``max_model_len``, naming ``max_tokens``. What is
served below the core's own length has ``max_tokens`` (and ``min_tokens``) cut to the room left (at least 1); more
than the core's own is served as the core's.

Every draw must give exactly the reference's ids, or an `InvalidRequestError` naming the reference's field with the
context-length code exactly when the reference's refusal has it; the params are checked after a success.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.bundled import bundled_model_path
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.processor import Submit
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.stream import RequestOptions
from asyncllm.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError
from asyncllm.pooling import PoolingParams
from asyncllm.sampling import SamplingParams
from asyncllm.tokenizer import load_tokenizer

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "300"))
TOKENIZER = load_tokenizer(bundled_model_path())
VOCAB = len(TOKENIZER)
WORDS = ["hello", "world", " import", "os\n", "the", "a", "é", "日本", "🙂", " ", "\t", "<|bos|>", "<|eos|>", "12345"]


@dataclass(frozen=True)
class Refused:
    """The reference's refusal: the fields it may name, and whether its code is ``context_length_exceeded``."""

    fields: frozenset[str]
    context: bool = False


def refused(*fields: str, context: bool = False) -> Refused:
    return Refused(frozenset(fields), context)


@dataclass
class Case:
    """One drawn request and the engine's lengths."""

    kind: str
    """"text", "ids" or "chat"."""
    prompt: Any
    max_model_len: int
    core_max_model_len: int
    vocab_size: int = VOCAB
    truncate: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    add_special_tokens: bool | None = None
    pooling: bool = False
    check_max_tokens: bool = False
    echo_only: bool = False
    as_dict: bool = False
    """A text or ids as vLLM's prompt dict (``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``)."""


# ---------------------------------------------------------------- reference
def room(case: Case) -> int:
    """The most tokens a cut may keep: a generation leaves one to generate."""
    return case.max_model_len if case.pooling else case.max_model_len - 1


def kept(case: Case) -> int | None | Refused:
    """How many tokens ``truncate_prompt_tokens`` keeps (None: no cut), or its refusal."""
    if case.truncate is None:
        return None
    keep = room(case) if case.truncate == -1 else case.truncate
    return keep if 1 <= keep <= room(case) else refused("truncate_prompt_tokens")


def tokenized(case: Case, text: str, specials: bool, keep: int | None) -> list[int] | Refused:
    """HF's ``truncation=True, max_length=keep`` as vLLM calls it: the special tokens (BOS, a prefix here) kept, the
    text cut on the left for a generation and on the right for a pooling request."""
    whole = TOKENIZER(text, add_special_tokens=specials).input_ids
    body = TOKENIZER(text, add_special_tokens=False).input_ids
    added = len(whole) - len(body)
    assert whole[added:] == body and added == (TOKENIZER.num_special_tokens_to_add() if specials else 0)
    if keep is None or len(whole) <= keep:
        return whole
    if keep < added:
        return refused("truncate_prompt_tokens")
    text_keep = keep - added
    return whole[:added] + (body[:text_keep] if case.pooling else body[len(body) - text_keep:])


def chat_text(case: Case) -> str:
    """The chat rendered by transformers."""
    return TOKENIZER.apply_chat_template(case.prompt, tokenize=False, add_generation_prompt=True)


def valid_id(token: Any, vocab_size: int) -> bool:
    return type(token) is int and 0 <= token < vocab_size


def cut_ids(case: Case) -> list[int] | Refused:
    """The prompt's ids after ``truncate_prompt_tokens``, or what refuses it before its length is checked."""
    if case.kind == "text" and not is_utf8(case.prompt):
        return refused("prompt")
    if case.kind == "chat" and len(case.prompt) > case.max_model_len * (1 if case.truncate is None else 8):
        return refused("messages", context=True)  # a role marker per message at least: counted before rendering
    keep = kept(case)
    if isinstance(keep, Refused):
        return keep
    if case.kind == "text":
        return tokenized(case, case.prompt, case.add_special_tokens is not False, keep)
    if case.kind == "chat":  # special tokens added only when asked (the template writes BOS)
        return tokenized(case, chat_text(case), bool(case.add_special_tokens), keep)
    ids = list(case.prompt) if keep is None else list(case.prompt)[-keep:]
    if len(ids) <= case.max_model_len and not all(valid_id(t, case.vocab_size) for t in ids):
        return refused("prompt")  # a list too long to fit is refused by its length, its ids unread
    return ids


def reference(case: Case) -> list[int] | Refused:
    """The prompt's ids as vLLM serves them, or the refusal."""
    ids = cut_ids(case)
    if isinstance(ids, Refused):
        return ids
    if not ids:
        return refused("prompt")
    fills = case.pooling or case.echo_only  # generates nothing: may fill max_model_len
    if len(ids) > case.max_model_len or (len(ids) == case.max_model_len and not fills):
        chat_counted = case.kind == "chat" and case.truncate is None and len(ids) > case.max_model_len
        return refused("prompt", "messages", context=True) if chat_counted else refused("prompt", context=True)
    if case.check_max_tokens and not case.echo_only and case.max_tokens is not None \
            and len(ids) + case.max_tokens > case.max_model_len:
        return refused("max_tokens", context=True)
    return ids


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def capped(case: Case, prompt_len: int) -> tuple[int | None, int]:
    """``max_tokens`` and ``min_tokens`` after the host's cut to the room its served length leaves."""
    if case.max_model_len >= case.core_max_model_len:
        return case.max_tokens, case.min_tokens
    left = max(case.max_model_len - prompt_len, 1)
    if case.max_tokens is not None and case.max_tokens <= left:
        return case.max_tokens, case.min_tokens
    return left, min(case.min_tokens, left)


# ---------------------------------------------------------------- the module
def params_of(case: Case) -> SamplingParams:
    params = SamplingParams(max_tokens=case.max_tokens, min_tokens=case.min_tokens,
                            truncate_prompt_tokens=case.truncate)
    params.validate()
    return params


def token_ids(case: Case) -> tuple[list[int] | InvalidRequestError, SamplingParams]:
    """`PromptTokenizer.token_ids` on the case's job, as the processor thread runs it; and the job's params after."""
    prompts = PromptTokenizer(TOKENIZER, case.vocab_size)
    prompts.ready(case.core_max_model_len)
    below = case.max_model_len < case.core_max_model_len
    prompts.serve(case.max_model_len if below else case.max_model_len + 3)  # more than its core's: the core's
    prompt = case.prompt
    if case.as_dict:
        prompt = {"prompt": prompt} if case.kind == "text" else {"prompt_token_ids": list(prompt)}
    options = RequestOptions(pooling=PoolingParams() if case.pooling else None, check_max_tokens=case.check_max_tokens,
                             echo_only=case.echo_only, add_special_tokens=case.add_special_tokens)
    job = Submit(RequestCollector("r", 0.0), prompt, params_of(case), options, case.kind == "chat")
    try:
        return prompts.token_ids(job), job.params
    except InvalidRequestError as exc:
        return exc, job.params


# ---------------------------------------------------------------- draws
texts = st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=6)), max_size=24).map("".join)
odd_ids = st.one_of(st.integers(VOCAB - 1, VOCAB + 20), st.integers(-3, -1), st.booleans(),
                    st.integers(0, VOCAB - 1).map(np.int64))
"""Ids a prompt may hold by mistake (past the tokenizer's vocabulary, which may still be the model's)."""
messages = st.lists(st.builds(lambda role, content: {"role": role, "content": content},
                              st.sampled_from(["system", "user", "assistant"]), texts), min_size=1, max_size=3)


@st.composite
def text_prompts(draw: st.DrawFn) -> str:
    text = draw(texts)
    if draw(st.integers(0, 9)) == 0:  # a lone surrogate, as a bad decode leaves
        at = draw(st.integers(0, len(text)))
        text = text[:at] + "\ud800" + text[at:]
    return text


@st.composite
def id_prompts(draw: st.DrawFn) -> list[Any]:
    ids: list[Any] = draw(st.lists(st.integers(0, VOCAB - 1), max_size=48))
    if draw(st.integers(0, 2)) == 0:
        ids.insert(draw(st.integers(0, len(ids))), draw(odd_ids))
    return ids


@st.composite
def cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["text", "ids", "chat"]))
    prompt = {"text": text_prompts(), "ids": id_prompts(), "chat": messages}[kind]
    max_model_len = draw(st.integers(1, 40))
    pooling = draw(st.integers(0, 3)) == 0
    max_tokens = 1 if pooling else draw(st.one_of(st.none(), st.integers(1, 48)))
    echo_only = not pooling and draw(st.integers(0, 5)) == 0
    return Case(kind, draw(prompt), max_model_len, max_model_len + draw(st.sampled_from([0, 0, 1, 8])),
                vocab_size=VOCAB + draw(st.sampled_from([0, 0, 16])),
                truncate=draw(st.one_of(st.none(), st.just(-1), st.integers(1, 45))), max_tokens=max_tokens,
                min_tokens=draw(st.integers(0, max_tokens or 4)),
                add_special_tokens=draw(st.sampled_from([None, True, False])), pooling=pooling,
                check_max_tokens=not pooling and draw(st.booleans()), echo_only=echo_only,
                as_dict=kind != "chat" and draw(st.integers(0, 3)) == 0)


def holds(case: Case) -> None:
    """The module's ids (or typed refusal) and params are the reference's."""
    expected, (got, params) = reference(case), token_ids(case)
    if isinstance(expected, Refused):
        assert isinstance(got, InvalidRequestError), f"{case}: expected a refusal {expected}, got {got}"
        assert got.field in expected.fields, f"{case}: {got!r} names {got.field}, expected {expected}"
        assert (got.code == CONTEXT_LENGTH_EXCEEDED) == expected.context, f"{case}: {got!r} code {got.code}"
        return
    assert not isinstance(got, InvalidRequestError), f"{case}: refused {got!r}, expected {expected}"
    assert got == expected and all(type(t) is int for t in got), case
    assert (params.max_tokens, params.min_tokens) == capped(case, len(got)), (case, params)
    assert params.truncate_prompt_tokens == case.truncate


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize="PROP_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow])  # fixed draws in CI; PROP_EXAMPLES: random


@SETTINGS
@given(cases())
@example(Case("text", "hello world " * 6, 8, 8, truncate=-1))  # BOS and the text's last 6 tokens
@example(Case("text", "hello world " * 6, 8, 8, truncate=5, pooling=True, max_tokens=1))  # BOS and the first 4
@example(Case("text", "hello world", 8, 8, truncate=8))  # k = max_model_len: no room to generate
@example(Case("text", "", 8, 8, add_special_tokens=False))  # no tokens
@example(Case("ids", list(range(12)), 8, 8, truncate=-1))  # the last 7
@example(Case("ids", list(range(8)), 8, 8, pooling=True, max_tokens=1))  # a pooling prompt may fill it
@example(Case("ids", list(range(8)), 8, 8, echo_only=True, check_max_tokens=True))  # so may an echo's
@example(Case("ids", list(range(7)), 8, 8, max_tokens=2, check_max_tokens=True))  # 7 + 2 > 8: max_tokens
@example(Case("ids", list(range(7)), 8, 9, max_tokens=2, min_tokens=2))  # served below the core: cut to 1
@example(Case("ids", [1, True], 8, 8))
@example(Case("ids", [1, np.int64(2)], 8, 8))
@example(Case("ids", [1, -1], 8, 8))
@example(Case("ids", [1, VOCAB], 8, 8))
@example(Case("ids", [VOCAB] * 9, 8, 8))  # refused by its length, its ids unread
@example(Case("ids", [VOCAB, *range(7)], 8, 8, pooling=True, max_tokens=1))  # fills it: its ids are read
@example(Case("text", "hello world " * 20, 2, 2, truncate=-1))  # past max_prompt_chars, cut: [BOS]
@example(Case("ids", [VOCAB, 5, 6], 8, 8, truncate=2))  # the bad id is cut off
@example(Case("ids", [], 8, 8, truncate=3))
@example(Case("ids", list(range(12)), 8, 8, truncate=-1, pooling=True, max_tokens=1))  # a pooling -1: the last 8
@example(Case("text", "", 8, 8, as_dict=True))  # {"prompt": ""}: [BOS], as "" (refused before 2026-12-07)
@example(Case("text", "", 8, 8))  # "": [BOS], as vLLM's
@example(Case("chat", [{"role": "user", "content": "hello world"}] * 3, 2, 2, truncate=1))
@example(Case("chat", [{"role": "user", "content": "hello world"}] * 3, 2, 2))  # 3 messages > 2: messages
@example(Case("chat", [{"role": "user", "content": "hello world " * 9}], 40, 40, truncate=5, pooling=True,
              add_special_tokens=True, max_tokens=1))
def test_prompt_token_ids_are_vllms(case: Case) -> None:
    holds(case)


def test_a_generations_cut_chat_keeps_added_bos() -> None:
    """vLLM (0.10 to 0.12 ``_normalize_prompt_text_to_input``) tokenizes a chat's rendered text with
    ``truncation=True, max_length=k`` and the request's ``add_special_tokens``: cut on the left (a generation's
    truncation side), the BOS it adds stays, as a text prompt's does (it was cut off before 2026-12-07)."""
    chat = [{"role": "user", "content": "hello world how are you"}]
    got, _ = token_ids(Case("chat", chat, 64, 64, truncate=5, add_special_tokens=True))
    assert got == reference(Case("chat", chat, 64, 64, truncate=5, add_special_tokens=True))
