"""``serve --config FILE`` (asyncllm/cli_config.py) on drawn YAML files and command lines (hypothesis), against a
reference written from vLLM's ``FlexibleArgumentParser.load_config_file`` / ``_pull_args_from_config``
(vllm/utils/argparse_utils.py) and the deliberate differences cli_config.py's docstring and docs/cli.md list.

The reference turns the file into command-line words as vLLM does: a key is ``--KEY`` (``_`` read as ``-``); true
gives the flag; a list the option once with each item's ``str``, an empty one nothing (asyncllm's difference: for an option
taking one value, the list's JSON); a mapping its JSON; any other
value its ``str``. The words go after ``serve`` (and after MODEL when the command line starts with one), before the
command line's, so the command line wins (argparse keeps the last). asyncllm's documented differences, also in the
reference: false gives ``--no-KEY`` where serve has it (else nothing); null leaves the option unset; an unknown key
(a flag's prefix, ``config``) is refused naming it, as is a flag (``nargs=0``) whose value is not a boolean; vLLM's
no-effect flag ``disable-fastapi-docs`` takes a boolean and changes nothing; ``model`` is MODEL when the command line
gives none (a name: a string or a number; another value refused naming it); vLLM's dotted keys
(``hf-overrides.a.b: 1``) are set, in file order and whatever the place of the flag's own key, on the file's mapping
for the flag (its last spelling's, as vLLM's later word; null or no key: an empty one), one through a value that is
not an object, or a flag's own value not an object, refused naming a dotted key; a mapping JSON cannot hold (a YAML
date in it) is refused naming its key.
The reference's words are parsed by the real ``serve`` parser (no ``--config``): asyncllm's namespace must equal that
one, or both refuse with the same argparse message (exit 2), or, where the reference refuses a key, asyncllm exits 2
naming one of the keys refused.

Drawn: a file of serve's real options (store_true flags, BooleanOptionalAction ones and a ``--no-`` spelling, ints,
floats, strings with choices or not, list options, JSON options incl. ``allowed-origins``' JSON list), ``model``,
unknown keys and flag prefixes, ``config``, ``disable-fastapi-docs``, ``hf-overrides`` dotted keys (depth 1 to 2)
before or after its own key; each value valid or from a pool of wrong types (null, booleans, ints, floats, strings,
dates, lists, mappings); each key with dashes or underscores. The command line: MODEL or none, then a few options
(some repeating the file's, with other values; ``--flag=value`` or underscores sometimes), ``--config FILE`` (or
``--config=FILE``) at a drawn place, MODEL sometimes as vLLM's ``--model MODEL`` at a drawn place. Two tests: files
of plain keys, and files with dotted keys (and fewer plain ones). Plain examples below pin the bugs this test found
(each failed before the fix in asyncllm/cli_config.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import io
import json
import os
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from asyncllm.cli import _parser, parse_args
from asyncllm.cli_config import dash_flag_names

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "200"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize="PROP_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PARSER = _parser()
SERVE = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
KEYS = ("a", "b")
NAMES = st.sampled_from(["m1", "org/m", "x.y", "n 1"])

VALID: dict[str, st.SearchStrategy] = {
    "enable-auto-tool-choice": st.booleans(), "allow-credentials": st.booleans(),  # store_true
    "return-tokens-as-token-ids": st.booleans(),
    "enforce-eager": st.booleans(), "enable-log-requests": st.booleans(),  # BooleanOptionalAction
    "trust-remote-code": st.booleans(), "enable-prefix-caching": st.booleans(), "no-enforce-eager": st.booleans(),
    "disable-fastapi-docs": st.booleans(),  # vLLM's, no effect here
    "max-n": st.integers(1, 9), "seed": st.integers(0, 99), "max-model-len": st.integers(16, 4096),
    "tensor-parallel-size": st.integers(1, 4), "ssl-cert-reqs": st.integers(0, 2), "port": st.integers(1024, 65535),
    "gpu-memory-utilization": st.floats(0.1, 0.95), "shutdown-timeout": st.floats(0, 30), "swap-space": st.floats(0, 4),
    "host": st.sampled_from(["0.0.0.0", "localhost", "::1"]), "root-path": st.sampled_from(["/api", "", "/v"]),
    "dtype": st.sampled_from(["auto", "float16", "bfloat16"]), "response-role": st.sampled_from(["assistant", "bot"]),
    "log-level": st.sampled_from(["debug", "info", "warning"]), "uvicorn-log-level": st.sampled_from(["error", "info"]),
    "served-model-name": st.lists(NAMES, min_size=1, max_size=3), "api-key": st.lists(NAMES, min_size=1, max_size=2),
    "lora-modules": st.lists(st.sampled_from(["a=/p/a", "b=/p/b"]), min_size=1, max_size=2),
    "hf-overrides": st.dictionaries(st.sampled_from(KEYS), st.integers(0, 9), max_size=2),
    "default-chat-template-kwargs": st.dictionaries(st.sampled_from(KEYS), st.booleans(), max_size=2),
    "allowed-origins": st.sampled_from(['["*"]', '["http://a.org"]', "[]"]),
    "model": NAMES | st.integers(1, 9),
}
FILE_VALID = {name: strategy | (st.just([]) if name in ("served-model-name", "api-key", "lora-modules") else
                                st.none() if name in ("enforce-eager", "allow-credentials", "disable-fastapi-docs")
                                else st.nothing()) for name, strategy in VALID.items()}
"""A file's valid values also: an empty list (vLLM's: nothing), null for a flag (nothing)."""
UNKNOWN = ("config", "max-nn", "enforce", "host-name", "tp", "max-n-", "disable-fastapi", "no-max-n", "tensor-parallel")

json_scalars = st.none() | st.booleans() | st.integers(-9, 9) | st.text(alphabet="ab ,=", max_size=3)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=2) |
                           st.dictionaries(st.sampled_from(KEYS), inner, max_size=2), max_leaves=4)
scalars = (st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(-2, 1e6, allow_nan=False) |
           st.text(alphabet="ab-_ 9.:/{}[],", max_size=6) | st.sampled_from(["", "-1", "1k", "none", "a=b", "{}"]) |
           st.just(datetime.date(2024, 1, 2)))
WILD = scalars | st.lists(scalars, max_size=3) | st.dictionaries(st.sampled_from(KEYS), json_values | scalars,
                                                                 max_size=2)


class Refused(Exception):
    """The reference refuses the file: args[0] are the keys any of which asyncllm's error may name."""


# ---------------------------------------------------------------------------------------------------------- drawing

@st.composite
def config_files(draw: st.DrawFn, dotted: bool) -> list[tuple[str, Any]]:
    """The file's (key, value) items in order: names unique (each with dashes or underscores); with `dotted`, a few
    dotted hf-overrides keys among them."""
    names = draw(st.lists(st.sampled_from(sorted(VALID)), max_size=3 if dotted else 5, unique=True))
    if draw(st.integers(0, 4)) == 4:  # (hypothesis draws 0 often)
        names.insert(draw(st.integers(0, len(names))), draw(st.sampled_from(UNKNOWN)))
    wild = draw(st.integers(0, 4)) == 4  # every value from the whole pool; else one, or none
    items = []
    for i, name in enumerate(names):
        value = draw(WILD) if name in UNKNOWN or wild or i == 0 and draw(st.integers(0, 2)) == 2 else \
            draw(FILE_VALID[name])
        items.append((_spelt(draw, name), value))
    if dotted:
        _add_hf_overrides(draw, items)
    return items


def _add_hf_overrides(draw: st.DrawFn, items: list[tuple[str, Any]]) -> None:
    """hf-overrides' dotted keys at drawn places, and its own key (or both its spellings) before, among or after
    them, its value an object or not (null, a number, a list)."""
    for _ in range(draw(st.integers(1, 3))):
        keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=2))
        key = _spelt(draw, "hf-overrides") + "." + ".".join(keys)
        if key not in dict(items):
            items.insert(draw(st.integers(0, len(items))), (key, draw(WILD if draw(st.booleans()) else json_values)))
    for spelling in draw(st.sampled_from([(), ("hf-overrides",), ("hf_overrides",), ("hf_overrides", "hf-overrides")])):
        if spelling not in dict(items):
            value = draw(WILD if draw(st.integers(0, 2)) == 2 else VALID["hf-overrides"] |
                         st.dictionaries(st.sampled_from(KEYS), json_values, max_size=2))
            items.insert(draw(st.integers(0, len(items))), (spelling, value))


def _spelt(draw: st.DrawFn, name: str) -> str:
    return name.replace("-", "_") if draw(st.integers(0, 3)) == 0 else name


@st.composite
def command_lines(draw: st.DrawFn, in_file: list[str]) -> tuple[list[str], str | None, list[str]]:
    """``serve`` and its words with ``--config FILE`` somewhere (FILE: the file's path, put in by the test); MODEL
    (or None); the options' words as vLLM's parser reads them (dashed). The options are serve's, often the file's
    (`in_file`) again."""
    model = draw(st.none() | st.just("cli/model"))
    pool = sorted(set(VALID) - {"model", "no-enforce-eager"})
    again = [name for name in pool if name in in_file]
    names = draw(st.lists(st.sampled_from(again) if again and draw(st.booleans()) else st.sampled_from(pool),
                          max_size=3))
    units, dashed = [], []
    for name in names:
        value = draw(VALID[name])
        if name == "served-model-name" or name == "api-key" or name == "lora-modules":
            value = value[:1] if model is None else value  # two names and no MODEL: serve's own refusal
        words = _cli_words(name, value)
        if len(words) == 2 and draw(st.booleans()):
            words = [f"{words[0]}={words[1]}"]
        dashed += [] if name == "disable-fastapi-docs" else words  # vLLM's, dropped with a note
        if words and draw(st.integers(0, 3)) == 0:  # vLLM's --max_n (before any "=")
            name_part, equals, value_part = words[0].partition("=")
            words = ["--" + name_part[2:].replace("-", "_") + equals + value_part] + words[1:]
        units.append(words)
    config = ["--config=FILE"] if draw(st.booleans()) else ["--config", "FILE"]
    units.insert(draw(st.integers(0, len(units))), config)
    first = [model] if model else []
    if model and draw(st.booleans()):  # vLLM's serve --model X (its MODEL), at a drawn place
        units.insert(draw(st.integers(0, len(units))), ["--model", model])
        first = []
    argv = ["serve"] + first + [word for unit in units for word in unit]
    return argv, model, dashed


def _cli_words(name: str, value: Any) -> list[str]:
    flag = "--" + name
    if value is True or value is None:
        return [flag]
    if value is False:
        return ["--no-" + name] if ("--no-" + name) in SERVE._option_string_actions else []
    if isinstance(value, list):
        return [flag, *value]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


# -------------------------------------------------------------------------------------------------------- reference

def reference_words(items: list[tuple[str, Any]]) -> tuple[list[str], str | None]:
    """The file's words as vLLM's load_config_file makes them (with asyncllm's documented differences), and the
    file's MODEL; `Refused` with the keys refused."""
    refused: list[str] = []
    whole, dotted, order, spelt = _split_dotted(items)
    words: list[str] = []
    model = None
    for name in order:
        key = spelt[name]
        if name in dotted:
            value = _with_dotted(whole.get(name), dotted[name], refused)
        else:
            value = whole[name]
        if name == "model":
            if isinstance(value, (bool, list, dict)):  # not a name: vLLM's --model with no value, or several
                refused.append(key)
            model = None if value is None else str(value)
            continue
        words += _key_words(key, name, value, refused)
    if refused:
        raise Refused(refused)
    return words, model


def _split_dotted(items: list[tuple[str, Any]]):
    whole: dict[str, Any] = {}
    dotted: dict[str, list[tuple[str, list[str], Any]]] = {}
    order: list[str] = []
    spelt: dict[str, str] = {}
    for key, value in items:
        written, _, keys = key.partition(".")
        name = written.replace("_", "-")
        if name not in spelt:
            spelt[name] = written
            order.append(name)
        if keys:
            dotted.setdefault(name, []).append((key, keys.split("."), value))
        else:
            whole[name] = value
    return whole, dotted, order, spelt


def _with_dotted(base: Any, keys: list[tuple[str, list[str], Any]], refused: list[str]) -> Any:
    """The dotted keys set on `base` (null: {}), each through objects only, else that key refused."""
    if base is not None and not isinstance(base, dict):
        refused += [key for key, _, _ in keys]
        return base
    merged = copy.deepcopy(base) if base else {}
    for key, path, value in keys:
        target = merged
        for part in path[:-1]:
            target = target.setdefault(part, {}) if isinstance(target, dict) else target
        if not isinstance(target, dict):
            refused.append(key)
            continue
        target[path[-1]] = value
    return merged


def _dates_in(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_dates_in(v) for v in value.values())
    if isinstance(value, list):
        return any(_dates_in(v) for v in value)
    return isinstance(value, datetime.date)


def _key_words(key: str, name: str, value: Any, refused: list[str]) -> list[str]:
    flag = "--" + name
    if name == "config" or flag not in SERVE._option_string_actions and name != "disable-fastapi-docs":
        refused.append(key)
        return []
    if value is None:
        return []
    takes_none = name == "disable-fastapi-docs" or SERVE._option_string_actions[flag].nargs == 0
    if takes_none and not isinstance(value, bool):
        refused.append(key)
        return []
    one_value = not takes_none and SERVE._option_string_actions[flag].nargs is None
    if (isinstance(value, dict) or isinstance(value, list) and one_value) and _dates_in(value):
        refused.append(key)
        return []
    if name == "disable-fastapi-docs":
        return []
    if isinstance(value, list) and one_value:  # asyncllm's: the list's JSON (vLLM: its items, the second MODEL)
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        return [flag, *map(str, value)] if value else []
    return _cli_words(name, value)


def reference_parse(argv: list[str], model: str | None) -> tuple[argparse.Namespace | None, str]:
    """The serve parser's namespace for `argv` (the file's MODEL where it gives none), or None and its error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, unknown = PARSER.parse_known_args(argv)
    except SystemExit:
        return None, _message(err.getvalue())
    if unknown:
        return None, ("unrecognized arguments: " + " ".join(unknown)).strip()
    if args.model is None and model is not None:
        args.model = model
    return args, ""


def _message(stderr: str) -> str:
    return stderr.strip().splitlines()[-1].partition("error: ")[2]


def asyncllm_parse(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parse_args(PARSER, dash_flag_names(argv)), ""
    except SystemExit as exc:
        assert exc.code == 2, (exc.code, err.getvalue())
        return None, _message(err.getvalue())


# ------------------------------------------------------------------------------------------------------------ tests

def _write(tmp_path, items: list[tuple[str, Any]]) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(dict(items), sort_keys=False) if items else "# no options\n", encoding="utf-8")
    assert list(yaml.safe_load(path.read_text(encoding="utf-8")) or {}) == [k for k, _ in items]
    return str(path)


def check(items: list[tuple[str, Any]], line: tuple[list[str], str | None, list[str]]) -> None:
    argv, model, cli = line
    got, message = asyncllm_parse(argv)
    try:
        words, file_model = reference_words(items)
    except Refused as refused:
        keys = refused.args[0]
        event("the reference refuses a key")
        event("refused: " + " ".join(sorted({k.partition(".")[0] for k in keys})))
        assert got is None, f"accepted a file the reference refuses for {keys}: {items}"
        assert any(repr(key) in message for key in keys), (message, keys)
        return
    ref_argv = ["serve"] + ([model] if model else []) + words + cli
    expected, expected_message = reference_parse(ref_argv, file_model)
    event("dotted keys" if any("." in key for key, _ in items) else "no dotted key")
    if expected is None:
        event("the parser refuses the words")
        assert got is None, f"accepted {ref_argv}, which the parser refuses: {expected_message}"
        assert message == expected_message, (message, expected_message, ref_argv)
        return
    event("accepted")
    assert got is not None, f"refused {ref_argv}: {message}"
    assert vars(got) == vars(expected), (ref_argv, {k: (v, vars(expected).get(k)) for k, v in vars(got).items()
                                                    if vars(expected).get(k) != v})


@st.composite
def cases(draw: st.DrawFn, dotted: bool):
    items = draw(config_files(dotted))
    return items, draw(command_lines([key.partition(".")[0].replace("_", "-") for key, _ in items]))


def run_case(tmp_path, case) -> None:
    items, (argv, model, cli) = case
    path = _write(tmp_path, items)
    argv = [path if word == "FILE" else word.replace("=FILE", "=" + path) for word in argv]
    check(items, (argv, model, cli))


@SETTINGS
@given(case=cases(dotted=False))
@example(case=([("served-model-name", ["a", "b"])], (["serve", "cli/model", "--config", "FILE"], "cli/model", [])))
@example(case=([("config", "other.yaml")], (["serve", "--config=FILE"], None, [])))
@example(case=([("enforce_eager", False), ("disable-fastapi-docs", None), ("api-key", [])],
               (["serve", "--config", "FILE", "--enforce_eager"], None, ["--enforce-eager"])))
def test_a_config_file_is_read_as_vllm_reads_it_under_the_command_line(tmp_path, case) -> None:
    run_case(tmp_path, case)


@SETTINGS
@given(case=cases(dotted=True))
def test_a_config_files_dotted_keys_merge_over_its_own_mapping(tmp_path, case) -> None:
    run_case(tmp_path, case)


# ---------------------------------------------------------------------------------------------- plain examples (bugs)

def _serve(tmp_path, text: str, capsys) -> tuple[argparse.Namespace | None, str]:
    path = tmp_path / "serve.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        return parse_args(PARSER, ["serve", "m", "--config", str(path)]), ""
    except SystemExit as exc:
        assert exc.code == 2
        return None, capsys.readouterr().err.strip().splitlines()[-1]


def test_a_mapping_json_cannot_hold_is_refused_naming_its_key(tmp_path, capsys) -> None:
    # was: TypeError "Object of type date is not JSON serializable", a traceback (vLLM's too)
    args, message = _serve(tmp_path, "hf_overrides: {released: 2024-01-02}\n", capsys)
    assert args is None and "the key 'hf_overrides' holds a value JSON cannot" in message


@pytest.mark.parametrize("value", ["false", "true", "[a, b]", "{a: 1}"])
def test_a_model_that_is_no_name_is_refused_naming_the_key(tmp_path, capsys, value) -> None:
    # was: MODEL 'False', 'True', "['a', 'b']" or "{'a': 1}" (vLLM: --model with no value, or nothing for false)
    path = tmp_path / "serve.yaml"
    path.write_text(f"model: {value}\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        parse_args(PARSER, ["serve", "--config", str(path)])
    assert "the key 'model' is the model's name or path" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "expected"), [
    ("hf-overrides.a.b: 1\nhf-overrides: {a: {c: 2}}\n", {"a": {"c": 2, "b": 1}}),  # was {"a": {"b": 1}}
    ("hf-overrides.a: 1\nhf-overrides: null\n", {"a": 1}),  # was: unset, the dotted key dropped
    ("hf-overrides: null\nhf-overrides.a: 1\n", {"a": 1}),  # was: refused, "not a JSON object"
    ("hf_overrides: {a: 1}\nhf-overrides: {a: 2}\n", {"a": 2}),  # was {"a": 1}: the later key wins, as vLLM's
])
def test_dotted_keys_merge_over_the_flags_own_key_wherever_it_is(tmp_path, capsys, text, expected) -> None:
    args, message = _serve(tmp_path, text, capsys)
    assert args is not None, message
    assert args.hf_overrides == expected


def test_a_dotted_key_does_not_change_another_flag_sharing_its_mapping_by_a_yaml_alias(tmp_path, capsys) -> None:
    args, message = _serve(tmp_path, "hf-overrides: &a {b: 1}\nmm-processor-kwargs: *a\nhf-overrides.c: 2\n", capsys)
    assert args is not None, message
    assert (args.hf_overrides, args.mm_processor_kwargs) == ({"b": 1, "c": 2}, {"b": 1})  # was {"b": 1, "c": 2} too


@pytest.mark.parametrize(("text", "field", "expected"), [
    # was: refused, "JSON is malformed" (each item's Python repr, not JSON)
    ("enable-lora: true\nlora-modules: [{name: a, path: /p/a}, b=/p/b]\n", "lora_modules", ["a", "b"]),
    # was: refused, "not JSON" ('https://a.org', the list's first item, as the flag's JSON)
    ("allowed-origins: [https://a.org, https://b.org]\n", "allowed_origins", ["https://a.org", "https://b.org"]),
    ("allowed-origins: []\n", "allowed_origins", []),  # was ["*"]: the empty list dropped, any origin allowed
])
def test_a_config_files_lists_are_read_as_the_option_reads_them(tmp_path, capsys, text, field, expected) -> None:
    args, message = _serve(tmp_path, text, capsys)
    assert args is not None, message
    value = getattr(args, field)
    assert [item.name for item in value] == expected if field == "lora_modules" else value == expected


def test_a_list_for_an_option_taking_one_value_leaves_model_alone(tmp_path, capsys) -> None:
    # was: MODEL 'y' (the list's second item, after --chat-template x), the bundled model's name silently replaced
    path = tmp_path / "serve.yaml"
    path.write_text("chat-template: [x, y]\n", encoding="utf-8")
    args = parse_args(PARSER, ["serve", "--config", str(path)])
    assert args.model is None and args.chat_template == '["x", "y"]'
