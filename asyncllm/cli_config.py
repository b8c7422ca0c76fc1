"""``--config FILE``: a YAML file of command-line options, as vLLM's ``FlexibleArgumentParser.load_config_file``.

Each key is a long option's name (``tensor-parallel-size`` or ``tensor_parallel_size``); a true boolean gives the
flag, a false one its ``--no-`` form where the flag has one (else nothing, as an unset store_true); a list gives an
option taking several values once with each item as an argument (``served-model-name: [a, b]``; a mapping item as
JSON: ``lora-modules: [{name: a, path: /p}]``), and an option taking one value its JSON (``allowed-origins:
[https://a.org]``; its items as words would leave the second for MODEL); a mapping is passed as JSON (one JSON
cannot hold, a YAML date in it, is refused naming its key); any other value as its text. The options are put in front
of the command line's, which win (argparse keeps the last); an unknown key (a flag's prefix too, and ``config``: one
file) is argparse's ``unrecognized arguments`` error naming it; a null value leaves the option unset; a flag's value
must be a boolean. vLLM's dotted keys (``hf-overrides.max_position_embeddings: 256``) are merged into their flag's
JSON object (the flag's own key, wherever the file puts it, is their base), and vLLM's flags that change nothing here
(``disable-fastapi-docs``) get their note, as on the command line. ``model`` is the command's MODEL when the command
line gives none (a name: a boolean, list or mapping is refused). A ``--config`` after ``--`` is a positional, not
read.

`dash_flag_names` reads ``--max_model_len`` as ``--max-model-len``, as the same parser does.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

from asyncllm.cli_vllm import NO_EFFECT_FLAGS, VLLM_FLAGS, known_vllm_flags

__all__ = ["dash_flag_names", "expand_config_file"]


def dash_flag_names(argv: list[str]) -> list[str]:
    """`argv` with each long option's name (before any ``=`` and any ``.``) spelt with ``-`` for ``_``, as vLLM's
    parser reads it; a dotted JSON key (``--hf-overrides.max_position_embeddings``), values and the words after
    ``--`` are left as they are."""
    end = argv.index("--") if "--" in argv else len(argv)
    return [_dashed(arg) for arg in argv[:end]] + argv[end:]


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    flag, dot, keys = name.partition(".")  # vLLM's --hf-overrides.max_position_embeddings: the keys as written
    return flag.replace("_", "-") + dot + keys + equals + value


def expand_config_file(argv: list[str], command: argparse.ArgumentParser) -> tuple[list[str], str | None]:
    """`argv` (a command and its arguments) with ``--config FILE``'s options in place of the flag, and the file's
    ``model`` (None without one); `command` is the command's parser (its ``--no-`` flags, its errors)."""
    end = argv.index("--") if "--" in argv else len(argv)  # after "--" every word is a positional
    where = [i for i, arg in enumerate(argv[:end]) if arg == "--config" or arg.startswith("--config=")]
    if not where:
        return argv, None
    if len(where) > 1:
        command.error("--config: give one config file")
    i = where[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            command.error("argument --config: expected one argument")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].removeprefix("--config="), argv[:i] + argv[i + 1:]
    options = _dotted_merged(_load(path, command), command, path)
    model = options.pop("model", None)
    if isinstance(model, (bool, list, dict)):  # vLLM's `--model` with no value, or with several
        command.error(f"--config {path}: the key 'model' is the model's name or path, got {model!r}")
    flags = [arg for key, value in options.items() for arg in _flag_args(str(key), value, command, path)]
    # After the command and a leading MODEL (an option taking several values would swallow the MODEL after it,
    # as vLLM's _pull_args_from_config orders them); before the rest, which win
    start = 2 if len(rest) > 1 and not rest[1].startswith("-") else 1
    return rest[:start] + flags + rest[start:], None if model is None else str(model)


def _load(path: str, command: argparse.ArgumentParser) -> dict[str, Any]:
    import yaml

    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        command.error(f"--config: {path!r} is not a .yaml or .yml file (vLLM's config files are YAML)")
    try:
        with open(path, encoding="utf-8") as file:
            options = yaml.safe_load(file)
    except OSError as exc:
        command.error(f"--config: cannot read {path!r}: {exc.strerror}")
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        command.error(f"--config: {path!r} is not valid YAML: {exc}")
    if options is None:
        return {}
    if not isinstance(options, dict):
        command.error(f"--config: {path!r} must map option names to values, got {type(options).__name__}")
    return options


def _dotted_merged(options: dict[str, Any], command: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """vLLM's dotted keys (``hf-overrides.max_position_embeddings: 256``; ``a.b`` nests) merged into their flag's
    JSON object, in file order, over the flag's own key wherever the file has it (its last spelling's; null: none),
    as vLLM reads the file's keys as command-line words (its dotted keys last)."""
    merged: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    """Each flag's key as the file first spells it (its errors name that)."""
    dotted: list[tuple[str, str, list[str], Any]] = []
    for key, value in options.items():
        written, dot, keys = str(key).partition(".")
        name = written.replace("_", "-")  # hf_overrides and hf-overrides are one flag's keys
        spelled.setdefault(name, written)
        if dot:
            merged.setdefault(name, None)  # the flag's place: its first key's
            dotted.append((str(key), name, keys.split("."), value))
        else:
            merged[name] = value
    based: set[str] = set()
    for key, name, keys, value in dotted:
        if name not in based:  # the flag's own mapping, copied (a YAML alias may share it), or a new one
            based.add(name)
            merged[name] = {} if merged[name] is None else copy.deepcopy(merged[name])
        target = merged[name]
        *parents, last = keys
        for parent in parents:
            target = target.setdefault(parent, {}) if isinstance(target, dict) else target
        if not isinstance(target, dict):
            command.error(f"--config {path}: the key {key!r} sets a field of {name!r}, which is not a JSON object")
        target[last] = value
    return {spelled[name]: value for name, value in merged.items()}


def _flag_args(key: str, value: Any, command: argparse.ArgumentParser, path: str) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if flag in NO_EFFECT_FLAGS:  # vLLM's flags whose setting asyncllm has: its note, as on the command line
        if not isinstance(value, bool) and value is not None:
            command.error(f"--config {path}: the key {key!r} is a flag: give true or false, got {value!r}")
        return known_vllm_flags([flag], command) if value else []
    if flag in VLLM_FLAGS or flag == "--structured-outputs-config":  # vLLM's own: read as on the command line
        if value is None or value is False or value == []:  # vLLM's defaults (null, false, []): left unset
            return []
        refused = VLLM_FLAGS.get(flag)
        if isinstance(refused, str) and flag != "--guided-decoding-backend":  # (a backend's value decides)
            command.error(f"vLLM's {flag} (the key {key!r} of --config {path}): {refused}")
        words = [flag] if value is True else [flag, _json(key, value, command, path) if isinstance(value, dict)
                                              else str(value)]
        return known_vllm_flags(words, command)
    if flag not in command._option_string_actions or flag == "--config":  # argparse would take a flag's prefix
        command.error(f"unrecognized arguments: {flag} (the key {key!r} of --config {path}; one config file)")
    if value is None:  # YAML's null: the option left unset
        return []
    action = command._option_string_actions[flag]
    if action.nargs == 0 and not isinstance(value, bool):
        command.error(f"--config {path}: the key {key!r} is a flag: give true or false, got {value!r}")
    if isinstance(value, bool):
        if value:
            return [flag]
        negative = "--no-" + key.replace("_", "-")
        return [negative] if negative in command._option_string_actions else []
    if isinstance(value, list) and action.nargs is None:  # one value (--allowed-origins' JSON list): the list's JSON,
        return [flag, _json(key, value, command, path)]     # not its items as words (the second would be MODEL)
    if isinstance(value, list):  # each item an argument, a mapping as JSON (lora-modules: [{name: a, path: /p}])
        return [flag, *(_json(key, item, command, path) if isinstance(item, dict) else str(item) for item in value)] \
            if value else []
    if isinstance(value, dict):
        return [flag, _json(key, value, command, path)]
    return [flag, str(value)]


def _json(key: str, value: dict[str, Any] | list[Any], command: argparse.ArgumentParser, path: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:  # a YAML date, set or binary in it: no JSON value
        command.error(f"--config {path}: the key {key!r} holds a value JSON cannot: {exc}")
