"""`StopStringMatcher`: finds a request's stop strings in its streamed text (the detokenizer's third stage)."""

from __future__ import annotations

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Finds stop strings across pushes, holding back text that may begin one.

    The held-back tail is shorter than the longest stop string, and each stop string's partial match is kept as a
    Knuth-Morris-Pratt state advanced over the new text only, so each push costs O(number of stop strings x (new
    text + longest stop string)) whatever the length of the output or of the stop strings' repeats.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool) -> None:
        self._stop = stop
        self._include = include_stop_str_in_output
        self._held = ""
        self._prefixes = [_Prefix(s) for s in stop if s]

    def push(self, text: str, match: bool = True) -> tuple[str, str | None]:
        """Return (text safe to emit, matched stop string or None). A match must end in ``text`` (what is held back
        was pushed before); with ``match`` false (the first min_tokens tokens' text) none is looked for, but text that
        may begin one is still held back."""
        for prefix in self._prefixes:
            prefix.advance(text)
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
        return min(len(buffer), max((prefix.proper() for prefix in self._prefixes), default=0))


class _Prefix:
    """One stop string's longest prefix that ends the text pushed so far (a Knuth-Morris-Pratt automaton)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        self.border = [0] * len(stop)
        """``border[i]``: the longest proper prefix of ``stop[: i + 1]`` that is also its suffix."""
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.border[k - 1]
            k += stop[i] == stop[k]
            self.border[i] = k

    def advance(self, text: str) -> None:
        stop, border, k = self.stop, self.border, self.state
        for char in text:
            while k and (k == len(stop) or stop[k] != char):
                k = border[k - 1]
            k += stop[k] == char
        self.state = k

    def proper(self) -> int:
        """The longest proper prefix of the stop string that ends the text (a whole match falls back to its border)."""
        return self.border[-1] if self.state == len(self.stop) else self.state
