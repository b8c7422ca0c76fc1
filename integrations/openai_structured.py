"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` as the engine's `StructuredOutputs`.

``response_format``: ``text`` (no constraint), ``json_object``, ``json_schema`` (its ``schema``);
``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object: true``, read as
`SamplingParams`' (`from_vllm_structured`). Both in one request, or keys asyncllm does not build, are a 400 naming
the field; so is a ``response_format`` key OpenAI does not define (`check_response_format_keys`), named
``response_format.<key>``, and, whatever the type, a ``json_schema`` that OpenAI's and vLLM's models refuse (no string
``name``, a ``schema`` that is not an object), named ``response_format``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.errors import renamed_fields
from asyncllm.sampling import StructuredOutputs, from_vllm_structured

__all__ = ["JSON_SCHEMA_KEYS", "structured_output", "check_response_format_keys", "constraint_field",
           "constraint_errors"]


_JSON_OBJECT = {"type": "object"}
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_RESPONSE_FORMAT_KEYS = frozenset({"type", "json_schema"})
JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})
"""OpenAI's keys of ``response_format`` and of its ``json_schema``: others are refused as unknown fields are
(vLLM ignores them, so ``{"type": "json_object", "schema": ...}`` would constrain nothing but the JSON object)."""


def structured_output(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                      ) -> tuple[StructuredOutputs | None, str]:
    """A request's output constraint, and the field that set it: ``response_format`` or ``structured_outputs``."""
    if response_format is not None:
        _check_json_schema(response_format.get("json_schema"))
    if response_format is not None and response_format.get("type") == "text":
        response_format = None
    if response_format is not None and structured_outputs is not None:
        raise InvalidRequestError("structured_outputs", "set response_format or structured_outputs, not both")
    if structured_outputs is not None:
        return from_vllm_structured("structured_outputs", structured_outputs), "structured_outputs"
    if response_format is None:
        return None, "response_format"
    kind = response_format.get("type")
    if kind == "json_object":
        return StructuredOutputs(json=_JSON_OBJECT), "response_format"
    if kind != "json_schema":
        raise InvalidRequestError("response_format",
                                  f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequestError("response_format", "json_schema must be an object with a 'schema' (and a 'name')")
    return StructuredOutputs(json=spec["schema"]), "response_format"


def _check_json_schema(spec: object) -> None:
    """`InvalidRequestError` naming ``response_format`` for a ``json_schema`` that OpenAI's and vLLM's models refuse,
    whatever the type (vLLM's pydantic reads it for each): not an object, no string ``name``, or a ``schema`` that is
    neither an object nor null (nor its JSON text, which vLLM refuses too)."""
    if spec is None:
        return
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequestError("response_format", "json_schema must be an object with a string 'name' (and a "
                                                     "'schema' for the json_schema type)")
    if spec.get("schema") is not None and not isinstance(spec["schema"], dict):
        raise InvalidRequestError("response_format", "json_schema's schema must be a JSON schema object, got "
                                                     f"{type(spec['schema']).__name__}")


def constraint_field(req: Any, tool_constraint: bool = False) -> str:
    """The field that set `req`'s output constraint: ``tools`` (a named or ``required`` tool choice), else the one
    `structured_output` read."""
    if tool_constraint:
        return "tools"
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def constraint_errors(field: str) -> contextlib.AbstractContextManager[None]:
    """The constraint's errors, the host's checks and the core's compile alike, name `field`, the one the client
    wrote it in, not the engine's ``structured``."""
    return renamed_fields({"structured": field})


def check_response_format_keys(response_format: dict[str, Any]) -> None:
    """`InvalidRequestError` naming ``response_format.<key>`` for a key OpenAI does not define (one level down
    in ``json_schema``) of its three types (``text`` too; another type is refused as such), beam search's too
    (`openai_sampling.check_common`)."""
    if response_format.get("type") not in _RESPONSE_FORMAT_TYPES:
        return
    spec = response_format.get("json_schema")
    unknown = [f"response_format.{key}" for key in response_format if key not in _RESPONSE_FORMAT_KEYS]
    if isinstance(spec, dict):
        unknown += [f"response_format.json_schema.{key}" for key in spec if key not in JSON_SCHEMA_KEYS]
    if unknown:
        raise InvalidRequestError(unknown[0], "unknown field (OpenAI's response_format has type and json_schema: "
                                              "name, schema, strict, description)")

