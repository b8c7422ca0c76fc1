"""The `asyncllm` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from asyncllm import __version__, envs
from asyncllm.cli_args import add_engine_args, engine_kwargs
from asyncllm.cli_commands import add_engine_parser, add_serve_parser, check_model, run_engine, run_serve
from asyncllm.cli_config import dash_flag_names, expand_config_file
from asyncllm.cli_vllm import vllm_argv
from asyncllm.config import EngineConfig
from asyncllm.errors import AsyncLLMError, ConfigError, InvalidRequestError
from asyncllm.sampling import SamplingParams


_REQUEST_FLAGS = frozenset({"seed"})
"""EngineConfig fields whose flag `generate` gives its request: its ``--seed`` is the request's seed."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncllm: an embeddable LLM engine",
                                     allow_abbrev=False)
    parser.add_argument("-V", "--version", action="version", version=__version__,
                        help="print asyncllm's version and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream one completion to stdout", allow_abbrev=False)
    gen.add_argument("prompt", nargs="?", default="def fibonacci(n):", help="the prompt (default: %(default)r)")
    gen.add_argument("--model", default=None,
                     help="local folder or hub id; default: the bundled tiny model (no download)")
    gen.add_argument("--max-tokens", type=int, default=None,
                     help="default: the model's generation config (--generation-config, --override-generation-config), "
                          "else 64")
    gen.add_argument("--temperature", type=float, default=None,
                     help="0 is greedy; default: the model's generation config, else 0.7 (sampling reads better from "
                          "small models)")
    gen.add_argument("--seed", type=int, default=None, help="the request's seed (default: none)")
    add_engine_args(gen, skip=_REQUEST_FLAGS)  # serve's and engine's flags (--trust-remote-code, --device, ...)
    add_serve_parser(commands)
    add_engine_parser(commands)
    commands.add_parser("bench", help="run a standard benchmark workload (asyncllm bench --help)", add_help=False)
    return parser


_FALLBACKS = {"max_tokens": 64, "temperature": 0.7}
"""`generate`'s request where neither its flags nor the model's generation config set a field."""


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields `generate`'s flags set (``--seed`` too)."""
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    return {field: value for field, value in given.items() if value is not None}


def _generate_setup(args: argparse.Namespace) -> tuple[EngineConfig, SamplingParams]:
    """The engine's config and the request's sampling params, checked before anything starts."""
    if not args.prompt:  # as the engine refuses it, before the model is resolved or loaded
        raise InvalidRequestError("prompt", "the prompt is empty")
    model = args.model
    if model is None:
        from asyncllm.bundled import bundled_model_path

        model = bundled_model_path()
        print("[asyncllm] no --model given: the bundled tiny model (trained on Python's stdlib source; "
              "it writes Python-like text, not answers)", file=sys.stderr)
    params = SamplingParams(**{**_FALLBACKS, **_given(args)})
    params.validate()  # the flags checked before anything starts; the model's defaults come in `_generate`
    config = EngineConfig.create(model, **{"disable_log_stats": True, **engine_kwargs(args, skip=_REQUEST_FLAGS)})
    check_model(config)
    return config, params


async def _generate(args: argparse.Namespace, config: EngineConfig, params: SamplingParams) -> None:
    from asyncllm import AsyncEngine

    async with AsyncEngine.from_config(config) as engine:
        await engine.start()  # the model's generation config is read: its sampling fields under the flags given
        params = SamplingParams(**{**_FALLBACKS, **engine.default_sampling_fields(), **_given(args)})
        params.validate()
        sys.stdout.write(args.prompt)
        async for delta in engine.stream(args.prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.finished:
                print(f"\n[asyncllm] finish_reason={delta.finish_reason}", file=sys.stderr)


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser`'s namespace for `argv`, serve's and engine's ``--config FILE`` read first (asyncllm/cli_config.py)."""
    config_model, command = None, None
    if argv[:1] in (["serve"], ["engine"], ["generate"]):
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = commands.choices[argv[0]]
        argv = vllm_argv(argv, command)  # serve --model X, --hf-overrides.key V, vLLM's other flags
    typed = argv
    if argv[:1] in (["serve"], ["engine"]):
        argv, config_model = expand_config_file(argv, command)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own error (`asyncllm serve: error: ...`), not the top-level parser's
        (command or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if config_model is not None and args.model is None:
        args.model = config_model
    _check_lists_left_the_model(parser, typed, args)
    return args


_LIST_WORDS = {"KEY": "keys", "NAME": "names"}


def _check_lists_left_the_model(parser: argparse.ArgumentParser, typed: list[str], args: argparse.Namespace) -> None:
    """Refuse ``serve --served-model-name NAME MODEL`` (``--api-key K1 K2``, any option taking several values) with
    no MODEL: the values may have taken MODEL, and the server would serve the bundled model with MODEL as a name or
    a key. Values a config file gave (its options end before the command line's) and values ended with ``--`` are
    what was meant."""
    if args.command != "serve" or args.model is not None or "--" in typed or getattr(args, "connect", None):
        return  # with --connect a MODEL is an error of its own: the values took none
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in commands.choices["serve"]._actions:
        values = getattr(args, action.dest, None)
        if action.nargs != "+" or not action.option_strings or not isinstance(values, list) or len(values) < 2:
            continue
        if not all(isinstance(value, str) for value in values):
            continue  # its type read each value (--lora-modules: NAME=PATH or JSON): a MODEL there was refused
        flag = max(action.option_strings, key=len)
        if any(len(word) > 3 and "=" not in word and flag.startswith(word) for word in typed):
            what = _LIST_WORDS.get(str(action.metavar), "values")
            parser.error(f"{flag} took {len(values)} {what} and there is no MODEL: the {what} may have taken MODEL "
                         f"({values[-1]!r}?): put MODEL before {flag}, or end the {what} with `--` (MODEL after it, "
                         "or nothing for the bundled model)")


def main(argv: list[str] | None = None) -> None:
    argv = dash_flag_names(sys.argv[1:] if argv is None else argv)  # vLLM's --max_model_len too, for every command
    if argv[:1] == ["bench"]:  # its own parser: asyncllm.bench.cli
        from asyncllm.bench.cli import main as bench_main

        sys.exit(bench_main(argv[1:]))
    parser = _parser()
    args = parse_args(parser, argv)
    try:  # the environment's values, before a command imports transformers (whose import of huggingface_hub fails on
        envs.check_at_start()  # a bad HF_HUB_ETAG_TIMEOUT) or starts anything: one line, as a bad flag
    except ConfigError as exc:
        parser.error(str(exc))
    if args.command == "generate":
        try:  # a bad value (a flag, the model, an ASYNCLLM_* variable) is one line and exit 2, as serve's and engine's
            asyncio.run(_generate(args, *_generate_setup(args)))
        except (ConfigError, InvalidRequestError) as exc:
            parser.error(str(exc))
        except AsyncLLMError as exc:  # the engine failed while generating: no usage line, exit 1
            sys.exit(f"asyncllm generate: {type(exc).__name__}: {exc}")
        except BrokenPipeError:  # `asyncllm generate | head`: the reader left; quiet, as a shell tool (Python's recipe)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)
        except KeyboardInterrupt:  # Ctrl-C while the hub id resolved, the model loaded or the text streamed: exit 130
            logging.getLogger("asyncio").disabled = True  # quiet, as serve's: no "Task exception was never retrieved"
            sys.exit(130)
    elif args.command == "serve":
        run_serve(args, parser)
    elif args.command == "engine":
        run_engine(args, parser)


if __name__ == "__main__":
    main()
