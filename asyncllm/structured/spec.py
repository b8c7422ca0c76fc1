"""`StructuredOutputs`: the constraint a request's output must follow (a JSON schema, a regex, choices, EBNF).

Pure data and validation: importing it never loads xgrammar or torch, so the
host and `SamplingParams` carry it freely. The core compiles it
(`asyncllm/structured/compiler.py`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from asyncllm.errors import InvalidRequestError

__all__ = ["StructuredOutputs"]

_KINDS = ("json", "regex", "choice", "grammar")


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True, frozen=True):
    """Exactly one of the fields: what the generated text must match (vLLM's `StructuredOutputsParams`)."""

    json: dict[str, Any] | str | None = None
    """A JSON schema (a dict, or its JSON text): the output is one JSON value valid against it."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's GBNF dialect, start rule ``root``)."""
    start_after: str | None = None
    """The constraint starts once the output has written this text (a reasoning model's ``</think>``):
    what comes before is free. Already in the end of the prompt, it starts at once."""
    start_after_token_ids: list[int] = []
    """`start_after` as token ids; the engine fills them from `start_after`."""

    @property
    def kind(self) -> str:
        """Which field is set: 'json', 'regex', 'choice' or 'grammar' (after `validate`)."""
        return next(k for k in _KINDS if getattr(self, k) is not None)

    def validate(self) -> None:
        """Raise `InvalidRequestError` on 'structured' unless exactly one well-formed field is set."""
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise InvalidRequestError("structured", f"set exactly one of {', '.join(_KINDS)}; got {given or 'none'}")
        if self.start_after is not None and (not isinstance(self.start_after, str) or not self.start_after):
            raise InvalidRequestError("structured", "start_after must be a non-empty string")
        ids = self.start_after_token_ids
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InvalidRequestError("structured", "start_after_token_ids must be a list of token ids >= 0")
        kind = given[0]
        if kind == "json":
            _check_schema(self.json)
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError("structured", "choice must be a non-empty list of non-empty strings")
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise InvalidRequestError("structured", f"{kind} must be a non-empty string")

    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, dict) else json.loads(self.json)  # type: ignore[arg-type]
            return kind, json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, getattr(self, kind)


def _check_schema(schema: object) -> None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's recursion limit
            raise InvalidRequestError("structured", f"json is not valid JSON text: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("structured", f"json must be a JSON schema object, got {type(schema).__name__}")
    try:  # what `cache_key` writes: a peer's msgpack may carry bytes, mixed-type keys or too deep a nesting
        json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError("structured", f"json must be a JSON schema of JSON values: {exc}") from None
