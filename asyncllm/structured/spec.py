"""`StructuredOutputs`: the constraint a request's output must follow (a JSON schema, a regex, choices, a grammar).

Pure data and validation: importing it never loads xgrammar or torch, so the
host and `SamplingParams` carry it freely. The core compiles it
(`asyncllm/structured/compiler.py`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from asyncllm.config_checks import is_int
from asyncllm.errors import InvalidRequestError

__all__ = ["KINDS", "StructuredOutputs", "looks_like_lark"]

KINDS = ("json", "regex", "choice", "grammar")
"""The kinds of constraint, `StructuredOutputs`' fields (vLLM's `StructuredOutputsParams` names them so too)."""


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True, frozen=True):
    """Exactly one of the fields: what the generated text must match (vLLM's `StructuredOutputsParams`)."""

    json: dict[str, Any] | str | None = None
    """A JSON schema (a dict, or its JSON text): the output is one JSON value valid against it, its object keys in
    the schema's order. The host sends it to the core as text (`for_core`)."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's GBNF dialect, start rule ``root``), or a Lark grammar (start rule ``start``),
    told apart as vLLM does (`looks_like_lark`)."""
    start_after: str | None = None
    """The constraint starts once the output has written this text (a reasoning model's ``</think>``):
    what comes before is free. Already in the end of the prompt, it starts at once."""
    start_after_token_ids: list[int] = []
    """`start_after` as token ids; the engine fills them from `start_after`."""
    start_after_suffix: str | None = None
    """With `start_after`: the constraint starts once the output has written `start_after`, then this text with
    fewer than `start_after_max_between` tokens between (gpt-oss's ``<|channel|>final`` ... ``<|message|>``, as
    vLLM's openai_gptoss reasoning parser reads the end of reasoning)."""
    start_after_suffix_token_ids: list[int] = []
    """`start_after_suffix` as token ids; the engine fills them from `start_after_suffix`."""
    start_after_max_between: int = 0
    """With a suffix: tokens between `start_after` and the suffix are fewer than this (at least 1)."""
    start_after_only_if_opened: bool = False
    """With `start_after`: wait for it only when the prompt's end opened it (its opener, ``<think>``), else start at
    once: a request that turned the thinking off (`Marker.starts_answer`)."""
    start_after_only_if_reply_opens: bool = False
    """With `start_after`: wait for it only when the output's first token is its opener (`start_after_opener`, one
    token: mistral's ``[THINK]``); any other first token is the constraint's, which applies from the start (that
    token is sampled from the grammar's tokens and the opener). An opener of several tokens: always wait. The engine
    drops the flag when the prompt's end opened it (`Marker.opened_by`: GLM-4.7's template): the output waits."""
    start_after_opener_after_space: bool = False
    """With `start_after_only_if_reply_opens`: whitespace tokens before the output's first other token do not decide
    (GLM-4.5 writes ``\\n<think>``): they are free (the first rows also allow them) and not the grammar's, whose text
    starts at the first other token."""
    start_after_opener_token_ids: list[int] = []
    """With `start_after_only_if_reply_opens`: the opener's token id (at most one); the engine fills it from
    `start_after_opener` when it is one token, also when `start_after_token_ids` are given."""
    start_after_opener: str | None = None
    """With `start_after` (not with a suffix): the text that opens what it closes (`Marker.opener`: thinking opened
    again after it, opened by the prompt's end, the reply's first token); the server gives its reasoning parser's
    (`ReasoningParser.opener`, Hunyuan-A13B's ``<think>\\n`` for ``</think>\\n<answer>\\n``). None: `start_after`
    without its first "/" (``<think>`` for ``</think>``)."""

    @property
    def kind(self) -> str:
        """Which field is set: 'json', 'regex', 'choice' or 'grammar' (after `validate`)."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    def validate(self) -> None:
        """Raise `InvalidRequestError` on 'structured' unless exactly one well-formed field is set."""
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise InvalidRequestError("structured", f"set exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if self.start_after is not None and (not isinstance(self.start_after, str) or not self.start_after):
            raise InvalidRequestError("structured", "start_after must be a non-empty string")
        self._check_start_after()
        kind = given[0]
        if kind == "json":
            _check_schema(self.json)
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError("structured", "choice must be a non-empty list of non-empty strings")
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise InvalidRequestError("structured", f"{kind} must be a non-empty string")
        if kind != "json":
            _check_size(kind, self.cache_key()[1])

    def _check_start_after(self) -> None:
        for name in ("start_after_token_ids", "start_after_suffix_token_ids", "start_after_opener_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids):
                raise InvalidRequestError("structured", f"{name} must be a list of token ids >= 0")
        if self.start_after_suffix is not None and (not isinstance(self.start_after_suffix, str)
                                                    or not self.start_after_suffix or self.start_after is None):
            raise InvalidRequestError("structured", "start_after_suffix must be a non-empty string after a start_after")
        for name in ("start_after_only_if_opened", "start_after_only_if_reply_opens", "start_after_opener_after_space"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError("structured", f"{name} must be a boolean")
            if getattr(self, name) and self.start_after is None:
                raise InvalidRequestError("structured", f"{name} needs a start_after")
        self._check_opener()
        between = self.start_after_max_between
        if not isinstance(between, int) or isinstance(between, bool) or between < 0:
            raise InvalidRequestError("structured", "start_after_max_between must be an integer >= 0")
        if (self.start_after_suffix is not None or self.start_after_suffix_token_ids) and between < 1:
            raise InvalidRequestError("structured", "start_after_max_between must be at least 1 with a suffix")

    def _check_opener(self) -> None:
        opener = self.start_after_opener
        if opener is not None and (not isinstance(opener, str) or not opener or self.start_after is None
                                   or self.start_after_suffix is not None):
            raise InvalidRequestError("structured", "start_after_opener must be a non-empty string after a "
                                                    "start_after without a start_after_suffix")
        if len(self.start_after_opener_token_ids) > 1:
            raise InvalidRequestError("structured", "start_after_opener_token_ids holds at most one token id (an "
                                                    "opener of several tokens: the constraint always waits)")
        for name in ("start_after_opener_token_ids", "start_after_opener_after_space"):
            if getattr(self, name) and not self.start_after_only_if_reply_opens:
                raise InvalidRequestError("structured", f"{name} needs start_after_only_if_reply_opens")

    def for_core(self) -> StructuredOutputs:
        """This constraint with its JSON schema as text: msgpack carries no integer beyond 64 bits, JSON text does."""
        if not isinstance(self.json, dict):
            return self
        return msgspec.structs.replace(self, json=json.dumps(self.json))

    def cache_key(self) -> tuple[str, str]:
        """(kind, text): equal constraints share one compiled grammar (a schema's text as given, key order kept)."""
        kind = self.kind
        if kind == "json":  # the schema's key order is kept: xgrammar writes the properties in it (vLLM's too)
            return kind, self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, getattr(self, kind)


def _check_schema(schema: object) -> None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's recursion limit
            raise InvalidRequestError("structured", f"json is not valid JSON text: {exc}") from None
    if not isinstance(schema, dict):  # a boolean schema (true, false) too: xgrammar compiles objects only
        raise InvalidRequestError("structured", f"json must be a JSON schema object, got {type(schema).__name__}")
    try:  # JSON values only: a peer's msgpack may carry bytes, too deep a nesting, or mixed-type keys (2 and "2"
        json.dumps(schema, sort_keys=True)  # would be one JSON key: sorting them refuses them)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError("structured", f"json must be a JSON schema of JSON values: {exc}") from None
    if _nesting(schema) > MAX_SCHEMA_NESTING:
        raise InvalidRequestError("structured", f"json is nested deeper than {MAX_SCHEMA_NESTING} levels of objects "
                                                "and arrays (xgrammar's compile time grows steeply with the depth)")
    for pattern in _patterns(schema):
        _check_size("json schema's pattern", pattern)
    try:
        keyword = _unenforced_keyword(schema)
    except RecursionError:
        raise InvalidRequestError("structured", "json is nested deeper than Python's recursion limit") from None
    if keyword is not None:
        raise InvalidRequestError("structured", f"json uses {keyword}, which xgrammar does not enforce (vLLM refuses "
                                                "it too with its xgrammar backend): remove it, or check it yourself")


MAX_SCHEMA_NESTING = 128
"""Most levels of JSON objects and arrays in a schema (about 64 nested subschemas): deeper, xgrammar's compile takes
seconds to minutes a schema, runs on after its request's timeout, and a few such requests would hold every compile
thread (asyncllm's bound; vLLM has none)."""


def _nesting(value: object) -> int:
    """How many objects and arrays deep `value` nests (a scalar: 0), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        level.extend((child, depth + 1) for child in children)
    return deepest


def _patterns(schema: object) -> list[str]:
    """The regexes of `schema` and its subschemas: ``pattern`` values and ``patternProperties`` keys (no recursion)."""
    found, level = [], [schema]
    while level:
        item = level.pop()
        if isinstance(item, dict):
            found += [item["pattern"]] if isinstance(item.get("pattern"), str) else []
            found += list(item["patternProperties"]) if isinstance(item.get("patternProperties"), dict) else []
            level.extend(item.values())
        elif isinstance(item, list):
            level.extend(item)
    return found


MAX_GRAMMAR_CHARS = 100_000
"""Most characters in a regex, a grammar, or a choice list's JSON text. xgrammar's compile time grows faster than the
text. Measured with xgrammar 0.2.9 and a 32,000-token vocabulary on 2 CPU cores shared with other jobs (load average
7 to 10: several times an idle core's times): 100,000 characters compile in about 2 s (a literal regex, an alternation
of 10,000 words, 10,000 choices); 200,000 of a literal in 7.5 s, 450,000 of an alternation in 17.5 s, 600,000 of
choices in 20 s, an EBNF grammar of 330,000 (10,000 rules) in 26 s, a literal of 1,000,000 in over 40 s, running on
after its request's timeout (asyncllm's bound; vLLM has none)."""

MAX_REPETITION = 10_000
"""Largest count of a bounded repetition (``{n}``, ``{n,}``, ``{m,n}``; Lark's ``~ n``, ``~ m..n``). xgrammar 0.2
compiles any count like 1,000 (``[a-z]{1,1000000000}`` in 6 s), but the 0.1 releases pyproject allows expand the
item once per count: with 0.1.21, ``(a|b){1000}`` 1 s, ``[a-z]{1,1000}`` 15 s, ``(a|b){10000}`` and ``[a-z]{1,10000}``
over 30 s, a count of millions its memory's worth (same measurements)."""

_COUNTS = {False: re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}"),
           True: re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")}
"""A bounded repetition's counts: ``{n}``, ``{n,}``, ``{m,n}`` (not escaped); in a grammar Lark's ``~ n``, ``~ m..n``."""
_QUOTED = re.compile(r'"(?:\\.|[^"\\])*"')
"""A grammar's quoted string: its braces are its text."""


def _check_size(kind: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        what = "choice list's JSON text" if kind == "choice" else kind
        raise InvalidRequestError("structured", f"the {what} is longer than {MAX_GRAMMAR_CHARS} characters "
                                                f"(MAX_GRAMMAR_CHARS; xgrammar's compile time grows steeply with it)")
    if kind == "choice":
        return
    grammar = kind == "grammar"
    counted = _QUOTED.sub('""', text) if grammar else text
    counted = counted.replace("\\\\", "_")  # an escaped backslash (``\\{n}`` repeats it): no brace's escape
    largest = max((int(n) for match in _COUNTS[grammar].finditer(counted) for n in match.groups() if n), default=0)
    if largest > MAX_REPETITION:
        raise InvalidRequestError("structured", f"the {kind} repeats an item {largest} times, more than "
                                                f"{MAX_REPETITION} (MAX_REPETITION)")


_STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                             "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
"""The string formats xgrammar builds (vLLM's STRING_SUPPORTED_FORMATS)."""
_ARRAY_UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains")


def _unenforced_keyword(schema: object) -> str | None:
    """The first keyword of `schema` (or a subschema) that xgrammar compiles but does not enforce, as vLLM's
    `has_xgrammar_unsupported_json_features` finds them (vLLM refuses such a schema with no fallback backend)."""
    if not isinstance(schema, dict):
        return None
    found = _unenforced_here(schema)
    if found is not None:
        return found
    for value in schema.values():
        for sub in value if isinstance(value, list) else [value]:
            found = _unenforced_keyword(sub)
            if found is not None:
                return found
    return None


def _unenforced_here(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(kind, list) \
        else set()
    if types & {"integer", "number"} and "multipleOf" in schema:
        return "'multipleOf'"
    if "array" in types:
        found = next((k for k in _ARRAY_UNENFORCED if k in schema), None)
        if found is not None:
            return f"{found!r} on an array"
    fmt = schema.get("format")
    if "string" in types and "format" in schema and not (isinstance(fmt, str) and fmt in _STRING_FORMATS):
        return f"string format {fmt!r}"
    if "string" in types and _generative_with_length(schema):
        return "'pattern' or 'format' together with 'minLength' or 'maxLength'"
    if "object" not in types:
        return None
    names = schema.get("propertyNames")
    if isinstance(names, dict) and _generative_with_length(names):
        return "'propertyNames' with 'pattern' or 'format' and 'minLength' or 'maxLength'"
    if "propertyNames" in schema and ("properties" in schema or "patternProperties" in schema or isinstance(
            schema.get("additionalProperties"), dict) or schema.get("unevaluatedProperties", True) is not True):
        return "'propertyNames' together with properties, patternProperties, additionalProperties or " \
               "unevaluatedProperties"
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict) and ("properties" in schema or len(patterns) > 1):
        return "'patternProperties' with more than one pattern or together with 'properties'"
    return None


def _generative_with_length(schema: dict[str, Any]) -> bool:
    return ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema)


def looks_like_lark(grammar: str) -> bool:
    """Whether `grammar` is Lark, not EBNF: vLLM's `grammar_is_likely_lark` (no line, comments (# or //) removed,
    holds an EBNF '::=')."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))
