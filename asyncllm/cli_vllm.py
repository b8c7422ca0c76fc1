"""vLLM's command-line spellings read before argparse: ``serve --model X``, the dotted JSON flags
(``--limit-mm-per-prompt.image 2``) and the vLLM flags asyncllm has under another name or not at all.

`vllm_argv` rewrites a command's arguments (the words after ``--`` left as they are): ``--model X`` of serve and
engine becomes the positional MODEL (with vLLM's deprecation warning); each ``--FLAG.key VALUE`` of a JSON-object
flag is merged into that flag's object (VALUE as JSON when it parses, else the string; ``a.b`` nests; ``key+``
appends to a list; a JSON value given for the same flag is the base), as vLLM's "JSON CLI arguments"; `VLLM_FLAGS`
maps a vLLM flag to ours or refuses it naming the reason (docs/cli.md#vllm-flags).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from asyncllm.cli_args import is_json_object_flag

__all__ = ["known_vllm_flags", "vllm_argv", "NO_EFFECT_FLAGS", "VLLM_FLAGS"]

_NO_COMPILE = ("not built in asyncllm: it has no torch.compile levels or compilation config; CUDA graphs are captured "
               "where they apply (docs/kernels.md), --enforce-eager turns them off")
VLLM_FLAGS: dict[str, list[str] | str] = {
    "--disable-mm-preprocessor-cache": ["--mm-processor-cache-gb", "0"],
    "--compilation-config": _NO_COMPILE, "-cc": _NO_COMPILE, "-O": _NO_COMPILE, "--optimization-level": _NO_COMPILE,
    "--guided-decoding-backend": "not built in asyncllm: structured output always uses xgrammar",
    "--allowed-media-domains": "asyncllm fetches no http(s) media, so no domain can be allowed: send images, video "
                               "and audio as data: URLs, or as file:// URLs with --allowed-local-media-path "
                               "(docs/security.md)",
}
NO_EFFECT_FLAGS = {
    "--disable-fastapi-docs": "asyncllm's server has no /docs, /redoc or /openapi.json pages to disable",
    "--disable-frontend-multiprocessing": "asyncllm's server always runs in the process that serves HTTP, its engine "
                                          "core in its own process (docs/architecture.md)",
}
"""vLLM flags (taking no value) whose setting asyncllm already has: accepted, a note says why."""
VLLM_FLAGS.update({
    "--api-server-count": "not built in asyncllm: `asyncllm serve` is one server process; several share one engine "
                          "core as `asyncllm engine` plus one `asyncllm serve --connect ADDRESS` each "
                          "(docs/integrations/shared-engine.md)",
    "--enable-log-outputs": "not built in asyncllm: --enable-log-requests logs each request's prompt and "
                            "parameters, not its output",
    "--fully-sharded-loras": "not built in asyncllm: under tensor parallelism a column-parallel layer's adapter keeps "
                             "its whole A and its rows of B, a row-parallel one its columns of A (vLLM's default; "
                             "docs/lora.md)",
    "--lora-dtype": "not built in asyncllm: adapters are held in the model's dtype (vLLM's auto, accepted)",
    "--lora-extra-vocab-size": "not built in asyncllm: an adapter that adds tokens to the vocabulary is refused "
                               "(docs/lora.md)",
})
"""vLLM flag -> our arguments (the same setting; a note says so) or the reason it is refused. vLLM's
``--structured-outputs-config`` is read by `_structured_outputs` (its one setting: disable_any_whitespace); a backend
(``--guided-decoding-backend``'s too) of auto or xgrammar is accepted, another refused with the reason above."""
_O_LEVEL = re.compile(r"-O([0-3]|=\S+)?")
_TAKES_VALUE = frozenset({"--compilation-config", "-cc", "--optimization-level", "--guided-decoding-backend",
                          "--structured-outputs-config", "--api-server-count", "--lora-dtype",
                          "--lora-extra-vocab-size"})
_DEFAULT_VALUES = {"--api-server-count": ("1", "`asyncllm serve` is one server process"),
                   "--lora-dtype": ("auto", "adapters are held in the model's dtype")}
"""Refused vLLM flags given vLLM's default value: what asyncllm does, noted as having no effect."""


def vllm_argv(argv: list[str], command: argparse.ArgumentParser) -> list[str]:
    """`argv` (the command word first) with vLLM's spellings read as asyncllm's; `command` is its parser (its flags,
    its errors)."""
    end = argv.index("--") if "--" in argv else len(argv)
    words, rest = argv[:end], argv[end:]
    if words[0] in ("serve", "engine"):
        words = _model_flag(words)
    words = known_vllm_flags(words, command)
    return _dotted_json(words, command) + rest


def _model_flag(words: list[str]) -> list[str]:
    """vLLM's deprecated ``serve --model X``: X moved to the positional MODEL, with its warning."""
    for i, word in enumerate(words):
        if word == "--model" and i + 1 < len(words) or word.startswith("--model="):
            model = words[i + 1] if word == "--model" else word.removeprefix("--model=")
            print(f"[asyncllm] warning: with `asyncllm {words[0]}` give the model as the positional MODEL; "
                  f"--model is deprecated (as vLLM's) and read as `asyncllm {words[0]} {model}`", file=sys.stderr)
            kept = words[:i] + words[i + (2 if word == "--model" else 1):]
            return kept[:1] + [model] + kept[1:]
    return words


def known_vllm_flags(words: list[str], command: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        name, equals, value = word.partition("=")
        key = ""  # --structured-outputs-config.KEY's
        if _O_LEVEL.fullmatch(word) and not _takes_this_value(out[-1:], command):
            name = "-O"  # -O, -O0 ... -O3, -O=N: vLLM's optimisation level
        elif name in NO_EFFECT_FLAGS and not equals:
            print(f"[asyncllm] vLLM's {name} has no effect here: {NO_EFFECT_FLAGS[name]}", file=sys.stderr)
            i += 1
            continue
        elif name.split(".")[0] in VLLM_FLAGS or name.split(".")[0] == "--structured-outputs-config":
            name, _, key = name.partition(".")
        else:
            out.append(word)
            i += 1
            continue
        if name in _TAKES_VALUE and not equals and i + 1 < len(words):
            value, i = words[i + 1], i + 1
        i += 1
        if name == "--structured-outputs-config":  # its dotted form too: --structured-outputs-config.KEY VALUE
            out += _structured_outputs(json.dumps({key: _value(value)}) if key else value, command)
            continue
        if name == "--guided-decoding-backend":
            _backend(f"{name} {value!r}", value, command)
            continue
        if name in _DEFAULT_VALUES and value.strip() == _DEFAULT_VALUES[name][0]:  # vLLM's default: what we do
            print(f"[asyncllm] vLLM's {name} {value.strip()} has no effect here: {_DEFAULT_VALUES[name][1]}",
                  file=sys.stderr)
            continue
        meant = VLLM_FLAGS[name]
        if isinstance(meant, str):
            command.error(f"vLLM's {name}: {meant}")
        print(f"[asyncllm] vLLM's {name} read as {' '.join(meant)}", file=sys.stderr)
        out += meant
    return out


def _structured_outputs(raw: str, command: argparse.ArgumentParser) -> list[str]:
    """vLLM's ``--structured-outputs-config JSON``: disable_any_whitespace is our
    --structured-output-disable-any-whitespace; backend auto or xgrammar is what asyncllm uses; others refused."""
    try:
        settings = json.loads(raw)
    except json.JSONDecodeError:
        settings = None
    if not isinstance(settings, dict):
        command.error(f"vLLM's --structured-outputs-config: {raw!r} is not a JSON object")
    out = []
    for key, value in settings.items():
        if key == "disable_any_whitespace" and isinstance(value, bool):
            out.append(("--" if value else "--no-") + "structured-output-disable-any-whitespace")
        elif key == "backend":
            _backend(f"--structured-outputs-config backend={value!r}", value, command)
        else:
            command.error(f"vLLM's --structured-outputs-config {key}={value!r}: not built in asyncllm (it reads "
                          "disable_any_whitespace, i.e. --structured-output-disable-any-whitespace; the backend is "
                          "xgrammar)")
    return out


def _backend(flag: str, value: object, command: argparse.ArgumentParser) -> None:
    """vLLM's structured-output backend: auto or xgrammar is what asyncllm uses; another is refused."""
    if value not in ("auto", "xgrammar"):
        command.error(f"vLLM's {flag}: {VLLM_FLAGS['--guided-decoding-backend']} (auto or xgrammar are accepted)")


def _takes_this_value(before: list[str], command: argparse.ArgumentParser) -> bool:
    """The word after `before` (its last word or none) is that option's value (``--prompt -O3``), not a flag."""
    action = command._option_string_actions.get(before[0]) if before else None
    return action is not None and action.nargs != 0


def _json_flag(name: str, command: argparse.ArgumentParser) -> bool:
    action = command._option_string_actions.get(name)
    return action is not None and is_json_object_flag(action)


def _dotted_json(words: list[str], command: argparse.ArgumentParser) -> list[str]:
    """Each ``--FLAG.key VALUE`` / ``--FLAG.key=VALUE`` of a JSON-object flag merged into one ``--FLAG JSON``, at
    the place of the flag's first word."""
    dotted = {w.partition("=")[0].partition(".")[0] for w in words if "." in w.partition("=")[0] and w[:2] == "--"}
    merged: dict[str, dict[str, Any]] = {}
    out: list[str | tuple[str]] = []  # a 1-tuple: the place of a JSON flag's merged object
    i = 0
    while i < len(words):
        name, equals, value = words[i].partition("=")
        base, dot, keys = name.partition(".")
        if base not in dotted or not _json_flag(base, command):
            out.append(words[i])
            i += 1
            continue
        if not equals:
            if i + 1 >= len(words):
                command.error(f"argument {name}: expected one argument")
            value, i = words[i + 1], i + 1
        i += 1
        if base not in merged:
            merged[base] = {}
            out.append((base,))
        if dot:
            _put(merged[base], keys.split("."), _value(value), name, command)
        else:  # the JSON form (or the flag's other spelling): a base that dotted keys given after it update
            merged[base] = _deep_merge(merged[base], _whole(base, value, command))
    return [word for item in out for word in ([item[0], json.dumps(merged[item[0]])] if isinstance(item, tuple)
                                              else [item])]


def _whole(base: str, raw: str, command: argparse.ArgumentParser) -> dict[str, Any]:
    """The object ``base VALUE`` gives, read by the flag's own type (``--limit-mm-per-prompt image=2`` too)."""
    try:
        whole = command._option_string_actions[base].type(raw)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        whole = None
    if not isinstance(whole, dict):
        command.error(f"argument {base}: not a JSON object: {raw!r}")
    return whole


def _value(raw: str) -> Any:
    """A dotted key's value: JSON when it parses (``2``, ``true``, ``{"a": 1}``), else the string (``ngram``)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _put(target: dict[str, Any], keys: list[str], value: Any, name: str, command: argparse.ArgumentParser) -> None:
    """``a.b`` nests; a last key ``k+`` appends `value` to the list at k (vLLM's)."""
    *parents, last = keys
    for key in parents:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            command.error(f"argument {name}: {key!r} is not an object")
    if last.endswith("+"):
        items = target.setdefault(last[:-1], [])
        if not isinstance(items, list):
            command.error(f"argument {name}: {last[:-1]!r} is not a list")
        items.append(value)
    else:
        target[last] = value


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        both = isinstance(merged.get(key), dict) and isinstance(value, dict)
        merged[key] = _deep_merge(merged[key], value) if both else value
    return merged
