"""A structured output constraint without an engine: its validation, its cache key and its trip to the core."""

from __future__ import annotations

import json

import msgspec
import pytest

from asyncllm import protocol
from asyncllm import InvalidRequestError, SamplingParams, StructuredOutputs
from asyncllm.structured.compiler import choice_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("structured, why", [
    (StructuredOutputs(), "set exactly one of json, regex, choice, grammar; got none"),
    (StructuredOutputs(regex="a", choice=["x"]), "set exactly one of json, regex, choice, grammar; got ['regex', 'choice']"),
    (StructuredOutputs(choice=[]), "choice must be a non-empty list of non-empty strings"),
    (StructuredOutputs(choice=["a", ""]), "choice must be a non-empty list of non-empty strings"),
    (StructuredOutputs(regex=""), "regex must be a non-empty string"),
    (StructuredOutputs(grammar=3), "grammar must be a non-empty string"),  # type: ignore[arg-type]
    (StructuredOutputs(json="[1"), "json is not valid JSON text"),
    (StructuredOutputs(json=[1]), "json must be a JSON schema object, got list"),  # type: ignore[arg-type]
    (StructuredOutputs(json="[" * 100_000), "json is not valid JSON text: maximum recursion depth"),
    (StructuredOutputs(json={"enum": [b"\x00"]}), "json must be a JSON schema of JSON values"),  # a peer's msgpack
    (StructuredOutputs(json={"properties": {"a": {}, 2: {}}}), "json must be a JSON schema of JSON values"),
    ({"jsn": {}}, "must be a StructuredOutputs, got dict"),
    (StructuredOutputs(json=True), "json must be a JSON schema object, got bool"),  # type: ignore[arg-type]
    (StructuredOutputs(json="false"), "json must be a JSON schema object, got bool"),
    # what xgrammar compiles but does not enforce (vLLM's has_xgrammar_unsupported_json_features)
    (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "json uses 'uniqueItems' on an array, which "
                                                                      "xgrammar does not enforce"),
    (StructuredOutputs(json={"properties": {"n": {"type": ["integer", "null"], "multipleOf": 2}}}),
     "json uses 'multipleOf'"),
    (StructuredOutputs(json={"type": "string", "format": "hex"}), "json uses string format 'hex'"),
    (StructuredOutputs(json='{"items": {"type": "string", "pattern": "a+", "maxLength": 2}}'),
     "json uses 'pattern' or 'format' together with 'minLength' or 'maxLength'"),
    (StructuredOutputs(json={"type": "object", "properties": {}, "patternProperties": {"^x": {}}}),
     "json uses 'patternProperties' with more than one pattern or together with 'properties'"),
])
def test_invalid_constraint_names_structured(structured: object, why: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured=structured).validate()  # type: ignore[arg-type]
    assert info.value.field == "structured"
    assert why in str(info.value)


def _nested_arrays(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_too_deep_is_refused_before_it_compiles() -> None:
    """xgrammar's compile time grows steeply with the depth (seconds at 300 levels, past the timeout at 800, and the
    compile thread runs on): more than MAX_SCHEMA_NESTING levels of objects and arrays are refused, as a dict or as
    JSON text; 127 pass."""
    from asyncllm.structured.spec import MAX_SCHEMA_NESTING

    assert MAX_SCHEMA_NESTING == 128
    StructuredOutputs(json=_nested_arrays(126)).validate()  # 127 objects deep
    for too_deep in (_nested_arrays(128), json.dumps(_nested_arrays(800))):
        with pytest.raises(InvalidRequestError, match="json is nested deeper than 128 levels") as info:
            SamplingParams(structured=StructuredOutputs(json=too_deep)).validate()
        assert info.value.field == "structured"


def test_min_tokens_is_refused_with_a_constraint() -> None:
    with pytest.raises(InvalidRequestError, match="^structured: cannot be combined with min_tokens > 0$"):
        SamplingParams(min_tokens=2, structured=StructuredOutputs(regex="a")).validate()


def test_constraint_crosses_the_wire_and_samples_keep_it() -> None:
    params = SamplingParams(n=3, seed=5, structured={"json": SCHEMA})  # type: ignore[arg-type]
    params.validate()
    assert params.structured == StructuredOutputs(json=SCHEMA)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.structured == StructuredOutputs(json=SCHEMA)
    assert params.for_sample(2).structured is params.structured


def test_schemas_xgrammar_enforces_pass() -> None:
    for schema in ({"type": "string", "format": "email"}, {"type": "string", "minLength": 1, "maxLength": 3},
                   {"type": "integer", "maximum": 10**30},
                   {"type": "array", "items": {"type": "string", "format": "date"}, "minItems": 1},
                   {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}):
        StructuredOutputs(json=schema).validate()  # a format without a length; a length without a pattern
    StructuredOutputs(grammar='# a comment\nroot ::= "a"').validate()
    StructuredOutputs(grammar='start: "a" | rule  // a comment with ::=\nrule: "b"').validate()  # Lark


def test_lark_is_told_from_ebnf_as_vllm_does() -> None:
    from asyncllm.structured.spec import looks_like_lark

    assert looks_like_lark('start: "a" | rule  // a comment with ::=\nrule: "b"')
    assert not looks_like_lark('# a comment: x\nroot ::= "a"')


def test_cache_key_and_the_wire_keep_the_schemas_order() -> None:
    """The key order is meaning (xgrammar writes the properties in it: "reasoning" before "answer"), and a schema
    crosses to the core as JSON text, whose integers have no 64-bit limit."""
    schema = {"type": "object", "properties": {"z": {"type": "integer", "maximum": 10**30}, "a": {}}}
    as_dict = StructuredOutputs(json=schema)
    assert as_dict.cache_key() == ("json", json.dumps(schema)) and json.dumps(schema).index('"z"') < json.dumps(
        schema).index('"a"')
    assert as_dict.for_core() == StructuredOutputs(json=json.dumps(schema))
    as_text = StructuredOutputs(json='{"b": 1,  "a": 2}')
    assert as_text.cache_key() == ("json", '{"b": 1,  "a": 2}') and as_text.for_core() is as_text
    message = protocol.AddRequest("r", [1], SamplingParams(structured=as_dict.for_core()), [0], 0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=protocol.AddRequest)
    assert json.loads(decoded.params.structured.json) == schema
    assert StructuredOutputs(regex="a+").cache_key() == ("regex", "a+")
    assert choice_grammar(['say "hi"', "ü\n"]) == 'root ::= "say \\"hi\\"" | "ü\\n"'


def test_the_engine_fills_a_one_token_opener_only_with_its_flag() -> None:
    """`start_after_only_if_reply_opens` (mistral's ``[THINK]``): the engine fills the opener's one id, also beside
    the caller's `start_after_token_ids`; none for an opener of several tokens (the constraint always waits). The
    core reads an opener only with the flag (`Marker.of_structured`)."""
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path
    from asyncllm.structured.start_after import Marker, with_start_after_ids

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    opens = StructuredOutputs(regex="x", start_after="<|/user|>", start_after_only_if_reply_opens=True)

    def filled(**given: object) -> StructuredOutputs:
        params = SamplingParams(structured=msgspec.structs.replace(opens, **given))
        params.validate()
        structured = with_start_after_ids(params, [4], tokenizer, len(tokenizer)).structured
        structured.validate()
        return structured

    assert filled().start_after_opener_token_ids == [user]
    assert filled(start_after_token_ids=[33, 97]).start_after_opener_token_ids == [user]
    assert filled(start_after_token_ids=[33, 97]).start_after_token_ids == [33, 97]  # the caller's kept
    assert filled(start_after_opener="[THINK]").start_after_opener_token_ids == []  # several tokens
    assert filled(start_after_only_if_reply_opens=False).start_after_opener_token_ids == []
    assert Marker.of_structured(filled()).opener == (user,)
    unflagged = msgspec.structs.replace(filled(), start_after_only_if_reply_opens=False)
    assert Marker.of_structured(unflagged).opener == ()


def test_a_prompt_that_opened_the_thinking_drops_the_reply_opens_rule() -> None:
    """GLM-4.7's template opens ``<think>`` in the prompt: its reply thinks without writing it, so the engine drops
    `start_after_only_if_reply_opens` and `start_after_opener_after_space` and the core waits for start_after (as
    vLLM's glm45 ``is_reasoning_end`` waits for ``</think>``); a prompt that did not open it keeps both (GLM-4.5's
    reply opens it itself, after a newline)."""
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path
    from asyncllm.structured.start_after import Marker, with_start_after_ids

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    end = tuple(tokenizer.encode("<|/user|>", add_special_tokens=False))
    glm = SamplingParams(structured=StructuredOutputs(regex="x", start_after="<|/user|>",
                                                      start_after_only_if_reply_opens=True,
                                                      start_after_opener_after_space=True))
    glm.validate()
    for prompt, marker in [("<|assistant|><|user|>", Marker(end)), ("<|assistant|><|user|>\n", Marker(end)),
                           ("<|assistant|>", Marker(end, (user,), after_space=True))]:
        structured = with_start_after_ids(glm, tokenizer.encode(prompt), tokenizer, len(tokenizer)).structured
        structured.validate()  # as the core checks it
        assert Marker.of_structured(structured) == marker, prompt
