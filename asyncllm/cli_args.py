"""Command-line flags generated from `EngineConfig`'s fields, so the two never drift.

Every field of every config section becomes ``--field-name`` (``model`` is the
command's positional argument; host-only objects such as a Prometheus registry
have no flag). The flag's type comes from the field's annotation, its help
from the field's docstring in its section's module (asyncllm/config.py,
asyncllm/config_model.py, ...), and a flag the user does not give is left out, so
`EngineConfig`'s own defaults and validation apply.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import re
import sys
from dataclasses import MISSING, Field, fields
from functools import lru_cache
from typing import Any, Callable, get_type_hints

from asyncllm import config as config_module

__all__ = ["ENGINE_FLAG_FIELDS", "add_engine_args", "engine_kwargs", "json_object", "is_json_object_flag",
           "markdown_table"]

_SECTIONS = tuple(get_type_hints(config_module.EngineConfig)[f.name] for f in fields(config_module.EngineConfig))
"""`EngineConfig`'s sections (ModelConfig, CacheConfig, ...), read from its fields so that a new one has flags."""
_NO_FLAG = frozenset({"model", "prometheus_registry"})
"""`model` is positional; a registry object cannot come from a command line."""
_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
                "quantization": "-q"}
"""vLLM's short forms."""
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _flag_fields() -> list[Field]:
    return [f for section in _SECTIONS for f in fields(section) if f.name not in _NO_FLAG]


def _kind(annotation: str) -> str:
    """A field's type without None and parameters: ``dict[str, Any] | None`` -> ``dict``."""
    return next((part for part in annotation.replace(" ", "").split("|") if part != "None"), "str").split("[")[0]


ENGINE_FLAG_FIELDS = tuple(f.name for f in _flag_fields())
"""The EngineConfig fields that have a flag, in config order."""
_JSON_OBJECT_FIELDS = frozenset(f.name for f in _flag_fields() if _kind(str(f.type)) == "dict")
"""The fields whose flag takes a JSON object (its dotted keys too: asyncllm/cli_vllm.py)."""


def add_engine_args(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """Add one flag per EngineConfig field, in a group of its own; none for the fields in `skip` (a flag the command
    gives another meaning: generate's ``--seed`` is its request's)."""
    group = parser.add_argument_group("engine", "EngineConfig fields (docs/configuration.md); unset = the default")
    docs = _field_docs()
    for field in (f for f in _flag_fields() if f.name not in skip):
        flags = ["--" + field.name.replace("_", "-")] + ([_SHORT_FLAGS[field.name]] if field.name in _SHORT_FLAGS else [])
        help_text = f"{docs.get(field.name, '')} (default: {_default(field)!r})".replace("%", "%%")
        parse = _parser_for(str(field.type), _INT_PARSERS.get(field.name, int),
                            _DICT_PARSERS.get(field.name, json_object))
        if parse is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_text)
        else:
            group.add_argument(*flags, dest=field.name, type=parse, default=argparse.SUPPRESS, metavar=_metavar(str(field.type)),
                               help=help_text)


def engine_kwargs(args: argparse.Namespace, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The EngineConfig fields the user gave on the command line (none of `skip`, as `add_engine_args`); a
    ``--revision`` with a local MODEL left out with a warning (vLLM lets transformers ignore it)."""
    kwargs = {name: getattr(args, name) for name in ENGINE_FLAG_FIELDS if hasattr(args, name) and name not in skip}
    if kwargs.get("revision") is not None and _local_model(args):
        print(f"[asyncllm] warning: --revision {kwargs.pop('revision')} ignored: the model is a local folder or file, "
              "which has no revisions (as vLLM, where transformers ignores it)", file=sys.stderr)
    return kwargs


def _local_model(args: argparse.Namespace) -> bool:
    """MODEL is on this machine: a path that exists, or none (the bundled model; not with --connect)."""
    model = getattr(args, "model", None)
    return os.path.exists(model) if model is not None else getattr(args, "connect", None) is None


def _parser_for(annotation: str, integer: Callable[[str], int] = int,
                mapping: Callable[[str], dict[str, Any]] | None = None) -> Callable[[str], Any] | type[bool]:
    optional = "None" in annotation.replace(" ", "").split("|")
    kind = _kind(annotation)
    if kind == "bool":
        return bool
    convert: Callable[[str], Any] = {"int": integer, "float": float, "dict": mapping or json_object}.get(kind, str)

    def parse(raw: str) -> Any:
        if optional and raw.lower() == "none":
            return None
        try:
            return convert(raw)
        except _SizeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {kind}{' or none' if optional else ''}") from exc

    parse.__name__ = kind  # argparse names the type in its error messages
    return parse


def human_readable_int(raw: str) -> int:
    """vLLM's: ``4k`` -> 4000, ``25.6k`` -> 25600 (decimal k m g t), ``2K`` -> 2048, ``2G`` -> 2**31 (binary K M G T,
    whole numbers only)."""
    raw = raw.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", raw)
    if match is None:
        return int(raw)
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:  # vLLM's words
        raise _SizeError(f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean "
                         f"{number}{suffix.lower()}?")
    return int(number) * _BINARY_SUFFIXES[suffix]


class _SizeError(ValueError):
    """A size argparse reports as it is (not as "not int")."""


def human_readable_int_or_auto(raw: str) -> int:
    """`human_readable_int`, or vLLM's ``auto`` (-1: the longest length that fits the KV cache)."""
    return -1 if raw.strip().lower() == "auto" else human_readable_int(raw)


_INT_PARSERS = {"max_model_len": human_readable_int_or_auto, "max_num_batched_tokens": human_readable_int,
                "kv_cache_memory_bytes": human_readable_int}
"""vLLM's flags that take human-readable sizes (``4k``, ``2G``)."""


def json_object(raw: str) -> dict[str, Any]:
    """A flag's JSON object (``'{"a": 1}'``); not JSON, or another JSON value: the flag's error."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {raw!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {raw!r}")
    return value


def modality_counts(raw: str) -> dict[str, Any]:
    """`json_object`, or vLLM's older ``image=10,video=1`` (Mistral's model cards still write it): each count an
    int."""
    if raw.lstrip().startswith("{"):
        return json_object(raw)
    pairs = [pair.partition("=") for pair in raw.split(",")]
    if not all(key.strip() and equals for key, equals, _ in pairs):
        raise argparse.ArgumentTypeError(f"not a JSON object or KEY=COUNT,...: {raw!r}")
    return {key.strip(): int(count) for key, _, count in pairs}


_DICT_PARSERS = {"limit_mm_per_prompt": modality_counts}
"""Object flags that take another spelling besides JSON."""


def is_json_object_flag(action: argparse.Action) -> bool:
    """`action` takes a JSON object: an EngineConfig dict field's flag, or one typed `json_object`."""
    return action.type is json_object or action.dest in _JSON_OBJECT_FIELDS


def _metavar(annotation: str) -> str:
    kind = _kind(annotation)
    return {"dict": "JSON"}.get(kind, kind.upper())


def _default(field: Field) -> Any:
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return None


@lru_cache(maxsize=1)
def _field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it in its section's module), first sentence-ish line."""
    trees = [ast.parse(inspect.getsource(module)) for module in dict.fromkeys(map(inspect.getmodule, _SECTIONS))]
    docs: dict[str, str] = {}
    for node in (node for tree in trees for node in ast.walk(tree)):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, following in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[stmt.target.id] = " ".join(following.value.value.split())
    return docs


def markdown_table() -> str:
    """The engine-flag table of docs/cli.md: ``python -m asyncllm.cli_args`` prints it."""
    docs = _field_docs()
    rows = ["| flag | value | default | what |", "|---|---|---|---|"]
    for field in _flag_fields():
        flag, annotation = field.name.replace("_", "-"), str(field.type)
        if _parser_for(annotation) is bool:
            name, value = f"`--{flag}` / `--no-{flag}`", ""
        else:
            name, value = f"`--{flag}`", _metavar(annotation) + (" or `none`" if "None" in annotation else "")
            if field.name in _SHORT_FLAGS:
                name += f" / `{_SHORT_FLAGS[field.name]}`"
        what = docs.get(field.name, "").replace("|", "\\|")
        rows.append(f"| {name} | {value} | `{_default(field)!r}` | {what} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
