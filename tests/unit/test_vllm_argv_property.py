"""`vllm_argv` (asyncllm/cli_vllm.py) on drawn command lines (hypothesis), against a reference merge written from
vLLM's "JSON CLI arguments" rules and docs/cli.md#vllm-flags.

Drawn: a command (serve, engine or generate) and a list of items: positional words, ordinary flags with a value
(space or ``=`` form), a switch or a dotted spelling of a flag that takes no JSON object (``--seed.a=1``: left for
argparse to refuse, where vLLM would make it an object), JSON-object flags given whole (``--hf-overrides '{"a":
1}'``, space or ``=``) and by dotted keys (``--hf-overrides.a.b 2``, depth 1 to 3 over three key names, so keys
repeat, ``k+`` appending), values that are JSON (numbers, booleans, null, strings, lists, objects) or not
(``ngram``, ``{x``, ``""``), vLLM's flags asyncllm maps (``--disable-mm-preprocessor-cache``) or drops with a note
(``--disable-fastapi-docs``, ``--api-server-count 1``), at most one ``--model X``, and words after ``--`` (dotted
flags, ``--model``, ``-O3`` among them).

The reference: each JSON flag with a dotted key has one object, built word by word in argv order: a whole value is
deep-merged over it (objects key by key, anything else replaced: later words win), a dotted key sets its path
(creating objects), ``k+`` appends to the list at k; a value is ``json.loads`` of the word, else the word. The
rewritten argv must be: the command, MODEL moved after it for serve and engine (generate's own --model stays), each
such flag as ``FLAG JSON`` at its first word's place (its other words gone), a JSON flag never given dotted left as
written, mapped flags replaced, dropped flags gone, everything else in order, and the words after ``--`` as given.
Where a dotted key passes through, or appends to, a value that is not an object (not a list), vLLM replaces that
value; asyncllm refuses it naming the flag (exit 2), and so the test expects that. Also asyncllm's, not vLLM's: a
``k+`` value is read as JSON and appended whole (vLLM splits it at commas into strings), and a whole JSON value is
merged with the dotted keys (vLLM's merged dotted object, appended last, replaces it). Each refused `VLLM_FLAGS` entry,
in either spelling among drawn words, exits 2 with ``vLLM's FLAG: REASON``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.cli import _parser
from asyncllm.cli_vllm import VLLM_FLAGS, vllm_argv

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
JSON_FLAGS = ("--hf-overrides", "--limit-mm-per-prompt", "--speculative-config")
KEYS = ("a", "b", "c")
NOT_JSON = ("ngram", "a b", "{x", "", "tru", "x,y", "[1,", "k=v", "p.q")
WORD = st.text(alphabet="ab9/.", min_size=1, max_size=4)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = _parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


COMMANDS = _commands()


class Conflict(Exception):
    """A dotted key through a non-object, or appending to a non-list: vLLM replaces it, asyncllm refuses."""


@dataclass
class Item:
    """One drawn piece of argv: its words, and what the reference needs to read them."""

    kind: str  # word, mapped, dropped, model, whole, dotted
    words: list[str]
    base: str = ""
    keys: tuple[str, ...] = ()
    append: bool = False
    value: Any = None  # whole: the object; dotted: the raw word; model: MODEL


json_scalars = st.none() | st.booleans() | st.integers(-9, 9) | st.floats(-2, 2, width=16) | \
    st.text(alphabet="ab ,.={}", max_size=3)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=2) |
                           st.dictionaries(st.sampled_from(KEYS), inner, max_size=2), max_leaves=4)
json_objects = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=3)


def _spelt(flag: str, value: str, equals: bool) -> list[str]:
    return [f"{flag}={value}"] if equals else [flag, value]


@st.composite
def items(draw) -> Item:
    kind = draw(st.sampled_from(["word", "option", "switch", "whole", "dotted", "dotted", "dotted", "vllm"]))
    equals = draw(st.booleans())
    if kind == "word":
        return Item("word", [draw(WORD)])
    if kind == "option":
        return Item("word", _spelt(draw(st.sampled_from(["--max-model-len", "--seed"])), draw(WORD), equals))
    if kind == "switch":
        return Item("word", [draw(st.sampled_from(["--enforce-eager", "--seed.a=1", "--max-model-len.a.b"]))])
    base = draw(st.sampled_from(JSON_FLAGS))
    if kind == "whole":
        obj = draw(json_objects)
        return Item("whole", _spelt(base, json.dumps(obj), equals), base, value=obj)
    if kind == "dotted":
        keys = tuple(draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)))
        append = draw(st.booleans())
        raw = draw(st.sampled_from(NOT_JSON) | json_values.map(json.dumps))
        name = ".".join([base, *keys]) + ("+" if append else "")
        return Item("dotted", _spelt(name, raw, equals), base, keys, append, raw)
    return draw(st.sampled_from([Item("mapped", ["--disable-mm-preprocessor-cache"]),
                                 Item("dropped", ["--disable-fastapi-docs"]),
                                 Item("dropped", ["--disable-frontend-multiprocessing"]),
                                 Item("dropped", _spelt("--api-server-count", "1", equals)),
                                 Item("dropped", _spelt("--lora-dtype", "auto", equals))]))


REST_WORDS = st.sampled_from(["--hf-overrides.a", "1", "--model", "m", "-O3", "--disable-fastapi-docs", "--",
                              "--limit-mm-per-prompt.image=2", "--compilation-config", "{}", "--hf-overrides"]) | WORD


@st.composite
def command_lines(draw) -> tuple[str, list[Item], list[str] | None]:
    """A command, its items (one ``--model X`` at most), and the words after ``--`` (None: no ``--``)."""
    command = draw(st.sampled_from(["serve", "engine", "generate"]))
    drawn = draw(st.lists(items(), max_size=8))
    if draw(st.booleans()):
        model = draw(WORD)
        drawn.insert(draw(st.integers(0, len(drawn))), Item("model", _spelt("--model", model, draw(st.booleans())),
                                                            value=model))
    rest = draw(st.none() | st.lists(REST_WORDS, max_size=4))
    return command, drawn, rest


def read_value(raw: str) -> Any:
    """vLLM's: JSON where the word parses, else the word."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def deep_update(target: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` over `target`: objects merged key by key, any other value replaced (a fresh copy)."""
    out = json.loads(json.dumps(target))
    for key, value in update.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = deep_update(out[key], value)
        else:
            out[key] = json.loads(json.dumps(value))
    return out


def set_path(target: dict[str, Any], keys: tuple[str, ...], append: bool, value: Any) -> None:
    for key in keys[:-1]:
        if key not in target:
            target[key] = {}
        if not isinstance(target[key], dict):
            raise Conflict(key)
        target = target[key]
    last = keys[-1]
    if not append:
        target[last] = value
        return
    if last not in target:
        target[last] = []
    if not isinstance(target[last], list):
        raise Conflict(last)
    target[last].append(value)


def reference_objects(drawn: list[Item]) -> dict[str, dict[str, Any]]:
    """Each JSON flag given a dotted key -> its merged object, in argv order."""
    objects: dict[str, dict[str, Any]] = {item.base: {} for item in drawn if item.kind == "dotted"}
    for item in drawn:
        if item.base not in objects:
            continue
        if item.kind == "whole":
            objects[item.base] = deep_update(objects[item.base], item.value)
        else:
            set_path(objects[item.base], item.keys, item.append, read_value(item.value))
    return objects


def expected_argv(command: str, drawn: list[Item], objects: dict[str, dict[str, Any]]) -> list[Any]:
    """The rewritten words before ``--``; a dict stands for a merged flag's JSON value."""
    out: list[Any] = []
    placed: set[str] = set()
    for item in drawn:
        if item.base in objects:
            out += [] if item.base in placed else [item.base, objects[item.base]]
            placed.add(item.base)
        elif item.kind == "mapped":
            out += ["--mm-processor-cache-gb", "0"]
        elif item.kind == "model" and command != "generate":
            out.insert(0, item.value)  # MODEL right after the command word, whatever came before
        elif item.kind != "dropped":
            out += item.words
    return [command, *out]


def run(argv: list[str], command: str) -> tuple[list[str] | int, str]:
    """`vllm_argv`'s words (or its exit code) and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return vllm_argv(argv, COMMANDS[command]), err.getvalue()
        except SystemExit as exit_info:
            return exit_info.code, err.getvalue()


def _dotted(keys: str, raw: str, equals: bool = False) -> Item:
    name = "--hf-overrides." + keys
    return Item("dotted", _spelt(name, raw, equals), "--hf-overrides", tuple(keys.rstrip("+").split(".")),
                keys.endswith("+"), raw)


VLLM_DOCS_EXAMPLE = [_dotted("key1", "value1"), _dotted("key2.key3", "value2"), _dotted("key4+", "value3"),
                     _dotted("key4+", "value4", equals=True)]
"""vLLM's "JSON CLI arguments" example (its ``key4+='value4,value5'`` as one value: asyncllm splits no commas)."""


@SETTINGS
@given(line=command_lines())
@example(line=("serve", VLLM_DOCS_EXAMPLE, None))
@example(line=("engine", [Item("whole", ["--hf-overrides", '{"key4": ["v"], "a": {"b": 1}}'], "--hf-overrides",
                               value={"key4": ["v"], "a": {"b": 1}}), _dotted("key4+", "w"), _dotted("a.c", "2")],
               ["--hf-overrides.a", "1"]))
def test_vllm_argv_matches_the_reference_merge(line) -> None:
    command, drawn, rest = line
    argv = [command, *(word for item in drawn for word in item.words), *([] if rest is None else ["--", *rest])]
    got, err = run(argv, command)
    try:
        objects = reference_objects(drawn)
    except Conflict:
        assert got == 2 and "error: argument --" in err, (argv, got)
        return
    assert not isinstance(got, int), (argv, err)
    expected = expected_argv(command, drawn, objects) + ([] if rest is None else ["--", *rest])
    assert len(got) == len(expected), (argv, got, expected)
    for word, want in zip(got, expected):
        assert (json.loads(word) if isinstance(want, dict) else word) == want, (argv, got, expected)
    moved = command != "generate" and any(item.kind == "model" for item in drawn)
    assert ("--model is deprecated" in err) == moved


def test_vllms_documented_example_is_its_json_object() -> None:
    argv = ["serve", *(word for item in VLLM_DOCS_EXAMPLE for word in item.words)]
    assert run(argv, "serve")[0] == ["serve", "--hf-overrides", json.dumps(
        {"key1": "value1", "key2": {"key3": "value2"}, "key4": ["value3", "value4"]})]


REFUSED = sorted(name for name, meant in VLLM_FLAGS.items() if isinstance(meant, str))


@st.composite
def refused_lines(draw, name: str) -> tuple[list[str], str]:
    """A serve/engine line holding refused vLLM flag `name` (a value of its own where it takes one) among drawn words,
    and its message."""
    equals = draw(st.booleans())
    shown, reason = name, VLLM_FLAGS["-O" if name.startswith("-O") else name]
    if name == "--guided-decoding-backend":
        value = draw(st.sampled_from(["outlines", "lm-format-enforcer", "guidance"]))
        flag, shown = _spelt(name, value, equals), f"{name} {value!r}"
        reason += " (auto or xgrammar are accepted)"
    elif name == "--api-server-count":
        flag = _spelt(name, str(draw(st.integers(2, 9))), equals)
    elif name.startswith("-O"):
        flag, shown = [name], "-O"
    elif name in ("--enable-log-outputs", "--fully-sharded-loras"):
        flag = [name]
    else:
        flag = _spelt(name, draw(st.sampled_from(["{}", "3", "a.org"])), equals)
    message = f"vLLM's {shown}: {reason}"
    before = [word for item in draw(st.lists(items(), max_size=3)) if item.kind == "word" for word in item.words]
    return [draw(st.sampled_from(["serve", "engine"])), *before, *flag, *draw(st.lists(WORD, max_size=2))], message


@pytest.mark.parametrize("name", [*REFUSED, "-O3", "-O", "-O=2"])
@settings(SETTINGS, max_examples=max(EXAMPLES // 15, 1))  # per flag: a dozen flags
@given(data=st.data())
def test_each_refused_vllm_flag_exits_naming_it_and_why(name, data) -> None:
    argv, message = data.draw(refused_lines(name))
    got, err = run(argv, argv[0])
    assert got == 2, (argv, got)
    assert err.strip().splitlines()[-1] == f"asyncllm {argv[0]}: error: {message}", argv

