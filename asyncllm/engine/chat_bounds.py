"""A chat refused by its size before its template renders it (`check_chat_size`).

The processor thread every request of a replica shares renders chat templates (asyncllm/engine/prompt_tokens.py);
Jinja takes some microseconds a message, so a body of 400,000 one-letter messages held it for seconds, stalling
every other stream, before the rendered text could be measured. These bounds cost a pass over at most
``max_model_len`` messages (`CUT_CHAT_MESSAGES` times that with ``truncate_prompt_tokens`` or on ``/tokenize``) and a
count of their text, never a render. The OpenAI server's own renders (``/tokenize``, ``/v1/embeddings``, ``/pooling``
and beam search: integrations/openai_tokenize.py `chat_tokens`), on a worker thread that holds the GIL, take them too.
"""

from __future__ import annotations

from typing import Any

from asyncllm.engine.validation import check_prompt_chars
from asyncllm.errors import prompt_too_long

__all__ = ["CUT_CHAT_MESSAGES", "check_chat_size", "message_texts"]

CUT_CHAT_MESSAGES = 8
"""With ``truncate_prompt_tokens`` a chat may hold this many times `max_model_len` messages: its template renders them
all, and the earlier turns are cut from the rendered tokens (as vLLM's), yet its render is still bounded."""


def check_chat_size(tokenizer: Any, messages: list[Any], max_model_len: int, past: int,
                    operation: str | None = None, cuttable: bool = False) -> None:
    """`prompt_too_long` on ``messages`` for a chat that cannot fit `max_model_len` tokens, told without rendering:

    - more messages than `max_model_len`: a template writes each message's role marker, one token at least; for a
      chat whose tokens may pass it (`cuttable`: ``truncate_prompt_tokens`` keeps the rendered chat's first or last
      tokens, ``/tokenize`` counts them all) more than `CUT_CHAT_MESSAGES` times that, a bound on the render alone;
    - unless `cuttable`, message texts of more than `past` characters
      (``max_prompt_chars``) whose parts already make more than `max_model_len` tokens (`check_prompt_chars`, as a
      text prompt's and the rendered chat's): the contents and text parts, which a template writes out.

    Anything else about the messages (their types, keys) is the renderer's to check."""
    count = len(messages)
    if count > max_model_len * (CUT_CHAT_MESSAGES if cuttable else 1):
        amount = (f"{count} messages, more than {CUT_CHAT_MESSAGES} times that, the most a chat renders"
                  if cuttable else f"{count} messages, at least {count} input tokens")
        raise prompt_too_long(max_model_len, amount, operation, field="messages")
    texts = [] if cuttable else message_texts(messages)
    if sum(map(len, texts)) + len(texts) > past:  # joined only when counted by parts
        check_prompt_chars(tokenizer, ("\n".join(texts),), max_model_len, past, operation, field="messages")


def message_texts(messages: list[Any]) -> list[str]:
    """The texts in `messages`: each string content, and each string or ``text`` of a content list's parts (others
    skipped: their shape is checked where they are rendered)."""
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part if isinstance(part, str) else part.get("text") for part in content
                         if isinstance(part, str) or isinstance(part, dict) and isinstance(part.get("text"), str))
    return texts
