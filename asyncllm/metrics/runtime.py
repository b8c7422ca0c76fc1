"""The process's own series on the OpenAI server's ``/metrics``: prometheus_client's default collectors.

vLLM's ``/metrics`` serves prometheus_client's default registry, so it carries ``process_*`` (CPU seconds, resident
and virtual memory, open file descriptors, start time: Linux only), ``python_gc_*`` and ``python_info`` beside its
own series. The server's ``/metrics`` adds the same three collectors to the engine's registry's series, from a
registry of this module's own: nothing is registered in the host's registry nor in ``prometheus_client.REGISTRY``.
They are left out

- when the engine's registry already exports them (the host passed ``prometheus_registry=prometheus_client.REGISTRY``,
  which has them, or registered them in its registry itself): a scrape never shows a family twice;
- in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), as prometheus_client's guidance for that mode says (custom
  collectors such as the CPU and memory ones do not work there; vLLM's multiprocess ``/metrics`` has none): a
  scrape reaches one worker, whose process series would stand for all of them.
"""

from __future__ import annotations

import re
import threading

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest

__all__ = ["with_runtime"]

_RUNTIME_FAMILY = re.compile(rb"^# TYPE (process_|python_gc_|python_info )", re.MULTILINE)
"""A family of one of the default collectors in a scrape's text: the registry exports them already."""

_registry: CollectorRegistry | None = None
_lock = threading.Lock()


def _runtime_registry() -> CollectorRegistry:
    """The three default collectors in a registry of their own, made once per process."""
    global _registry
    with _lock:
        if _registry is None:
            registry = CollectorRegistry()
            for collector in (ProcessCollector, GCCollector, PlatformCollector):
                collector(registry=registry)
            _registry = registry
        return _registry


def with_runtime(body: bytes) -> bytes:
    """`body` (a registry's Prometheus text) followed by the default collectors' series, unless it has one of their
    families already (read from the text itself: however the host registered them)."""
    return body if _RUNTIME_FAMILY.search(body) else body + generate_latest(_runtime_registry())
