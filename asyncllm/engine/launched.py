"""`Launched`: what one replica's start (or core restart) launched so far, for a takeover to stop.

A start runs as tasks of the engine's event loop. A loop stopped and closed while it is pending (``loop.stop()``,
Ctrl-C out of ``loop.run_until_complete``, a host that closes its loop without cancelling its tasks) never resumes
nor cancels them: the core, processor thread and workers they launched would run on with nobody to stop them (a
loop that cancels its tasks as it ends, as ``asyncio.run`` does, lets the start stop them itself). The next loop's
takeover (`EngineLoop._rebind`) drops such a start: what it launched is stopped in a thread, and what its threads
launch after that (a core whose spawn was under way) is stopped as it comes. Its tasks are kept (`keep_orphan`),
never to run again: closed by the garbage collector, their cleanup would run on the next loop, against the engine
it serves.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncllm.engine.launch import CoreProcess
    from asyncllm.engine.processor import Processor

__all__ = ["Launched", "keep_orphan", "stop_launched"]

_ORPHANS: list[asyncio.Future[Any]] = []
"""Tasks of closed loops that never finished (`keep_orphan`)."""


def keep_orphan(task: asyncio.Future[Any]) -> None:
    """Hold a closed loop's pending task for good (a start or a core restart it left): it never runs again."""
    task._log_destroy_pending = False  # type: ignore[attr-defined]  # (asyncio's warning as the interpreter exits)
    _ORPHANS.append(task)


def stop_launched(processor: Processor | None, core: CoreProcess | None) -> None:
    """Say Goodbye (shutting an owned core down) and stop the processor thread, then the core (blocking: off the
    loop). A core never told Goodbye (no processor yet, or closed while it started, before it reads messages) is
    cut at once: its stdin's EOF ends it, and its workers with it."""
    if processor is not None:
        processor.close(shutdown_core=core is not None)
    if core is not None:
        core.stop(told=processor is not None and processor.said_goodbye)


class Launched:
    """The core and processor thread one `start_replica` launched, until it ends or a takeover `drop`s it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._processor: Processor | None = None
        self._core: CoreProcess | None = None
        self._dropped = False

    def core(self, launch: Callable[..., CoreProcess], *args: Any) -> CoreProcess:
        """``launch(*args)`` (in the launching thread), recorded; a core launched after `drop` is stopped here."""
        core = launch(*args)
        with self._lock:
            if not self._dropped:
                self._core = core
                return core
        stop_launched(None, core)
        return core

    def processor(self, processor: Processor) -> None:
        """The core's processor thread, made (on the loop)."""
        with self._lock:
            self._processor = processor

    def drop(self) -> tuple[Processor | None, CoreProcess | None]:
        """Its start will never go on: what it launched, for the caller to stop (`stop_launched`); a core launched
        from now on stops itself."""
        with self._lock:
            self._dropped = True
            launched, self._processor, self._core = (self._processor, self._core), None, None
        return launched
