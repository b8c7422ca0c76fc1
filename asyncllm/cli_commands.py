"""``asyncllm serve`` (the OpenAI-compatible server) and ``asyncllm engine`` (a shared standalone core).

Both take every `EngineConfig` field as a flag (asyncllm/cli_args.py) and the
bundled tiny model when no model is given; docs/cli.md is their reference.
"""

from __future__ import annotations

import argparse
import json
import signal
import ssl
import sys
from typing import Any

from asyncllm import envs
from asyncllm.chat_content import CONTENT_FORMATS
from asyncllm.child_logging import log_to_stderr
from asyncllm.cli_args import add_engine_args, engine_kwargs, json_object
from asyncllm.cli_tracing import add_tracing_args, start_tracing
from asyncllm.errors import ConfigError
from asyncllm.reasoning import REASONING_PARSERS
from asyncllm.tool_calls import TOOL_PARSERS

__all__ = ["add_serve_parser", "add_engine_parser", "run_serve", "run_engine", "cors_policy", "warn_open_cors",
           "uvicorn_kwargs", "check_tls_args", "add_config_arg", "request_logger", "log_stats",
           "check_model"]

def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server (uvicorn)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    serve.add_argument("model", nargs="?", default=None,
                       help="local folder or hub id; default: the bundled tiny model (no download)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s, this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port (default: %(default)s)")
    serve.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                       help="the model ids clients may send; responses carry the first "
                            "(default: MODEL as given, or asyncllm-tiny)")
    serve.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on /v1 routes, KEY any of those given (vLLM's; "
                            f"or set {envs.API_KEY.name} or {envs.VLLM_API_KEY_NAME}, one key)")
    serve.add_argument("--connect", default=None, metavar="ADDRESS",
                       help="attach to a running `asyncllm engine` core at ADDRESS instead of starting one")
    serve.add_argument("--max-n", type=int, default=128, help="largest n per request (default: %(default)s)")
    serve.add_argument("--max-tokens-limit", type=int, default=None,
                       help="largest max_tokens per request, and the default of a chat request without one "
                            "(default: none, max_model_len bounds it)")
    serve.add_argument("--max-prompts", type=int, default=2048,
                       help="most prompts per /v1/completions request, inputs per /v1/embeddings and /classify, "
                            "texts per /score, documents per /rerank (default: %(default)s)")
    serve.add_argument("--max-body-bytes", type=int, default=64 << 20,
                       help="largest request body (default: 64 MiB, a few photos as data URLs)")
    serve.add_argument("--max-audio-bytes", type=int, default=25 << 20,
                       help="largest audio upload to /v1/audio/transcriptions and /translations (default: 25 MiB)")
    serve.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let requests name media files inside DIR as file:// URLs (trusted clients only; "
                            "default: no file is read for a request)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide to call tools (tool_choice 'auto'); needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the format of the model's tool calls (hermes: Qwen2.5/3, Hermes; llama3_json: Llama 3.1; "
                            "pythonic: Llama 3.2/4; mistral: Mistral; the others are named for their models: "
                            "docs/cli.md)")
    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split chat replies into reasoning and content (deepseek_r1: DeepSeek-R1, QwQ; qwen3; the "
                            "others are named for their models: docs/cli.md)")
    serve.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                       help="a Jinja chat template (file or text) used instead of the tokenizer's")
    serve.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                       help="how message content reaches the chat template: string (text parts joined with a "
                            "newline), openai (a list of parts) or auto (as the template reads it; vLLM's flag)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name tokens 'token_id:N' instead of their text (vLLM's flag)")
    serve.add_argument("--response-role", default="assistant",
                       help="the role of chat replies to a generation prompt (vLLM's flag)")
    serve.add_argument("--enable-request-id-headers", action="store_true",
                       help="put X-Request-Id on every response: the request's own, else a random id (vLLM's flag)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat_template (Jinja from clients)")
    serve.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                       help="LoRA adapters served as models of their own: a request with model NAME runs with the "
                            "adapter at PATH; also JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
                            "(needs --enable-lora; given again, the last list replaces the others, as vLLM's)")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage carries prompt_tokens_details.cached_tokens: prompt tokens served from the "
                            "prefix cache (vLLM's flag)")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream carries usage on every chunk and ends with the usage chunk, whatever "
                            "stream_options asks (vLLM's flag)")
    serve.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                       help="chat template variables for every request, under a request's own chat_template_kwargs, "
                            "e.g. '{\"enable_thinking\": false}' (vLLM's flag)")
    _add_request_log_args(serve)
    add_tracing_args(serve)
    _add_http_args(serve)
    add_config_arg(serve)
    add_engine_args(serve)


def add_config_arg(command: argparse.ArgumentParser) -> None:
    """vLLM's ``--config FILE`` (asyncllm/cli_config.py reads it before argparse sees the command line)."""
    command.add_argument("--config", default=None, metavar="FILE",
                         help="a YAML file of options (long names as keys, e.g. 'port: 8001'); the command "
                              "line's own win (vLLM's flag)")


def _add_request_log_args(serve: argparse.ArgumentParser) -> None:
    """vLLM's request log flags (integrations/openai_request_log.py)."""
    serve.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                       help="log each request: an INFO line (its id, sampling params, LoRA adapter) and its prompt "
                            "at DEBUG, on the asyncllm.integrations.openai.requests logger (vLLM's flag)")
    serve.add_argument("--disable-log-requests", action=_DeprecatedFlag, default=True,
                       help="[DEPRECATED] vLLM's old flag, accepted with a warning: requests are not logged "
                            "without --enable-log-requests")
    serve.add_argument("--max-log-len", type=int, default=None, metavar="N",
                       help="the request log shows at most N characters of a prompt and N of its token ids "
                            "(default: all; vLLM's flag)")


class _DeprecatedFlag(argparse.BooleanOptionalAction):
    """A flag kept for vLLM's command lines: warns as argparse's ``deprecated=True`` (Python 3.13, vLLM's)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: option '{option_string}' is deprecated", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def _port(raw: str) -> int:
    """A TCP port number (0: any free one)."""
    try:
        port = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {raw!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {port}")
    return port


def request_logger(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The server's `RequestLogger` from ``--enable-log-requests`` and ``--max-log-len`` (None: no log). Its lines
    go to stderr unless logging is configured (`log_to_stderr`)."""
    from asyncllm.integrations.openai_request_log import RequestLogger, logger

    if args.max_log_len is not None and args.max_log_len < 0:
        parser.error(f"--max-log-len: at least 0, got {args.max_log_len}")
    if not args.enable_log_requests:
        return None
    log_to_stderr(logger, unless_configured=True)
    return RequestLogger(args.max_log_len)


def log_stats(config: Any) -> None:
    """The periodic stats line to stderr, as vLLM's serve prints it (`log_to_stderr`), unless
    ``--disable-log-stats``."""
    from asyncllm.engine.stats_log import logger

    if not config.disable_log_stats:
        log_to_stderr(logger, unless_configured=True)


def _add_http_args(serve: argparse.ArgumentParser) -> None:
    """vLLM's CORS and uvicorn flags (`cors_policy`, `uvicorn_kwargs`)."""
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        serve.add_argument(f"--allowed-{flag}", type=_json_list, default=["*"], metavar="JSON",
                           help=f"CORS: the {what} browsers may use, a JSON list (default: [\"*\"])")
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    serve.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (--uvicorn-log-level: vLLM's name)")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true", help="no uvicorn access log lines")
    serve.add_argument("--root-path", default="", metavar="PREFIX",
                       help="the path prefix a proxy serves the app under (ASGI root_path)")
    serve.add_argument("--shutdown-timeout", type=_seconds, default=0.0, metavar="SECONDS",
                       help="vLLM's: after SIGINT/SIGTERM, 0 (the default) aborts the requests in flight at once "
                            "(finish_reason \"abort\"); N drains: new requests are refused, those in flight run on "
                            "for up to N seconds, then the rest are aborted")
    serve.add_argument("--uds", default=None, metavar="PATH", help="listen on this Unix socket instead of host:port")
    serve.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="HTTPS: the server's private key")
    serve.add_argument("--ssl-certfile", default=None, metavar="PATH", help="HTTPS: the server's certificate")
    serve.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                       help="HTTPS: CA certificates that clients' certificates are checked against")
    serve.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2], metavar="N",
                       help="HTTPS: whether clients need a certificate (0 none, 1 optional, 2 required; ssl's CERT_*)")


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"not a number of seconds >= 0: {raw!r}")
    return value


def _json_list(raw: str) -> list[str]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {raw!r}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {raw!r}")
    return value


def cors_policy(args: argparse.Namespace) -> Any:
    """The app's `CorsPolicy` from the CORS flags (always one, as vLLM's server: by default any origin)."""
    from asyncllm.integrations.openai_http import CorsPolicy

    return CorsPolicy(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def warn_open_cors(cors: Any, api_keys: list[str]) -> None:
    """Warn that any origin with no key lets every web page the user's browser opens read the server (a
    localhost one too: binding to 127.0.0.1 does not stop a browser on the same machine; docs/security.md)."""
    if not api_keys and "*" in cors.allowed_origins:
        print("[asyncllm] warning: no --api-key and CORS allows any origin (--allowed-origins '[\"*\"]', vLLM's "
              "default): any web page opened in a browser on a machine that reaches this server, this one "
              "included, can call it and read the replies; set --api-key or --allowed-origins", file=sys.stderr)


CLOSE_GRACE_S = 30.0
"""After a shutdown's drain (``--shutdown-timeout``) the engine aborts what is left: how long uvicorn then waits for
open connections to close (a client that does not read) before it cuts them (its ``timeout_graceful_shutdown`` is the
drain plus this)."""


def uvicorn_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`uvicorn.run`'s keywords from the serve flags: a Unix socket (`--uds`) replaces host and port."""
    where = {"uds": args.uds} if args.uds is not None else {"host": args.host, "port": args.port}
    return {**where, "log_level": args.log_level, "access_log": not args.disable_uvicorn_access_log,
            "root_path": args.root_path, "ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
            "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs,
            "timeout_graceful_shutdown": args.shutdown_timeout + CLOSE_GRACE_S}


def check_tls_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse TLS flags uvicorn would ignore (client certificates without a certificate of the server's: plain HTTP)
    or fail on (a key without its certificate, or the reverse)."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("--ssl-keyfile and --ssl-certfile go together (HTTPS needs the key and its certificate)")
    if args.ssl_certfile is None and (args.ssl_ca_certs is not None or args.ssl_cert_reqs != ssl.CERT_NONE):
        parser.error("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile "
                     "(without them the server speaks plain HTTP and checks no client certificate)")


def _lora_module(raw: str) -> Any:
    """One ``--lora-modules`` item; argparse reports a bad one with what is wrong."""
    from asyncllm.integrations.openai_lora import LoRAModule

    try:
        return LoRAModule.parse(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_parser(commands: Any) -> None:
    from asyncllm.engine.connect import default_address

    core = commands.add_parser(
        "engine", help="run a standalone engine core that several host processes share",
        description="Load MODEL and serve hosts that attach with AsyncEngine.connect(ADDRESS) "
                    "(uvicorn/gunicorn workers, Celery workers, scripts) until SIGTERM or Ctrl-C.",
    )
    core.add_argument("model", nargs="?", default=None,
                      help="local folder or hub id; default: the bundled tiny model (no download)")
    core.add_argument("--address", default=default_address(),
                      help="ipc://PATH socket to listen on (default: %(default)s), or tcp://HOST:PORT with "
                           "ASYNCLLM_ENGINE_KEY set (CURVE-encrypted and authenticated; docs/security.md)")
    add_config_arg(core)
    add_engine_args(core)


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Check the flags and build the app, bind the socket (as vLLM's `run_server`: a port in use fails before the
    model is downloaded or loaded), check the model, then start the engine and serve (asyncllm/cli_serve.py)."""
    try:
        import starlette, uvicorn  # noqa: F401, E401 - the server extra, not among asyncllm's own dependencies
    except ModuleNotFoundError as exc:
        sys.exit(f"asyncllm serve: the server is not installed ({exc}): pip install 'asyncllm[server]'")
    from asyncllm.cli_serve import bound_socket, serve_app

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(sorted(TOOL_PARSERS))})")
    if args.lora_modules and args.connect is None and not getattr(args, "enable_lora", False):
        parser.error("--lora-modules needs --enable-lora (the engine serves adapters only with it)")
    check_tls_args(args, parser)
    start_tracing(args, parser)  # before the engine: its spans come from the process's tracer provider
    try:
        engine, app = _serve_app(args, parser)
        log_stats(engine.config)
    except ConfigError as exc:
        parser.error(str(exc))
    with bound_socket(args, parser) as sock:
        try:
            if args.connect is None:
                check_model(engine.config)
        except ConfigError as exc:
            parser.error(str(exc))
        except KeyboardInterrupt:  # Ctrl-C while a hub id resolved (a slow network): as during the load, exit 130
            sys.exit(130)
        serve_app(app, engine, sock, args, parser)


def _serve_app(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, Any]:
    """The engine (not started) and the OpenAI app over it: nothing read but the flags' own files."""
    from asyncllm.integrations.openai_server import create_app

    limits = _server_limits(args)
    engine, name = _serve_engine(args)
    api_keys = [key for key in (args.api_key or [envs.api_key()]) if key]  # the flag's, else ASYNCLLM_/VLLM_API_KEY
    cors = cors_policy(args)
    warn_open_cors(cors, api_keys)
    app = create_app(engine, model_name=name, api_key=api_keys, limits=limits,
                     tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                     chat_template=args.chat_template, trust_request_chat_template=args.trust_request_chat_template,
                     reasoning_parser=args.reasoning_parser, lora_modules=args.lora_modules or (),
                     return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                     enable_request_id_headers=args.enable_request_id_headers,
                     response_role=args.response_role, cors=cors,
                     chat_template_content_format=args.chat_template_content_format,
                     enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                     enable_force_include_usage=args.enable_force_include_usage,
                     default_chat_template_kwargs=args.default_chat_template_kwargs,
                     request_logger=request_logger(args, parser))
    return engine, app


def _server_limits(args: argparse.Namespace) -> Any:
    """The app's `ServerLimits` from serve's flags: one below 1 is a `ConfigError` (--max-tokens-limit's names
    max_tokens_limit, not the request's max_tokens)."""
    from asyncllm.integrations.openai_protocol import ServerLimits

    try:
        return ServerLimits(max_body_bytes=args.max_body_bytes, max_audio_bytes=args.max_audio_bytes,
                            max_n=args.max_n, max_tokens=args.max_tokens_limit, max_prompts=args.max_prompts,
                            allowed_local_media_path=args.allowed_local_media_path)
    except ConfigError as exc:
        if exc.field != "max_tokens":
            raise
        raise ConfigError("max_tokens_limit", exc.value, "an int >= 1 (unset: max_model_len bounds it)") from None


def check_model(config: Any) -> None:
    """Refuse a model that cannot be found, or a --generation-config that cannot be read, before the engine starts
    worker processes (a hub model is downloaded here; the engine checks them again)."""
    from asyncllm.generation_config import read_generation_config
    from asyncllm.models.checkpoint import resolve_model_path

    path = resolve_model_path(config.model, config.revision, config.download_dir, load_format=config.load_format,
                              trust_remote_code=config.trust_remote_code)  # its *.py too, as the engine fetches
    read_generation_config(config.generation_config, path)


def _serve_engine(args: argparse.Namespace) -> tuple[Any, str | None]:
    from asyncllm import AsyncEngine
    from asyncllm.integrations.openai_info import served_name

    kwargs = engine_kwargs(args)
    if args.connect is not None:  # host-side flags only (`config.HOST_SIDE_FIELDS`): AsyncEngine.connect checks
        if args.model is not None:
            raise ConfigError("connect", args.connect, "no MODEL with --connect: give it to `asyncllm engine`")
        engine = AsyncEngine.connect(args.connect, **kwargs)
    else:
        engine = AsyncEngine(args.model, **kwargs)
    # as vLLM's metrics: labelled with the first served name (asyncllm-tiny for the bundled model, not its folder)
    first = args.served_model_name[0] if args.served_model_name else served_name(engine.config.model)
    if first is not None:  # None: attached to a shared core, labelled with its model once attached
        engine.set_served_model_name(first)
    return engine, args.served_model_name


def run_engine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from asyncllm.bundled import bundled_model_path
    from asyncllm.config import EngineConfig
    from asyncllm.engine.standalone import run_standalone_core

    try:
        config = EngineConfig.create(args.model or bundled_model_path(), **engine_kwargs(args))
    except ConfigError as exc:
        parser.error(str(exc))

    def announce() -> None:
        print(f"[asyncllm] engine core serving {config.model} at {args.address} "
              f"(attach with AsyncEngine.connect({args.address!r}); stop with Ctrl-C or SIGTERM)",
              file=sys.stderr, flush=True)

    try:
        run_standalone_core(config, args.address, on_ready=announce)
    except ConfigError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:  # Ctrl-C while the model was still loading
        sys.exit(130)
    # stopped cleanly (workers, hosts, socket): a repeated SIGTERM / Ctrl-C during the interpreter's exit (about a
    # second of torch's teardown, after Python's own handlers are gone) is ignored rather than turning exit 0 to 143
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
