"""`StopStringMatcher`: finds a request's stop strings in its streamed text (the detokenizer's third stage)."""

from __future__ import annotations

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Finds stop strings across pushes, holding back text that may begin one.

    The held-back tail is shorter than the longest stop string, so each push
    costs O(new text + longest stop string) whatever the length of the output.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool) -> None:
        self._stop = stop
        self._include = include_stop_str_in_output
        self._held = ""

    def push(self, text: str, match: bool = True) -> tuple[str, str | None]:
        """Return (text safe to emit, matched stop string or None). A match must end in ``text`` (what is held back
        was pushed before); with ``match`` false (the first min_tokens tokens' text) none is looked for, but text that
        may begin one is still held back."""
        buffer = self._held + text
        match = self._earliest_match(buffer, len(self._held)) if match else None
        if match is not None:
            start, stop = match
            self._held = ""
            return buffer[: start + len(stop) if self._include else start], stop
        keep = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text

    def _earliest_match(self, buffer: str, held: int) -> tuple[int, str] | None:
        """The match ending past the first ``held`` characters that starts first (the shorter one on a tie: it
        completed first)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = buffer.find(stop, max(0, held - len(stop) + 1))
            if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        if not buffer:
            return 0
        longest = 0
        last = buffer[-1]
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop[k - 1] == last and buffer.endswith(stop[:k]):
                    longest = k
                    break
        return longest
