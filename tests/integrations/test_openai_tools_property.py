"""Property test: tool calling's request checks, constraints and template tools (integrations/openai_tools.py), and
how a named or ``required`` choice's constrained reply is read back (`ChatReply`), against vLLM's OpenAI server.

The reference is written from vLLM's code (vllm-project/vllm), not from asyncllm's:

- refusals: ``ChatCompletionRequest.check_tool_usage`` (a ``tool_choice`` other than ``"none"`` needs ``tools``; only
  ``"auto"``, ``"required"`` or a named-function object; the object's ``function`` a dict with a non-empty str
  ``name`` among the tools) and the pydantic types (``ChatCompletionToolsParam``: ``type`` ``"function"``, left out
  as ``"function"``; ``FunctionDefinition``: str ``name``, ``description`` str or null, ``parameters`` object or null;
  ``ChatCompletionNamedToolChoiceParam``: ``type`` ``"function"`` or left out); serving's 400 for ``"auto"`` on a
  server without ``--enable-auto-tool-choice --tool-call-parser``; ``get_json_schema_from_tools``' ValueError for two
  tools defining one ``$defs`` name differently (a ``$defs`` that is no object crashes vLLM: here a 400 on tools).
  A request bad in both fields may be refused naming either (vLLM's validator checks ``tool_choice`` first).
- constraints: ``get_json_schema_from_tools``: a named choice is its function's ``parameters``; ``"required"`` a
  JSON array of at least one object, any of ``{"name": enum [the name], "parameters": its schema (``{"type":
  "object", "properties": {}}`` when null or empty)}`` with both required, each tool's ``$defs`` lifted to the root.
  vLLM compiles them with xgrammar, whose strict mode closes an object schema that has ``properties`` and no
  ``additionalProperties``; the schemas are compared as the sets of JSON values they accept under that reading,
  with `jsonschema`, on the calls a reply could hold (each tool's name and a stranger's, with a pool of arguments).
- template tools: ``ChatCompletionToolsParam(**tool).model_dump()`` (``extra="allow"``): ``type``, ``function``
  (``name``, ``description``, ``parameters``, then its extra keys), then the tool's extra keys, in that order.
- reading back: a named choice's whole text is the call's ``arguments`` (finish_reason ``"stop"``); ``"required"``
  text is read as ``list[FunctionDefinition]``, each call's ``arguments`` ``json.dumps(parameters,
  ensure_ascii=False)``, finish_reason ``"tool_calls"``; ``parallel_tool_calls: false`` keeps the first call
  (``maybe_filter_parallel_tool_calls``: only an explicit false; null is parallel).

Documented asyncllm readings the reference takes (docs/integrations/openai-server.md "Tool calling" and
openai_tools.py): ``tools: []`` with ``"auto"`` or ``"required"`` is ``"none"`` (current vLLM refuses ``tools: []``);
``parallel_tool_calls: false`` also sets ``maxItems: 1`` on the ``"required"`` array (vLLM lets the model write more
and drops them); a named choice of a function without (or with empty) ``parameters`` is constrained to ``{}`` as
``"required"`` constrains it (vLLM leaves that output unconstrained). A ``tool_choice`` of null cannot be told from
one left out here (both None: the default).

Drawn: tools (``None``, ``[]``, a non-list, or 1-3 tools, good or broken: names from a small pool so that two tools
may share one, ``type`` left out, descriptions, parameters left out, null, empty, plain, closed, open,
non-object, pydantic-style with ``$defs``, a conflicting or empty or broken ``$defs``; extra keys on the function and
the tool), ``tool_choice`` (left out, ``"none"``, ``"auto"``, ``"required"``, named objects of the tools' names or
others, with ``type`` left out or wrong, a broken ``function``; junk), ``parallel_tool_calls`` (None, True, False)
and the server's parser (none, ``hermes``, ``mistral``: its 9-character call ids).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import template_tools, tool_mode
from asyncllm.tool_calls import get_tool_parser

jsonschema = pytest.importorskip("jsonschema")

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "100"))
NAMES = ("get_weather", "add", "now")
STRANGER = "nope"

UNIT = {"type": "string", "enum": ["c", "f"]}
PARAMETERS = {
    "plain": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    "closed": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
               "additionalProperties": False},
    "open": {"type": "object"},
    "empty": {},
    "string": {"type": "string"},
    "pydantic": {"$defs": {"Unit": UNIT}, "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}},
                 "required": ["unit"]},
    "conflicting": {"$defs": {"Unit": {"type": "integer"}}, "type": "object",
                    "properties": {"unit": {"$ref": "#/$defs/Unit"}}},
    "no_defs": {"$defs": {}, "type": "object", "properties": {"a": {"type": "integer"}}},
    "broken_defs": {"$defs": ["Unit"], "type": "object", "properties": {}},
}
ARGUMENTS = ({}, {"a": 1}, {"a": "x"}, {"a": 1, "b": 2}, {"b": 2}, {"unit": "c"}, {"unit": "k"}, {"unit": 3}, "c",
             None, [])
"""The ``parameters`` values of drawn calls: each schema above accepts some and refuses others."""


# ---------------------------------------------------------------- the reference, from vLLM's code
def tool_ok(tool: Any) -> bool:
    """vLLM's pydantic ``ChatCompletionToolsParam`` / ``FunctionDefinition`` accept it."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return False
    function = tool.get("function")
    return (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("description"), (str, type(None)))
            and isinstance(function.get("parameters"), (dict, type(None))))


def tools_ok(tools: Any) -> bool:
    return tools is None or isinstance(tools, list) and all(tool_ok(t) for t in tools)


def named_choice(choice: dict[str, Any]) -> str | None:
    """The function a named choice names, None when vLLM refuses the object itself."""
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        return None
    name = function.get("name")
    return name if isinstance(name, str) and name else None


def parameters_of(function: dict[str, Any]) -> dict[str, Any]:
    """What a call of the function must pass: its schema, ``{}``'s when it has none (vLLM's required branch)."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """vLLM's ``"required"`` schema; None where vLLM fails on the tools' ``$defs`` (conflict or not an object)."""
    branches, defs = [], {}
    for tool in tools:
        parameters = dict(parameters_of(tool["function"]))
        own = parameters.pop("$defs", {})
        if not isinstance(own, dict):
            return None
        for name, schema in own.items():
            if name in defs and defs[name] != schema:
                return None
            defs[name] = schema
        branches.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                        "parameters": parameters}, "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if defs:
        schema["$defs"] = defs
    return schema


def expected_mode(tools: Any, choice: Any, parallel: bool | None, parser: Any) -> dict[str, Any] | set[str]:
    """``{"kind", ...}`` for an accepted request, or the set of fields it may be refused naming."""
    bad = set() if tools_ok(tools) else {"tools"}
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or tools == [] and choice in ("auto", "required"):
        return bad or {"kind": "none"}
    if not tools or not (choice in ("auto", "required") or isinstance(choice, dict)):
        return bad | {"tool_choice"}
    if isinstance(choice, dict):
        name = named_choice(choice)
        names = [t["function"]["name"] for t in tools if tool_ok(t)] if isinstance(tools, list) else []
        if name is None or name not in names:
            return bad | {"tool_choice"}
    if bad:
        return bad
    if choice == "auto":
        return {"kind": "auto"} if parser is not None else {"tool_choice"}
    if choice == "required":
        schema = required_schema(tools)
        return {"tools"} if schema is None else {"kind": "required", "schema": schema}
    function = {t["function"]["name"]: t["function"] for t in tools}[name]  # the last of a name, as vLLM's map
    return {"kind": "named", "function": name, "schema": parameters_of(function)}


def dumped(tool: dict[str, Any]) -> dict[str, Any]:
    """``ChatCompletionToolsParam(**tool).model_dump()``: declared fields in order, then the extra keys."""
    function = tool["function"]
    out_function = {"name": function["name"], "description": function.get("description"),
                    "parameters": function.get("parameters")}
    out_function.update((k, v) for k, v in function.items() if k not in out_function)
    out = {"type": "function", "function": out_function}
    out.update((k, v) for k, v in tool.items() if k not in out)
    return out


def closed(schema: Any) -> Any:
    """`schema` as xgrammar's strict mode reads it: an object schema with ``properties`` is closed unless it says."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def calls_to_try(names: list[str], more: list[list[dict[str, Any]]]) -> list[Any]:
    """Replies a ``"required"`` choice could be checked on: each name with each arguments value, a call without
    ``parameters``, with an extra key, an empty list, not a list, and the drawn lists `more`."""
    singles = [[{"name": n, "parameters": a}] for n in [*names, STRANGER] for a in ARGUMENTS]
    return [*singles, [{"name": names[0]}], [{"name": names[0], "parameters": {}, "x": 1}], [], {}, *more]


# ---------------------------------------------------------------- what is drawn
def functions() -> st.SearchStrategy[dict[str, Any]]:
    parameters = st.one_of(st.just("missing"), st.none(), st.sampled_from(sorted(PARAMETERS)))
    return st.builds(_function, st.sampled_from(NAMES), st.sampled_from(["missing", None, "Weather"]), parameters,
                     st.sampled_from([{}, {"strict": True}, {"x-fn": [1]}]))


def _function(name: str, description: Any, parameters: Any, extra: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {**extra, "name": name} if extra.get("strict") else {"name": name, **extra}
    if description != "missing":
        function["description"] = description
    if parameters != "missing":
        function["parameters"] = copy.deepcopy(PARAMETERS.get(parameters)) if parameters else None
    return function


BROKEN_TOOLS = ["f", {"type": "custom", "function": {"name": "f"}}, {"type": None, "function": {"name": "f"}},
                {"function": "f"}, {"function": {}}, {"function": {"name": 5}}, {"type": "function"},
                {"function": {"name": "f", "description": 5}}, {"function": {"name": "f", "parameters": []}},
                {"function": {"name": "f", "parameters": "x"}}]


def good_tools() -> st.SearchStrategy[list[dict[str, Any]]]:
    tool = st.builds(lambda f, typed, extra: {**({"type": "function"} if typed else {}), "function": f, **extra},
                     functions(), st.booleans(), st.sampled_from([{}, {"x-tag": 1}]))
    return st.lists(tool, min_size=1, max_size=3)


def tools_lists() -> st.SearchStrategy[Any]:
    mixed = st.lists(st.one_of(good_tools().map(lambda tools: tools[0]), st.sampled_from(BROKEN_TOOLS)), min_size=1,
                     max_size=3)
    return st.one_of(good_tools(), mixed, st.sampled_from([None, [], {"type": "function", "function": {"name": "f"}},
                                                           "tools"]))


def choices(tools: Any) -> st.SearchStrategy[Any]:
    """Mostly a named choice of one of `tools`' names (the named-object rules are the ones with the most cases)."""
    names = sorted({t["function"]["name"] for t in tools if tool_ok(t)}) if isinstance(tools, list) else []
    name = st.one_of(st.sampled_from(names), st.sampled_from(names)) if names else st.nothing()
    name = st.one_of(name, st.sampled_from([STRANGER, "", 5]))
    named = st.builds(lambda n, type_, extra: {**type_, "function": {"name": n, **extra}}, name,
                      st.sampled_from([{"type": "function"}, {}, {"type": "function"}, {}, {"type": "custom"},
                                       {"type": None}]),
                      st.sampled_from([{}, {"description": "x"}]))
    broken = st.sampled_from([{"type": "function"}, {"type": "function", "function": "get_weather"},
                              {"type": "function", "function": {}}, {"type": "function", "function": {"nom": "add"}}])
    junk = st.sampled_from(["None", "any", "", True, 0, ["auto"], "function"])
    return st.one_of(st.none(), st.sampled_from(["none", "auto", "required", "required"]), named, named, broken, junk)


# ---------------------------------------------------------------- the checks
def check_refused_or_mode(tools: Any, choice: Any, parallel: bool | None, parser: Any) -> Any:
    expected = expected_mode(tools, choice, parallel, parser)
    try:
        mode = tool_mode(tools, choice, parallel, parser)
    except InvalidRequestError as exc:
        assert isinstance(expected, set), f"refused a request vLLM takes ({expected}): {exc}"
        assert exc.field in expected, f"{exc} names {exc.field!r}, expected one of {sorted(expected)}"
        return None
    assert isinstance(expected, dict), f"took a request vLLM refuses naming {sorted(expected)}: {mode}"
    assert mode.kind == expected["kind"], (mode.kind, expected)
    assert (mode.parser is not None) == (mode.kind == "auto")
    assert (mode.constraint is not None) == (mode.kind in ("named", "required"))
    if mode.kind in ("auto", "required"):
        assert mode.parallel is (parallel is not False)
    if mode.kind != "none" and parser is not None:
        assert mode.new_call_id == parser.new_call_id  # a named or required call's id is the parser's kind too
    if mode.kind == "named":
        assert mode.function == expected["function"] and mode.constraint.json == expected["schema"]
    return mode, expected


def check_required_schema(schema: dict[str, Any], reference: dict[str, Any], parallel: bool | None,
                          tries: list[Any]) -> list[Any]:
    """Both schemas accept the same replies (one call at most with ``parallel_tool_calls: false``): those they
    accept."""
    ours = jsonschema.Draft202012Validator(closed(schema))
    theirs = jsonschema.Draft202012Validator(closed(reference))
    jsonschema.Draft202012Validator.check_schema(schema)
    accepted = []
    for value in tries:
        expected = theirs.is_valid(value) and (parallel is not False or len(value) <= 1)
        assert ours.is_valid(value) == expected, (value, schema, reference)
        accepted += [value] if expected else []
    return accepted


def read_back(mode: Any, text: str, cuts: list[int]) -> tuple[dict[str, Any], str | None]:
    """The message and finish_reason of a reply whose text comes in pieces cut at `cuts`."""
    reply, deltas, start = ChatReply(mode), [], 0
    for cut in sorted(cuts) + [len(text)]:
        deltas += reply.feed(text[start:cut])
        start = max(start, cut)
    more, finish = reply.finish("stop")
    return merge_deltas(deltas + more, tools=True), finish


def check_ids(message: dict[str, Any], parser: Any) -> None:
    ids = [call["id"] for call in message["tool_calls"]]
    assert len(set(ids)) == len(ids)
    if parser is not None and parser.needs_special_tokens:  # mistral's: 9 letters and digits
        assert all(len(i) == 9 and i.isalnum() for i in ids), ids


def check_named_reply(mode: Any, arguments: Any, cuts: list[int], parser: Any) -> None:
    text = json.dumps(arguments, ensure_ascii=False)
    message, finish = read_back(mode, text, [c % (len(text) + 1) for c in cuts])
    assert finish == "stop" and message["content"] is None, message
    assert [(c["type"], c["function"]) for c in message["tool_calls"]] == [
        ("function", {"name": mode.function, "arguments": text})]
    check_ids(message, parser)


def check_required_reply(mode: Any, value: list[dict[str, Any]], parallel: bool | None, cuts: list[int],
                         parser: Any) -> None:
    text = json.dumps(value, ensure_ascii=False, indent=cuts[0] % 3 if cuts else None)
    message, finish = read_back(mode, text, [c % (len(text) + 1) for c in cuts])
    calls = [{"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)} for c in value]
    expected = calls if parallel is not False else calls[:1]
    assert finish == "tool_calls" and message["content"] is None, message
    assert [(c["type"], c["function"]) for c in message["tool_calls"]] == [("function", c) for c in expected]
    check_ids(message, parser)


def check_template_tools(tools: Any) -> None:
    if not tools_ok(tools):
        with pytest.raises(InvalidRequestError) as info:
            template_tools(tools)
        assert info.value.field == "tools"
        return
    out = template_tools(tools)
    expected = None if tools is None else [dumped(t) for t in tools]
    assert json.dumps(out) == json.dumps(expected), (out, expected)  # key order too: templates write it


PARSERS = {None: None, "hermes": get_tool_parser("hermes"), "mistral": get_tool_parser("mistral")}
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random


def check_request(tools: Any, choice: Any, parallel: bool | None, parser: Any, data: st.DataObject) -> None:
    """All of it for one request: its template tools, its refusal or mode, and its replies read back."""
    given_tools = copy.deepcopy(tools)
    check_template_tools(tools)
    outcome = check_refused_or_mode(tools, choice, parallel, parser)
    assert tools == given_tools  # the request's tools are left as they came
    if outcome is None:
        return
    mode, expected = outcome
    cuts = data.draw(st.lists(st.integers(0, 200), max_size=4))
    if mode.kind == "named":
        check_named_reply(mode, data.draw(st.sampled_from(ARGUMENTS)), cuts, parser)
    if mode.kind == "required":
        names = [t["function"]["name"] for t in tools]
        call = st.fixed_dictionaries({"name": st.sampled_from(names), "parameters": st.sampled_from(ARGUMENTS)})
        more = data.draw(st.lists(st.lists(call, min_size=2, max_size=3), max_size=2))
        accepted = check_required_schema(mode.constraint.json, expected["schema"], parallel, calls_to_try(names, more))
        readable = [v for v in accepted if all(isinstance(c["parameters"], dict) for c in v)]  # vLLM's reading
        if readable:
            check_required_reply(mode, data.draw(st.sampled_from(readable)), parallel, cuts, parser)


@SETTINGS
@given(tools=tools_lists(), parallel=st.sampled_from([None, True, False]),
       parser_name=st.sampled_from(sorted(PARSERS, key=str)), data=st.data())
def test_tool_requests_as_vllm(tools: Any, parallel: bool | None, parser_name: str | None, data: st.DataObject) -> None:
    """Any tools and choice: refused as vLLM refuses them, or taken as vLLM takes them."""
    check_request(tools, data.draw(choices(tools)), parallel, PARSERS[parser_name], data)


@SETTINGS
@given(tools=good_tools(), parallel=st.sampled_from([None, True, False]),
       parser_name=st.sampled_from(sorted(PARSERS, key=str)), data=st.data())
def test_forced_calls_as_vllm(tools: list[dict[str, Any]], parallel: bool | None, parser_name: str | None,
                              data: st.DataObject) -> None:
    """Good tools, a ``"required"`` choice or one naming a tool: vLLM's constraint, the replies read as vLLM's."""
    name = data.draw(st.sampled_from([t["function"]["name"] for t in tools]))
    choice = data.draw(st.sampled_from(["required", {"type": "function", "function": {"name": name}}]))
    check_request(tools, choice, parallel, PARSERS[parser_name], data)


# ---------------------------------------------------------------- plain examples of what the property found
PLAIN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_named_choice_may_leave_out_type_as_vllm() -> None:
    """vLLM's ``ChatCompletionNamedToolChoiceParam`` defaults ``type`` to ``"function"``, as a tool's."""
    tools = [{"function": {"name": "add", "parameters": PLAIN}}]
    mode = tool_mode(tools, {"function": {"name": "add"}}, None, None)
    assert mode.kind == "named" and mode.function == "add" and mode.constraint.json == PLAIN
    with pytest.raises(InvalidRequestError) as info:
        tool_mode(tools, {"type": "custom", "function": {"name": "add"}}, None, None)
    assert info.value.field == "tool_choice"


def test_required_offers_every_tool_of_a_shared_name_as_vllm() -> None:
    """Two tools of one name: vLLM's ``"required"`` schema has a branch for each (and checks both ``$defs``)."""
    other = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": {"type": "integer"}}}
    tools = [{"function": {"name": "add", "parameters": PLAIN}},
             {"function": {"name": "add", "parameters": PARAMETERS["pydantic"]}}]
    validator = jsonschema.Draft202012Validator(tool_mode(tools, "required", None, None).constraint.json)
    assert validator.is_valid([{"name": "add", "parameters": {"a": 1}}])
    assert validator.is_valid([{"name": "add", "parameters": {"unit": "c"}}])
    with pytest.raises(InvalidRequestError) as info:
        tool_mode([*tools, {"function": {"name": "add", "parameters": other}}], "required", None, None)
    assert info.value.field == "tools"
