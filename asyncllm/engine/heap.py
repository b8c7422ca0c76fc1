"""A server's startup heap, frozen out of the garbage collector's reach (`freeze_startup_heap`).

A started host holds some 300k objects that live as long as it does (torch, transformers, the tokenizer, the
model's config): every collection of the oldest generation walks them all, a pause of up to a second on the event
loop under a burst of requests. vLLM's server collects, then freezes them (``gc.collect(); gc.freeze()``) once it
has started; ``asyncllm serve`` does the same once its engine started. Frozen objects are still freed when their
reference count drops to zero, but their reference cycles are never collected: an `AsyncEngine` frozen and then
dropped without ``aclose()`` would never be collected (nor its cores stopped by `stop_forgotten`), and a closed
engine's cycles would add up in a process that makes many. So `AsyncEngine.start` freezes nothing; an application
that keeps one engine for its life may call this after starting it.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["freeze_startup_heap"]

_lock = threading.Lock()
_frozen = False


def freeze_startup_heap() -> None:
    """Collect garbage, then freeze every object tracked now (`gc.freeze`); the first call of the process only."""
    global _frozen
    with _lock:
        if _frozen:
            return
        _frozen = True
    gc.collect()
    gc.freeze()
