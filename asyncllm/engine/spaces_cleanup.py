"""`SpacesCleanup`: transformers' ``clean_up_tokenization_spaces`` (" ." -> ".") on streamed text, the
detokenizer's second stage (asyncllm/engine/detokenizer.py), by token so that a stop string counts by the token whose
text completed it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SpacesCleanup", "cleanup_applies"]

_CLEANUP_TAIL_CHARS = frozenset(" n'vr")
"""Every proper prefix of a clean-up pattern (" .", " n't", " 've", ...) is made of these, and starts with a space."""


def cleanup_applies(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` rewrites " ." to "." (transformers 5 skips it for BPE models).

    Probed by behaviour rather than by reading transformers' private rules,
    which changed between versions.
    """
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    probe = tokenizer.encode("a . b n't", add_special_tokens=False)
    return tokenizer.decode(probe) != tokenizer.decode(probe, clean_up_tokenization_spaces=False)


class SpacesCleanup:
    """transformers' ``clean_up_tokenization`` applied to a stream of text.

    Every clean-up pattern starts with a space and only deletes spaces; a
    pattern, or a chain of them (" ' " becomes "'", which may join the space
    before it), can span a cut only from a space inside the text's trailing run
    of characters that proper pattern prefixes are made of (" n'vr"). So the
    text from that run's first space waits for more text, and the rest is
    cleaned and released: "Human" is released whole (a stop string ending in it
    matches on its token); "do n '" waits from its " n".

    Text goes in and out by token (its 1-based index, the "owner"), so that a stop string
    counts by the token whose text completed it: the cleaned text is split among the
    tokens whose text it came from (the characters it kept, in order).
    """

    def __init__(self, clean: Callable[[str], str]) -> None:
        self._clean = clean
        self._held: list[tuple[int, str]] = []
        """The text waiting, as (owner, text) pieces."""

    @property
    def first_held_owner(self) -> int | None:
        """The token of the first character held back, if any."""
        return self._held[0][0] if self._held else None

    def push(self, owner: int, text: str) -> list[tuple[int, str]]:
        """The cleaned text released by token ``owner``'s ``text``, as (owner, text) pieces."""
        self._held.append((owner, text))
        buffer = "".join(piece for _, piece in self._held) if len(self._held) > 1 else text
        run = len(buffer)
        while run > 0 and buffer[run - 1] in _CLEANUP_TAIL_CHARS:
            run -= 1
        space = buffer.find(" ", run)  # a pattern (or a chain of " ' " rewrites) can only start at a space
        released, self._held = _split_pieces(self._held, len(buffer) if space < 0 else space)
        return self._cleaned(released)

    def flush(self) -> list[tuple[int, str]]:
        released, self._held = self._held, []
        return self._cleaned(released)

    def _cleaned(self, pieces: list[tuple[int, str]]) -> list[tuple[int, str]]:
        if len(pieces) <= 1:
            return [(owner, self._clean(text)) for owner, text in pieces]
        return _split_by_owner(pieces, self._clean("".join(text for _, text in pieces)))


def _split_pieces(pieces: list[tuple[int, str]], cut: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(owner, text) pieces split at character ``cut`` of their joined text."""
    for i, (owner, text) in enumerate(pieces):
        if cut <= len(text):
            head, tail = pieces[:i], pieces[i + 1:]
            if cut:
                head.append((owner, text[:cut]))
            return head, ([(owner, text[cut:])] if cut < len(text) else []) + tail
        cut -= len(text)
    return pieces, []


def _split_by_owner(pieces: list[tuple[int, str]], cleaned: str) -> list[tuple[int, str]]:
    """``cleaned``, the joined text of ``pieces`` less some characters, split among their owners: each character
    goes to the first piece that has it (a space kept of two goes to the first; clean-up deletes the one before
    punctuation). If ``cleaned`` is not such a text (a tokenizer's own clean-up), it all goes to the last owner."""
    out: list[tuple[int, str]] = []
    kept = 0
    for owner, text in pieces:
        start = kept
        for char in text:
            if kept < len(cleaned) and cleaned[kept] == char:
                kept += 1
        out.append((owner, cleaned[start:kept]))
    return out if kept == len(cleaned) else [(pieces[-1][0], cleaned)]
