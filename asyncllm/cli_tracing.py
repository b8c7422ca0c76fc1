"""``asyncllm serve --otlp-traces-endpoint URL`` and ``--collect-detailed-traces``: vLLM's tracing flags.

The engine never installs a tracer provider (asyncllm/metrics/tracing.py): an application that embeds it sets its
own. ``asyncllm serve`` is asyncllm's own process, so there, as ``vllm serve`` does, ``--otlp-traces-endpoint`` sets
the process's tracer provider: OpenTelemetry's SDK with a batching OTLP span exporter to URL. The protocol is
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (else ``OTEL_EXPORTER_OTLP_PROTOCOL``): ``grpc`` by default, as vLLM's, or
``http/protobuf`` (URL is then the full ``.../v1/traces`` address); the exporter's other ``OTEL_EXPORTER_OTLP_*``
variables apply (headers, certificates, timeout). A missing package is one ``asyncllm: error:`` line naming it,
before the model loads. The spans still queued are sent when the server stops (Ctrl-C or SIGTERM: `flush_traces`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from asyncllm.errors import ConfigError

__all__ = ["add_tracing_args", "start_tracing", "flush_traces", "DETAILED_TRACE_MODULES", "span_exporter"]

DETAILED_TRACE_MODULES = ("model", "worker", "all")
"""vLLM's ``--collect-detailed-traces`` values."""
_EXPORTERS = {"grpc": "opentelemetry-exporter-otlp-proto-grpc",
              "http/protobuf": "opentelemetry-exporter-otlp-proto-http"}
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
"""Where the protocol is read, the traces' own first (OpenTelemetry's order)."""
_installed: list[Any] = []
"""The tracer provider `start_tracing` set (one at most)."""


def add_tracing_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send each request's OpenTelemetry span to this OTLP collector (grpc, or http/protobuf "
                            "with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL; vLLM's flag; docs/observability.md)")
    serve.add_argument("--collect-detailed-traces", type=_modules, default=None, metavar="MODULES",
                       help="vLLM's flag (model, worker or all, comma-separated; needs --otlp-traces-endpoint): "
                            "accepted, adds nothing: every span carries the per-phase latencies already")


def _modules(raw: str) -> list[str]:
    modules = [item.strip() for item in raw.split(",") if item.strip()]
    bad = [item for item in modules if item not in DETAILED_TRACE_MODULES]
    if bad or not modules:
        raise argparse.ArgumentTypeError(f"{raw!r}: one or more of {', '.join(DETAILED_TRACE_MODULES)}, "
                                         "comma-separated")
    return modules


def start_tracing(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Set the process's tracer provider from ``--otlp-traces-endpoint`` (nothing without it); a flag or package
    problem is `parser.error`."""
    if args.collect_detailed_traces and args.otlp_traces_endpoint is None:
        parser.error("--collect-detailed-traces needs --otlp-traces-endpoint (as vLLM's)")
    if args.otlp_traces_endpoint is None:
        return
    try:
        provider = tracer_provider(args.otlp_traces_endpoint)
    except ValueError as exc:  # a ConfigError too
        parser.error(str(exc))
    from opentelemetry import trace

    trace.set_tracer_provider(provider)
    _installed.append(provider)
    if args.collect_detailed_traces:
        print(f"[asyncllm] vLLM's --collect-detailed-traces {','.join(args.collect_detailed_traces)} adds nothing "
              "here: every request span carries its queue, prefill, decode and inference times already",
              file=sys.stderr)


def tracer_provider(endpoint: str) -> Any:
    """OpenTelemetry SDK's `TracerProvider` exporting in batches to `endpoint` (`span_exporter`), its resource's
    ``service.name`` asyncllm unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` names one."""
    exporter = span_exporter(endpoint)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = bool(os.environ.get("OTEL_SERVICE_NAME")) or "service.name" in _resource_keys()
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "asyncllm"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _resource_keys() -> set[str]:
    """The attribute keys ``OTEL_RESOURCE_ATTRIBUTES`` names, parsed as OpenTelemetry's SDK parses them (comma-separated
    ``key=value`` pairs, the spaces around a key stripped: its ``OTELResourceDetector``)."""
    items = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return {item.split("=", 1)[0].strip() for item in items if "=" in item}


def span_exporter(endpoint: str) -> Any:
    """The OTLP span exporter of the configured protocol; a ValueError naming the package to install when it (or
    OpenTelemetry's SDK) is missing, a `ConfigError` naming the protocols for another protocol."""
    # an empty variable is unset, as OpenTelemetry's SDK reads it (its configurator: the traces' or else the general)
    name = next((name for name in _PROTOCOL_VARIABLES if os.environ.get(name, "").strip()), _PROTOCOL_VARIABLES[0])
    protocol = os.environ.get(name, "").strip() or "grpc"
    if protocol not in _EXPORTERS:
        raise ConfigError(name, protocol, "grpc or http/protobuf (OpenTelemetry's Python OTLP span exporters)")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ValueError(_missing(protocol, name, exc)) from None
    return OTLPSpanExporter(endpoint=endpoint)


def _missing(protocol: str, variable: str, error: ImportError) -> str:
    """What to install for `protocol`'s exporter (and, for grpc, the protocol whose exporter the extra brings)."""
    fix = f"pip install {_EXPORTERS[protocol]}"
    if protocol == "grpc":  # asyncllm[tracing] brings the http/protobuf exporter only (grpcio is a large build)
        fix += f", or set {variable}=http/protobuf (its exporter comes with 'asyncllm[tracing]')"
    else:
        fix += " (or 'asyncllm[tracing]')"
    return f"--otlp-traces-endpoint: the OTLP {protocol} span exporter is not installed ({error}): {fix}"


def flush_traces() -> None:
    """Send the spans still queued and stop the exporter (the server stopped: every request span has ended)."""
    while _installed:
        _installed.pop().shutdown()
