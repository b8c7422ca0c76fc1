"""The peer side's time budget and phase log (``--compare-time-budget``).

A GPU session runs the peer inside a device call with a hard time limit; a run
killed from outside prints nothing at the end. So every phase of the peer says
on stderr, flushed at once, when it starts and when it ends (with its seconds),
long phases say how far they got every 30 s, and the phases are kept for the
JSON: a killed run still shows where its time went.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from typing import Any
from collections.abc import Iterator

__all__ = ["PeerClock", "PROGRESS_EVERY_S", "seconds"]

PROGRESS_EVERY_S = 30.0
"""How often a long phase says how far it got."""


def seconds(text: str) -> float:
    """``--compare-time-budget``: a positive number of seconds."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


class PeerClock:
    """The budget's clock (started at construction) and the records of the phases run under it."""

    def __init__(self, budget_s: float, label: str = "hf peer") -> None:
        self.budget_s = budget_s
        self.label = label
        self.start = time.perf_counter()
        self.deadline = self.start + budget_s
        self.records: list[dict[str, Any]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds left of the budget (negative once it is spent)."""
        return self.deadline - time.perf_counter()

    def share(self, fraction: float) -> float:
        """The deadline of a phase that may use ``fraction`` of the budget left now."""
        now = time.perf_counter()
        return now + max(self.deadline - now, 0.0) * fraction

    def say(self, text: str) -> None:
        print(f"[{self.label} {self.elapsed():6.1f}s] {text}", file=sys.stderr, flush=True)

    def mark(self, name: str, **detail: Any) -> None:
        """A moment rather than a phase (the first result, a cut): one line, one record."""
        self.records.append({"phase": name, "at_s": round(self.elapsed(), 3), **detail})
        self.say(f"{name}{_details(detail)}")

    @contextlib.contextmanager
    def phase(self, name: str, **detail: Any) -> Iterator[dict[str, Any]]:
        """Times the block; the record it yields may take more details, printed at the end."""
        record: dict[str, Any] = {"phase": name, "at_s": round(self.elapsed(), 3), **detail}
        self.records.append(record)
        self.say(f"{name}{_details(detail)}: start")
        start = time.perf_counter()
        try:
            yield record
        except BaseException as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            record["seconds"] = round(time.perf_counter() - start, 3)
            extra = {k: v for k, v in record.items() if k not in detail and k not in ("phase", "at_s", "seconds")}
            self.say(f"{name}: {'failed' if 'error' in record else 'done'} in {record['seconds']:.1f}s{_details(extra)}")

    def failed(self, what: str, exc: BaseException) -> str:
        """Says (with the traceback) that ``what`` failed; returns the one-line error for the JSON."""
        self.say(f"{what} failed: {type(exc).__name__}: {exc}")
        traceback.print_exception(exc, file=sys.stderr)
        sys.stderr.flush()
        return f"{type(exc).__name__}: {exc}"


def _details(detail: dict[str, Any]) -> str:
    if not detail:
        return ""
    return " (" + ", ".join(f"{k} {_short(v)}" for k, v in detail.items()) + ")"


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
