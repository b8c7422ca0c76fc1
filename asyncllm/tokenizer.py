"""Tokenizer loading, prompt encoding, chat templates and EOS ids.

Thin wrappers over transformers that do what a user of ``generate`` expects
(``tokenizer(prompt).input_ids``, ``apply_chat_template``) and map the third
party's failures to asyncllm's typed errors at this edge: a tokenizer that does
not load is a `ConfigError`, bad messages or a prompt that encodes to nothing
are an `InvalidRequestError` naming the field.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncllm import envs
from asyncllm.config_checks import is_int
from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError, check_remote_code
from asyncllm.mistral_tokenizer import (MistralChat, is_mistral, load_mistral_tokenizer, render_mistral_chat,
                                        uses_mistral)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "load_tokenizer", "encode_prompt", "truncating", "apply_chat_template", "render_chat", "chat_token_ids",
    "template_arguments", "template_messages",
    "with_template_calls",
    "check_template_kwargs", "check_chat_template", "load_chat_template", "bad_words_token_ids", "eos_token_ids",
]

_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "return_dict", "return_tensors",
                                       "chat_template", "tools", "documents", "padding", "truncation", "max_length"})
"""Arguments of transformers' ``apply_chat_template`` that are not template variables: never taken from requests."""


def check_template_kwargs(kwargs: object) -> None:
    """`InvalidRequestError("chat_template_kwargs")` unless `kwargs` is None or a dict of template variables."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError("chat_template_kwargs", f"must be a dict with str keys, got {kwargs!r}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequestError("chat_template_kwargs", f"{reserved} are not template variables")


def check_chat_template(chat_template: object) -> None:
    """`InvalidRequestError("chat_template")` unless it is None or a non-empty Jinja template string."""
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise InvalidRequestError("chat_template", f"must be a non-empty Jinja template string, got {chat_template!r}")


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (vLLM's ``--chat-template``): a value that
    is no file and holds a ``{``, ``}`` or newline is the text (vLLM's rule), taken as is, as vLLM's since
    vllm-project/vllm#15143 (its older ``unicode_escape`` decoding turned ``\\n`` into a newline and garbled
    non-ASCII text)."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as file:
                return file.read()
        except UnicodeDecodeError as exc:
            raise ConfigError("chat_template", value, f"a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
    if not any(char in value for char in "{}\n"):
        raise ConfigError("chat_template", value, "a Jinja template file that exists, or the template text")
    return value


def load_tokenizer(name_or_path: str, revision: str | None = None, mode: str = "auto",
                   trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer with `AutoTokenizer` (its own code run only with `trust_remote_code`; ``mode`` "slow":
    the Python one); a ``.gguf`` file's from its metadata; Mistral's tokenizer files with mistral_common
    (`asyncllm.mistral_tokenizer.uses_mistral`)."""
    from transformers import AutoTokenizer

    if uses_mistral(name_or_path, mode):  # before AutoTokenizer, which reads tekken.json without its control tokens
        return load_mistral_tokenizer(name_or_path, revision)
    try:
        if os.path.isfile(name_or_path) and name_or_path.lower().endswith(".gguf"):
            folder, name = os.path.split(os.path.abspath(name_or_path))
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoTokenizer.from_pretrained(name_or_path, revision=revision, use_fast=mode != "slow",
                                             trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ImportError...
        check_remote_code(exc, trust_remote_code, name_or_path, "tokenizer")
        why = " ".join(str(exc).split())  # transformers' text runs over lines; the CLI prints one
        raise ConfigError("tokenizer", name_or_path, f"a loadable Hugging Face tokenizer ({why})") from exc


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, add_special_tokens: bool = True,
                  max_length: int | None = None, truncation_side: str = "left") -> list[int]:
    """Token ids of ``prompt`` as ``tokenizer(prompt).input_ids`` gives them (with BOS if the tokenizer adds it;
    ``add_special_tokens=False``: the text's own tokens only, Whisper's decoder prompt); ``max_length``: as
    ``truncation=True, max_length=max_length`` cuts them on `truncation_side`, special tokens kept (`truncating`)."""
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt", f"must be a str, got {type(prompt).__name__}")
    if max_length is None:
        token_ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
    else:
        with truncating(tokenizer, max_length, truncation_side, add_special_tokens=add_special_tokens) as cutting:
            token_ids = list(cutting(prompt, add_special_tokens=add_special_tokens, truncation=True,
                                     max_length=max_length).input_ids)
    if not token_ids:
        raise InvalidRequestError("prompt", "encodes to no tokens; give at least one character")
    return token_ids


@contextlib.contextmanager
def truncating(tokenizer: PreTrainedTokenizerBase, max_length: int, side: str, pair: bool = False,
               add_special_tokens: bool = True) -> Iterator[PreTrainedTokenizerBase]:
    """The tokenizer to encode with ``truncation=True, max_length=max_length`` cutting on `side`, as vLLM sets it:
    "left" for a generation (its special tokens, BOS, then the text's last tokens), "right" for pooling (a
    text's start, [CLS] included, as sentence-transformers). A copy with its own backend, held under its own lock
    while the caller encodes: a fast tokenizer's truncation setting lives in its backend, and setting the shared
    one would race other threads' encodes. A `max_length` of just the special tokens keeps only them, as HF's
    (and vLLM's) tokenizer; a smaller one is an `InvalidRequestError` (HF's would not cut at all). With
    ``add_special_tokens=False`` none are added, so any `max_length` keeps that many of the text's tokens."""
    special = tokenizer.num_special_tokens_to_add(pair=pair) if add_special_tokens else 0
    if max_length < special:
        raise InvalidRequestError("truncate_prompt_tokens", f"is {max_length}, but the tokenizer adds {special} "
                                                            f"special tokens, which it never cuts: keep at least "
                                                            f"{special}")
    with _TRUNCATING_LOCK:  # only to find or make the copy: encodes on other copies (and sides) run meanwhile
        copies = _TRUNCATING.setdefault(tokenizer, {})
        if side not in copies:
            copies[side] = (_truncating_copy(tokenizer, side), threading.Lock())
        cutting, lock = copies[side]
    with lock:
        yield cutting


def _truncating_copy(tokenizer: PreTrainedTokenizerBase, side: str) -> PreTrainedTokenizerBase:
    cutting = copy.copy(tokenizer)
    if getattr(tokenizer, "_tokenizer", None) is not None:  # a fast tokenizer's Rust backend
        cutting._tokenizer = copy.deepcopy(tokenizer._tokenizer)
    cutting.truncation_side = side
    return cutting


_TRUNCATING: weakref.WeakKeyDictionary[Any, dict[str, tuple[Any, threading.Lock]]] = weakref.WeakKeyDictionary()
"""Each tokenizer's truncating copies (`truncating`), by side, each with the lock its encodes hold; they go with
the tokenizer."""
_TRUNCATING_LOCK = threading.Lock()


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str],
                        token_ids: Sequence[list[int]] = ()) -> list[list[int]]:
    """`token_ids`, then each word's token ids as it is written at a text's start and, as vLLM's
    ``SamplingParams.update_from_tokenizer``, after a space when that spelling has as many tokens and another first
    token, without duplicates; `InvalidRequestError` naming bad_words as soon as the sequences pass vLLM's bounds
    (ASYNCLLM_MAX_NUM_BAD_WORDS sequences, ASYNCLLM_MAX_BAD_WORDS_TOTAL_TOKENS tokens), before the next word."""
    max_sequences, max_tokens = envs.MAX_NUM_BAD_WORDS.get(), envs.MAX_BAD_WORDS_TOTAL_TOKENS.get()
    out = list(token_ids)
    seen = {tuple(ids) for ids in out}
    total = sum(len(ids) for ids in out)
    for word in words:
        for ids in _bad_word_spellings(tokenizer, word.lstrip()):
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append(ids)
                total += len(ids)
        if len(out) > max_sequences or total > max_tokens:
            raise InvalidRequestError("bad_words", f"tokenize to {len(out)} sequences of {total} tokens with "
                                      f"bad_words_token_ids (each word, and after a space by vLLM's rule): at most "
                                      f"{max_sequences} (ASYNCLLM_MAX_NUM_BAD_WORDS) of {max_tokens} tokens "
                                      f"(ASYNCLLM_MAX_BAD_WORDS_TOTAL_TOKENS)")
    return out


def _bad_word_spellings(tokenizer: PreTrainedTokenizerBase, word: str) -> list[list[int]]:
    """``word``'s ids, then those of `` word`` when they have as many tokens and another first one (vLLM's rule: a
    different tokenization, such as SentencePiece's ``▁`` then the word, is not the same word after a space)."""
    plain = [int(t) for t in tokenizer.encode(word, add_special_tokens=False)]
    spaced = [int(t) for t in tokenizer.encode(" " + word, add_special_tokens=False)]
    return [plain, spaced] if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [plain]


def template_arguments(
    template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None, add_generation_prompt: bool = True,
) -> dict[str, Any]:
    """Keyword arguments of transformers' ``apply_chat_template`` for one request.

    `template_kwargs` are variables the template reads (``enable_thinking``
    for Qwen3, say; an ``add_generation_prompt`` or ``continue_final_message``
    among them wins); `tools` (OpenAI function tools) go to the template's
    ``tools``; `chat_template` replaces the tokenizer's template.
    """
    check_template_kwargs(template_kwargs)
    kwargs = {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}
    if tools:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return kwargs


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None, content_format: str = "auto", lower: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """``messages`` rendered (`render_chat`, same arguments) and tokenized (`chat_token_ids`, `add_special_tokens`
    as the engine's chat takes it)."""
    return chat_token_ids(tokenizer, render_chat(tokenizer, messages, add_generation_prompt, template_kwargs, tools,
                                                 chat_template, content_format, lower), add_special_tokens)


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None, content_format: str = "auto", lower: bool = False,
    placeholder: Callable[[str], str] | None = None,
) -> str:
    """Render ``messages`` with the chat template as text (arguments: `template_arguments`), their
    content in vLLM's `content_format` (asyncllm/chat_content.py: "auto", "string" or "openai"); `lower`: the
    rendered text lowercased first (a sentence-transformers ``do_lower_case``: vLLM lowercases the rendered chat);
    `placeholder`: a media part's text under the ``"string"`` format (a multimodal model's, asyncllm/mm/host.py).

    Whatever rendering raises is an `InvalidRequestError` on ``messages`` (vLLM's ``apply_hf_chat_template`` makes
    any exception a 400). The text comes before its tokens so that the processor can count one longer than
    ``max_prompt_chars`` by parts and refuse it without tokenizing it whole (asyncllm/engine/prompt_tokens.py).
    """
    from asyncllm.chat_content import content_format_of, formatted_messages

    if isinstance(messages, list):
        form = content_format_of(content_format, tokenizer, chat_template, tools)
        if form == "string" and placeholder is not None and is_mistral(tokenizer):  # media parts stay parts for it
            raise InvalidRequestError("chat_template_content_format", "'string' writes media as text, which "
                                                                      "mistral_common never reads as media: 'auto'")
        messages = formatted_messages(messages, form, placeholder)
    messages = template_messages(messages)
    kwargs = template_arguments(template_kwargs, tools, chat_template, add_generation_prompt)
    if is_mistral(tokenizer):
        if lower:
            raise NotBuiltError("tokenizer_mode", "mistral", "a lowercasing embedding model's chat with "
                                                             "tokenizer_mode='mistral'")
        return render_mistral_chat(tokenizer, messages, kwargs)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "messages", f"the tokenizer of {tokenizer.name_or_path or 'this model'} has no chat template; "
            "send a plain prompt instead",
        )
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateError as exc:  # raise_exception() in the template, or a template bug
        raise InvalidRequestError("messages", f"the chat template rejected them: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a template's TypeError, ZeroDivisionError...: a 400, as vLLM's
        raise InvalidRequestError("messages", f"could not be tokenized ({type(exc).__name__}: {exc})") from exc
    return text.lower() if lower else text


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = False,
                   max_length: int | None = None, truncation_side: str = "left") -> list[int]:
    """A rendered chat's token ids as transformers' ``apply_chat_template(tokenize=True)`` makes them: the template
    wrote the special tokens itself (BOS included), so none are added unless `add_special_tokens` (vLLM's); a
    `MistralChat`'s are mistral_common's own (BOS included). With them added and a `max_length`, cut by the
    tokenizer as vLLM's ``truncation=True, max_length=k``: the added tokens kept, the text cut on `truncation_side`
    (without them the caller's cut of the ids is the same)."""
    if isinstance(text, MistralChat):
        if add_special_tokens:
            raise InvalidRequestError("add_special_tokens", "mistral_common writes a chat's special tokens itself "
                                                            "(tokenizer_mode='mistral'): leave it False")
        return list(text.token_ids)
    if add_special_tokens and max_length is not None:
        with truncating(tokenizer, max_length, truncation_side) as cutting:
            return _chat_encoded(cutting, text, add_special_tokens=True, truncation=True, max_length=max_length)
    return _chat_encoded(tokenizer, text, add_special_tokens=add_special_tokens)


def _chat_encoded(tokenizer: PreTrainedTokenizerBase, text: str, **kwargs: Any) -> list[int]:
    try:
        token_ids = tokenizer(text, **kwargs).input_ids
    except Exception as exc:  # noqa: BLE001 - a 400, as vLLM's
        raise InvalidRequestError("messages", f"could not be tokenized ({type(exc).__name__}: {exc})") from exc
    return [int(t) for t in token_ids]


def template_messages(messages: object) -> list[dict[str, Any]]:
    """Checked messages as chat templates read them.

    Each is a dict with a str ``role`` and ``content`` (or a list of parts: the "openai" content format,
    asyncllm/chat_content.py); an assistant message
    with ``tool_calls`` (OpenAI's shape) may have ``content`` None (rendered
    as ""), and its calls' ``arguments`` JSON text is parsed into the value the
    templates write (as vLLM does; `with_template_calls`). Other keys (``tool_call_id``, ``name``)
    pass through.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {'role': str, 'content': str} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError("messages", f"item {i} must be a dict, got {type(message).__name__}")
        message = with_template_calls(i, message)
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), (str, list)):
            raise InvalidRequestError("messages", f"item {i} needs a str 'role' and a str (or list of parts) "
                                                  f"'content', got {message!r:.120}")
        out.append(message)
    return out


def with_template_calls(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """Message `i` with its ``tool_calls`` (if any) as templates read them: arguments parsed, content None as "".

    An empty list is dropped, as vLLM's ``_postprocess_messages`` does: templates test ``'tool_calls' in message``
    (Llama 3.1's), so the message stays on their plain assistant path."""
    calls = message.get("tool_calls")
    if calls is None:
        return message
    content = "" if message.get("content") is None else message["content"]
    if calls == []:
        return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": content}
    return {**message, "content": content, "tool_calls": [_template_call(i, call) for call in _listed(i, calls)]}


def _listed(i: int, calls: object) -> list[Any]:
    if not isinstance(calls, list):
        raise InvalidRequestError("messages", f"item {i}: tool_calls must be a list, got {type(calls).__name__}")
    return calls


def _template_call(i: int, call: object) -> dict[str, Any]:
    """One of an assistant's ``tool_calls`` with its arguments as vLLM's ``_postprocess_messages`` hands them to the
    template: JSON text as the value it holds (an object, an array, a string, a number...), text that is not JSON
    as {}, a dict or list as it is, anything else (None, a number) as {}."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError("messages", f"item {i}: each tool call needs a 'function' with a str 'name'")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
        except RecursionError:  # nested deeper than Python's recursion limit
            raise InvalidRequestError("messages", f"item {i}: tool call arguments are JSON nested too deeply") from None
    elif not isinstance(arguments, (dict, list)):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def eos_token_ids(tokenizer: PreTrainedTokenizerBase | None, generation: Mapping[str, Any],
                  config_eos: object = None) -> list[int]:
    """The tokenizer's EOS id, then generation_config.json's ``eos_token_id`` (int or list), deduplicated.

    Chat models often end a turn with a token other than the tokenizer's EOS
    (Llama 3's ``<|eot_id|>``) and list it only in generation_config.json, as
    HF ``generate`` reads it; ``generation`` is that file's keys (asyncllm/generation_config.py; a folder without
    the file: config.json's generation attributes, as vLLM and ``generate`` read them; {}: no extra ids).
    Without a tokenizer (``skip_tokenizer_init``) config.json's `config_eos` stands in for its EOS.
    The engine core treats the rest as vLLM's ``update_from_generation_config`` does: the first id ends a request
    with ``stop_reason`` None, the others as ``stop_token_ids`` (``stop_reason`` the id; asyncllm/sched/request.py).
    """
    first = config_eos if tokenizer is None else tokenizer.eos_token_id
    candidates: list[object] = [*_listify(first), *_listify(generation.get("eos_token_id"))]
    merged: list[int] = []
    for token_id in candidates:
        if is_int(token_id) and token_id not in merged:
            merged.append(token_id)
    return merged


def _listify(value: object) -> Iterable[object]:
    return value if isinstance(value, list) else [value]
