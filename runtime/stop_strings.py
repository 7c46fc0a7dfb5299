"""Streaming stop-string matching over text deltas that may split a stop string anywhere.

A stop string can arrive split across tokens ("Hel" + "lo"), so text that might be the
beginning of one is held back until it either completes the stop (and is dropped) or turns
out to be ordinary text (and is released). Only the held-back tail plus the new delta is
searched per call, so the cost per token does not grow with the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters streamed text so that nothing from the first stop string onwards is emitted.

    When several stop strings occur, the one that completes first wins (the one that a
    character-by-character stream would hit first; on a tie, the longer one), so the result
    does not depend on how the text was split into deltas.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty.")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.matched: str | None = None
        """The stop string that ended the text, once one has."""
        self._pending = ""  # emitted text never contains the start of a possible stop

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text_delta: str) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit now, whether a stop string was hit)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text_delta, False
        text = self._pending + text_delta
        hit = self._first_stop(text)
        if hit is not None:
            start, stop = hit
            self.matched = stop
            self._pending = ""
            return text[:start], True
        held = self._partial_suffix_length(text)
        self._pending = text[len(text) - held :]
        return text[: len(text) - held], False

    def flush(self) -> str:
        """Release held-back text at the end of generation (nothing once a stop was hit)."""
        text, self._pending = self._pending, ""
        return "" if self.matched is not None else text

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_length, stop = best
        return end + neg_length, stop

    def _partial_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            # Candidate starts are occurrences of the stop's first character close enough to
            # the end; the earliest one that matches gives this stop's longest partial.
            # Only starts that would beat the current longest (i < end) are worth checking.
            begin, end = max(len(text) - len(stop) + 1, 0), len(text) - longest
            i = text.find(stop[0], begin, end)
            while i >= 0:
                if stop.startswith(text[i:]):
                    longest = len(text) - i
                    break
                i = text.find(stop[0], i + 1, end)
        return longest
