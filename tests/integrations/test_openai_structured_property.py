"""Property test: a /v1/completions or /v1/chat/completions body's ``response_format`` and ``structured_outputs``
become the `StructuredOutputs` vLLM's OpenAI server would build, or a 400 naming the field it refuses.

The reference is written from vLLM's server, not from asyncllm's code: chat_completion/protocol.py and
completion/protocol.py (``validate_response_format``: a ``json_schema`` type without ``json_schema``;
``check_structured_outputs_count``; ``to_sampling_params`` through generate/base/protocol.py's
``structured_outputs_from_response_format``: ``json_object`` -> ``json_object=True``, ``json_schema`` -> its
``schema``), the pydantic models there (``ResponseFormat``: type ``text`` / ``json_object`` / ``json_schema``, its
``json_schema`` read whatever the type: ``name`` a required string, ``schema`` an object or null, ``strict`` a lax
bool) and sampling_params.py's ``StructuredOutputsParams`` (exactly one of json, regex, choice, grammar, json_object,
structural_tag; json a dict or JSON text). asyncllm's documented differences (docs/integrations/openai-server.md
"Structured output", docs/sampling.md's ``structured`` row) are the reference's too:

* a key OpenAI does not define in ``response_format`` (of the three types) or its ``json_schema`` is a 400 naming
  ``response_format.<key>`` / ``response_format.json_schema.<key>`` (vLLM ignores it); type ``structural_tag`` is
  refused as ``response_format``;
* ``response_format`` other than ``text`` together with ``structured_outputs`` is a 400 naming
  ``structured_outputs`` (vLLM merges same-kind pairs);
* in ``structured_outputs``: null, false (but for json, regex, choice, grammar; ``json_object`` 0 is pydantic's false)
  and private (``_backend``) values are unset; ``backend`` ``auto`` / ``xgrammar`` is dropped, another refused; a key
  not built (``whitespace_pattern``, ``structural_tag``, ``disable_any_whitespace: true``, unknown ones) is refused
  (vLLM ignores unknown ones); ``json_object`` true (or 1) is the schema ``{"type": "object"}``; asyncllm's own
  ``start_after`` is taken as given; the kind's value passes `StructuredOutputs.validate` (a non-empty regex or
  grammar, a non-empty choice list of non-empty strings, a schema object or its JSON text without a keyword xgrammar
  does not enforce, as vLLM's xgrammar backend refuses it).

Drawn: ``response_format`` absent, null, junk, or a dict of a drawn type with OpenAI's keys and others, its
``json_schema`` absent, null, junk or a dict of name / schema / strict / description (good and bad values) and the
``json_schema`` spelling of ``schema``; ``structured_outputs`` absent, null, junk, or a dict of zero to four keys
(each kind, json_object, backend, vLLM's options, ``_backend``, ``start_after``, an unknown key) with good, bad,
null and false values; either endpoint. The body is decoded by `decode_request` and mapped by `completion_params` /
`chat_params`; a refusal must be an `InvalidRequestError` naming one of the fields the reference found bad (exactly
that one when only one is). Not drawn: regexes and grammars only the core's compile refuses
(test_openai_structured.py), tools, ``min_tokens``. ``PROP_EXAMPLES`` raises the number of draws (random ones).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_protocol import ChatCompletionRequest, CompletionRequest, ServerLimits, decode_request
from asyncllm.integrations.openai_sampling import chat_params, completion_params
from asyncllm.sampling import StructuredOutputs

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "400"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize="PROP_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow])

MISSING = object()
"""A body field left out (None is JSON null)."""
LIMITS = ServerLimits()
OBJECT = {"type": "object"}

# --------------------------------------------------------------------------------------------------- drawn values

GOOD_SCHEMAS = [OBJECT, {}, {"type": "string", "maxLength": 3}, {"type": "array", "items": {"type": "integer"}},
                {"enum": ["a", 1]}, {"type": "object", "properties": {"z": {"type": "boolean"}}, "required": ["z"]}]
GOOD_SCHEMA_TEXTS = ['{"type": "integer"}', "{}"]
"""JSON text of a schema object: vLLM's ``json: str | dict`` (structured_outputs only: response_format's is a dict)."""
UNENFORCED = [{"type": "array", "uniqueItems": True}, {"type": "integer", "multipleOf": 2},
              {"type": "string", "format": "bogus-format"}]
"""Schemas vLLM's xgrammar backend refuses (``has_xgrammar_unsupported_json_features``)."""
JUNK_SCHEMAS = [True, False, 3, [], ["a"], "not json", "[1]", "3"]
GOOD = {
    "json": GOOD_SCHEMAS + GOOD_SCHEMA_TEXTS,
    "regex": ["[a-z]+", "a|b", r"\d{2}"],
    "choice": [["yes", "no"], ["a"]],
    "grammar": ['root ::= "x"', 'start: "x"'],
}
BAD = {
    "json": UNENFORCED + JUNK_SCHEMAS,
    "regex": ["", 3, ["a"], False],
    "choice": [[], "yes", ["a", 3], [""], False, [None]],
    "grammar": ["", 5, False],
}
OTHER_VALUES = {
    "json_object": [True, False, 1, 0, 2, [], "x"],
    "backend": ["auto", "xgrammar", "outlines", "guidance", 3],
    "whitespace_pattern": [" ", False],
    "structural_tag": ['{"type": "structural_tag"}', False],
    "disable_any_whitespace": [True, False],
    "disable_additional_properties": [True, False],
    "_backend": ["xgrammar", "x"],
    "start_after": ["</think>", "", 7],
    "bogus": [1, "x", False],
}
SO_KEYS = sorted([*GOOD, *OTHER_VALUES])
JUNK = st.sampled_from([3, "json_object", [], ["x"], True, 1.5])


def so_value(key: str) -> st.SearchStrategy[Any]:
    """A value of a `structured_outputs` key: mostly a good one for a kind, else bad, null or (a kind) false."""
    if key in GOOD:
        return st.one_of(st.sampled_from(GOOD[key]), st.sampled_from(GOOD[key]), st.sampled_from(BAD[key]),
                         st.none())
    return st.one_of(st.sampled_from(OTHER_VALUES[key]), st.none())


@st.composite
def wild_structured_outputs(draw: st.DrawFn) -> Any:
    """Null, junk, or a dict of up to two kinds and two other keys, good and bad values."""
    shape = draw(st.sampled_from(["null", "junk", "dict", "dict", "dict", "dict"]))
    if shape != "dict":
        return None if shape == "null" else draw(JUNK)
    kinds = draw(st.lists(st.sampled_from(sorted(GOOD)), max_size=2, unique=True))
    others = draw(st.lists(st.sampled_from(SO_KEYS), max_size=2, unique=True))
    return {key: draw(so_value(key)) for key in dict.fromkeys([*kinds, *others])}


@st.composite
def clean_structured_outputs(draw: st.DrawFn) -> dict[str, Any]:
    """One kind with a good value (or json_object), and maybe start_after and values read as unset."""
    kind = draw(st.sampled_from([*sorted(GOOD), "json_object"]))
    value = {kind: draw(st.sampled_from([True, 1]) if kind == "json_object" else st.sampled_from(GOOD[kind]))}
    extra = draw(st.sampled_from([{}, {}, {"start_after": "</think>"}, {"backend": "xgrammar"}, {"regex": None},
                                  {"json_object": False}, {"disable_any_whitespace": False}, {"_backend": "x"}]))
    return {**value, **{k: v for k, v in extra.items() if k != kind}}


JUNK_SCHEMA = st.sampled_from([*UNENFORCED, *JUNK_SCHEMAS, None, '{"type": "object"}'])
SCHEMA = st.one_of(st.sampled_from(GOOD_SCHEMAS), JUNK_SCHEMA)
WILD_JSON_SCHEMA = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["ab", "ab", "", 3, None]), "schema": SCHEMA,
    "strict": st.sampled_from([True, False, None, "true"]), "description": st.sampled_from(["d", None]),
    "json_schema": SCHEMA, "extra": st.just(1)})
CLEAN_JSON_SCHEMA = st.fixed_dictionaries(
    {"name": st.sampled_from(["ab", ""]), "schema": st.sampled_from(GOOD_SCHEMAS)},
    optional={"strict": st.sampled_from([True, False, None, "true"]), "description": st.sampled_from(["d", None])})

ONE_KEY_MORE = st.builds(lambda spec, key: {**spec, key: 1}, CLEAN_JSON_SCHEMA,
                         st.sampled_from(["json_schema", "type", "extra"]))
"""A good json_schema with one key OpenAI does not define."""
NO_SCHEMA = st.sampled_from([{"name": "ab"}, {"name": "ab", "schema": None}, {"name": "ab", "strict": True}])
"""A json_schema without a schema: no constraint (vLLM's StructuredOutputsParams refuses none)."""


@st.composite
def clean_response_format(draw: st.DrawFn) -> dict[str, Any]:
    """OpenAI's three types, json_schema's with a good schema."""
    kind = draw(st.sampled_from(["json_schema", "json_schema", "json_object", "text"]))
    if kind == "json_schema" or draw(st.integers(0, 3)) == 0:
        return {"type": kind, "json_schema": draw(CLEAN_JSON_SCHEMA)}
    return {"type": kind}


@st.composite
def odd_json_schema_format(draw: st.DrawFn) -> dict[str, Any]:
    """One of OpenAI's three types with a json_schema vLLM's model or asyncllm refuses, or one without a schema."""
    kind = draw(st.sampled_from(["json_schema", "json_schema", "json_object", "text"]))
    spec = draw(st.one_of(NO_SCHEMA, ONE_KEY_MORE, WILD_JSON_SCHEMA, st.just({}), JUNK))
    return {"type": kind, "json_schema": spec}


@st.composite
def wild_response_format(draw: st.DrawFn) -> Any:
    """Null, junk, a good one with a key more, or a dict of a drawn type, json_schema (a wild one, null, junk or
    none) and maybe another key."""
    shape = draw(st.sampled_from(["null", "junk", "key more", "dict", "dict", "dict", "dict"]))
    if shape == "key more":  # a good one with a key OpenAI does not define
        return {**draw(clean_response_format()), draw(st.sampled_from(["schema", "strict", "name", "foo"])): "x"}
    if shape != "dict":
        return None if shape == "null" else draw(JUNK)
    value: dict[str, Any] = {}
    kind = draw(st.sampled_from(["json_schema", "json_schema", "json_object", "text", "structural_tag", "xml", None,
                                 3, MISSING]))
    if kind is not MISSING:
        value["type"] = kind
    spec = draw(st.one_of(WILD_JSON_SCHEMA, WILD_JSON_SCHEMA, CLEAN_JSON_SCHEMA, ONE_KEY_MORE, NO_SCHEMA,
                          st.just(MISSING), st.none(), JUNK))
    if spec is not MISSING:
        value["json_schema"] = spec
    for key in draw(st.lists(st.sampled_from(["schema", "strict", "name", "foo"]), max_size=1)):
        value[key] = draw(SCHEMA) if key == "schema" else "x"
    return value


def field(clean: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: clean two draws in three, else wild."""
    return st.one_of(clean, clean, wild)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[Any, Any]:
    """(response_format, structured_outputs), MISSING when left out: mostly one of them, sometimes both or neither."""
    present = draw(st.sampled_from(["rf", "rf", "rf", "so", "so", "so", "both", "neither"]))
    rf = draw(st.one_of(field(clean_response_format(), wild_response_format()), odd_json_schema_format())) \
        if present in ("rf", "both") else MISSING
    so = draw(field(clean_structured_outputs(), wild_structured_outputs())) if present in ("so", "both") else MISSING
    return rf, so


# ---------------------------------------------------------------------------------------------------- the reference


def schema_ok(value: Any, text_too: bool) -> bool:
    """A schema vLLM compiles with xgrammar: an object (or, in structured_outputs, its JSON text) that uses no
    keyword xgrammar leaves unenforced."""
    if isinstance(value, str) and text_too:
        try:
            value = json.loads(value)
        except ValueError:
            return False
    return isinstance(value, dict) and value not in UNENFORCED


def kind_ok(kind: str, value: Any) -> bool:
    if kind == "json":
        return schema_ok(value, text_too=True)
    if kind == "choice":
        return isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)
    return isinstance(value, str) and bool(value)


def response_format_reference(rf: Any) -> tuple[StructuredOutputs | None, set[str]]:
    """What ``response_format`` alone asks for, and the fields a 400 may name (empty: none)."""
    if not isinstance(rf, dict):
        return None, {"response_format"}
    kind, spec = rf.get("type"), rf.get("json_schema")
    bad = set()
    if kind in ("text", "json_object", "json_schema"):  # OpenAI's keys only (asyncllm's documented refusal)
        bad |= {f"response_format.{key}" for key in rf if key not in ("type", "json_schema")}
        if isinstance(spec, dict):
            bad |= {f"response_format.json_schema.{key}" for key in spec
                    if key not in ("name", "schema", "strict", "description")}
    else:  # vLLM's union refuses another type; structural_tag is not built (documented)
        bad.add("response_format")
    if spec is not None and not (isinstance(spec, dict) and isinstance(spec.get("name"), str)
                                 and (spec.get("schema") is None or isinstance(spec["schema"], dict))):
        bad.add("response_format")  # JsonSchemaResponseFormat, read whatever the type
    if kind == "json_schema" and not (isinstance(spec, dict) and schema_ok(spec.get("schema"), text_too=False)):
        bad.add("response_format")  # no json_schema, no schema (no constraint then) or one vLLM refuses
    if bad:
        return None, bad
    if kind == "text":
        return None, set()
    return StructuredOutputs(json=OBJECT if kind == "json_object" else spec["schema"]), set()


def unset(key: str, value: Any) -> bool:
    """A `structured_outputs` value vLLM and asyncllm read as not given (asyncllm: a non-kind's false too)."""
    if value is None or key.startswith("_"):
        return True
    if key == "json_object":
        return value is False or value == 0 and type(value) is int
    return value is False and key not in GOOD or key == "backend" and value in ("auto", "xgrammar")


def structured_outputs_reference(so: Any) -> tuple[StructuredOutputs | None, set[str]]:
    if not isinstance(so, dict):
        return None, {"structured_outputs"}
    given = {key: value for key, value in so.items() if not unset(key, value)}
    json_object = given.pop("json_object", False)
    start_after = given.pop("start_after", None)
    kinds = sorted(given.keys() & GOOD.keys()) + (["json_object"] if json_object is not False else [])
    refused = (set(given) - GOOD.keys() or len(kinds) != 1 or json_object not in (False, True, 1)
               or start_after is not None and not (isinstance(start_after, str) and start_after)
               or kinds[0] in GOOD and not kind_ok(kinds[0], given[kinds[0]]))
    if refused:
        return None, {"structured_outputs"}
    fields = {"json": OBJECT} if kinds == ["json_object"] else {kinds[0]: given[kinds[0]]}
    return StructuredOutputs(**fields, **({} if start_after is None else {"start_after": start_after})), set()


def reference(rf: Any, so: Any) -> tuple[StructuredOutputs | None, set[str]]:
    """The request's constraint, and the fields one of which a 400 names (empty: accepted)."""
    expected, bad = None, set()
    if rf is not MISSING and rf is not None:
        expected, bad = response_format_reference(rf)
    if so is not MISSING and so is not None:
        expected, so_bad = structured_outputs_reference(so)
        bad |= so_bad
        if isinstance(rf, dict) and rf.get("type") != "text":  # one constraint per request (documented)
            bad.add("structured_outputs")
    return (None if bad else expected), bad


# ------------------------------------------------------------------------------------------------------- the check


def admitted(endpoint: str, rf: Any, so: Any) -> StructuredOutputs | None:
    """The server's constraint for a body with these fields (`InvalidRequestError` when refused)."""
    body: dict[str, Any] = {"max_tokens": 4}
    body.update({"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    body.update({name: value for name, value in (("response_format", rf), ("structured_outputs", so))
                 if value is not MISSING})
    raw = json.dumps(body).encode()
    if endpoint == "completions":
        return completion_params(decode_request(raw, CompletionRequest), LIMITS).structured
    return chat_params(decode_request(raw, ChatCompletionRequest), LIMITS).structured


def check(endpoint: str, rf: Any, so: Any) -> None:
    expected, bad = reference(rf, so)
    try:
        structured = admitted(endpoint, rf, so)
    except InvalidRequestError as exc:
        assert bad, f"refused a valid request: {exc}"
        assert exc.field in bad, f"{exc} names {exc.field!r}, expected one of {sorted(bad)}"
        return
    assert not bad, f"accepted a request with bad {sorted(bad)}: {structured}"
    assert structured == expected, (structured, expected)


@SETTINGS
@given(endpoint=st.sampled_from(["completions", "chat"]), fields=bodies())
def test_constraint_is_vllms_or_a_400_naming_the_field(endpoint: str, fields: tuple[Any, Any]) -> None:
    check(endpoint, *fields)


# ----------------------------------------------------------------------------------- json_schema's model (the fix)


@pytest.mark.parametrize("spec", [
    {"schema": OBJECT},  # no name: OpenAI's and vLLM's JsonSchemaResponseFormat require it
    {"name": 3, "schema": OBJECT},
    {"name": None, "schema": OBJECT},
    {"name": "x", "schema": '{"type": "object"}'},  # JSON text: vLLM's schema is a dict
    {"name": "x", "schema": ["a"]},
])
@pytest.mark.parametrize("kind", ["json_schema", "json_object", "text"])  # vLLM reads json_schema whatever the type
def test_a_json_schema_vllm_refuses_is_a_400_naming_response_format(kind: str, spec: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as error:
        admitted("chat", {"type": kind, "json_schema": spec}, MISSING)
    assert error.value.field == "response_format"


def test_a_json_schema_vllm_takes_is_taken() -> None:
    spec = {"name": "", "schema": {"type": "string"}, "strict": "true", "description": None}  # pydantic's lax bool
    assert admitted("completions", {"type": "json_schema", "json_schema": spec}, MISSING) == \
        StructuredOutputs(json={"type": "string"})
    assert admitted("completions", {"type": "json_object", "json_schema": {"name": "x", "schema": None}},
                    MISSING) == StructuredOutputs(json=OBJECT)
