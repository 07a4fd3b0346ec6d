"""Cutting streamed text exactly at the first stop sequence."""

from __future__ import annotations

# The API refuses more, so no request ever reaches the runtime with them.
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256


class StopSequenceFilter:
    """Releases streamed text, holding back any tail that could still become a stop sequence.

    Text after the earliest match of any stop sequence is never released, so what the
    caller sees is cut exactly where the stop sequence begins.
    """

    def __init__(self, stop_sequences: tuple[str, ...]):
        self._stops = stop_sequences
        self._pending = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to release, the stop sequence matched or None)."""
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, None
        hits = [(self._pending.find(s), s) for s in self._stops if s in self._pending]
        if hits:
            at, stop = min(hits)
            out, self._pending = self._pending[:at], ""
            return out, stop
        keep = max((_overlap(self._pending, s) for s in self._stops), default=0)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
