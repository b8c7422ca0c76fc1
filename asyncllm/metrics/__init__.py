"""Observability that cooperates with the host application.

- `host_stats`: the host-side counters and histograms behind `AsyncEngine.stats()`,
  the Prometheus series and the stats log line (one writer: the processor thread).
- `request_timing`: the engine core's scheduling events -> `RequestMetrics` -> histograms.
- `prometheus`: a collector registered in the host's (or a private) `CollectorRegistry`.
- `runtime`: prometheus_client's process, GC and platform series for the OpenAI server's ``/metrics``.
- `tracing`: one OpenTelemetry span per request, from the host's tracer provider.
- `observer`: the few hooks the processor thread calls.

docs/observability.md describes what is exported and why.
"""
