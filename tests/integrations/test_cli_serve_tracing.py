"""`asyncllm serve --otlp-traces-endpoint` (vLLM's flag): the server's request spans reach an OTLP collector."""

from __future__ import annotations

import gzip
import http.server
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from asyncllm.cli import main
from serve_helpers import line_with, wait_healthy

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class _Collector(http.server.ThreadingHTTPServer):
    """A stand-in OTLP/HTTP collector: keeps each POST's (path, body) and answers 200."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, bytes]] = []
        super().__init__(("127.0.0.1", 0), _Receive)


class _Receive(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.posts.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _spans(posts: list[tuple[str, bytes]]) -> list[tuple[dict, object]]:
    """Each exported span with its resource's attributes, decoded from the OTLP protobuf bodies."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = []
    for _, body in posts:
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            spans += [(resource, span) for scope in resource_spans.scope_spans for span in scope.spans]
    return spans


def test_serve_exports_the_request_span_to_the_otlp_endpoint(monkeypatch) -> None:
    collector = _Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # no timed export: the span is sent by the flush at SIGTERM
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "asyncllm", "serve", "--port", "0", "--max-num-seqs", "4",
                             "--disable-log-stats", "--log-level", "warning", "--otlp-traces-endpoint", endpoint],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        base = re.search(r" on (http://127\.0\.0\.1:\d+)/v1 once", line_with(proc, "starting: serving"))[1]
        wait_healthy(proc, base)
        completion = httpx.post(base + "/v1/completions", headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                                json={"model": "asyncllm-tiny", "prompt": "def ", "max_tokens": 3, "ignore_eos": True})
        assert completion.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        collector.shutdown()
    assert proc.returncode == -signal.SIGTERM
    assert {path for path, _ in collector.posts} == {"/v1/traces"}
    [(resource, span)] = [(r, s) for r, s in _spans(collector.posts) if s.name == "text_completion asyncllm-tiny"]
    assert resource["service.name"] == "asyncllm"
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, PARENT_ID)  # the caller's traceparent
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["gen_ai.usage.output_tokens"].int_value == 3


def test_a_missing_exporter_is_one_error_line_naming_its_package(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)  # not installed
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    with pytest.raises(SystemExit) as exit_info:  # grpc, vLLM's default protocol
        main(["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "pip install opentelemetry-exporter-otlp-proto-grpc" in err and "http/protobuf" in err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(SystemExit):
        main(["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318"])
    assert "grpc or http/protobuf" in capsys.readouterr().err


def test_collect_detailed_traces_takes_vllms_modules_and_needs_the_endpoint(capsys) -> None:
    from asyncllm.cli import _parser

    parsed = _parser().parse_args(["serve", "--collect-detailed-traces", "model,worker"])
    assert parsed.collect_detailed_traces == ["model", "worker"] and parsed.otlp_traces_endpoint is None
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--collect-detailed-traces", "all"])
    assert exit_info.value.code == 2 and "needs --otlp-traces-endpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--collect-detailed-traces", "scheduler"])
    assert "model, worker, all" in capsys.readouterr().err


def test_the_provider_exports_over_http_protobuf_with_asyncllms_service_name(monkeypatch) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from asyncllm.cli_tracing import tracer_provider

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # the traces' own variable wins
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mine")
    provider = tracer_provider("http://127.0.0.1:1/v1/traces")
    try:
        [processor] = provider._active_span_processor._span_processors
        assert isinstance(processor.span_exporter, OTLPSpanExporter)
        assert provider.resource.attributes["service.name"] == "mine"  # the environment's name is kept
    finally:
        provider.shutdown()


def test_an_empty_protocol_or_resource_variable_is_read_as_opentelemetrys_sdk_reads_it(monkeypatch) -> None:
    """OpenTelemetry's SDK reads an empty OTEL_EXPORTER_OTLP_TRACES_PROTOCOL as unset (then the general variable
    names the protocol), and OTEL_RESOURCE_ATTRIBUTES' keys with the spaces around them stripped."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from asyncllm.cli_tracing import span_exporter, tracer_provider

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)  # not installed
    assert isinstance(span_exporter("http://127.0.0.1:1/v1/traces"), OTLPSpanExporter)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod, service.name = mine")
    provider = tracer_provider("http://127.0.0.1:1/v1/traces")
    try:
        assert provider.resource.attributes["service.name"] == "mine"  # the environment's name is kept
    finally:
        provider.shutdown()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "peer.service.name=theirs")  # another attribute: no service name
    provider = tracer_provider("http://127.0.0.1:1/v1/traces")
    try:
        assert provider.resource.attributes["service.name"] == "asyncllm"
    finally:
        provider.shutdown()
