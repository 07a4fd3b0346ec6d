"""The line of refused clients at one ingress replica: each refusal is told the place after the last one told.

A 503's `retry-after` is a promise of when a place should free. Told one instant, a crowd of
refused clients that honour it comes back together: one takes the place, the rest are refused
again, in step, and on a CPU node the refusals' own cost (the proxy's and the ingress's CPU) is
taken from the batches. So the replica keeps, per model, the instants it has told that are still
ahead, and tells each new refusal no earlier than one place gap after the last of them. The gap is
the larger of

- the predicted one: the refused request's hold over the model's rows running here (each row
  ends about once per hold), and
- the measured one: how far apart this replica's rows of the model have really ended over the
  last `window_s` (rows that overrun their predictions on a slowed CPU all "end now" in the
  registry's view; what the rows are actually doing is measured here).

The registry spreads its own answers the same way (retry_after.py: places a gap apart, for every
replica's refusals); a registry refusal is told the later of its answer and this line's next place.
Pure and stdlib-only; the caller passes the clock (monotonic seconds).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serve_app.policy import PolicyConfig

WINDOW_S = 10.0  # row ends older than this say nothing of how fast places free now
MAX_ENDS = 256  # the most recent row ends kept per model (a bound on memory, not on the rate measured)


@dataclass
class _Line:
    ends: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_ENDS))  # recent row ends
    told: deque[float] = field(default_factory=deque)  # instants told, still ahead, in order


class RetryLines:
    """Per model: its recent row ends here and the places its refusals were told (the module doc)."""

    def __init__(self, policy: PolicyConfig, window_s: float = WINDOW_S) -> None:
        self._policy, self._window_s = policy, window_s
        self._lines: dict[str, _Line] = {}

    def row_ended(self, model_id: str, now: float) -> None:
        """A row of the model ended here: a place freed."""
        self._lines.setdefault(model_id, _Line()).ends.append(now)

    def measured_gap_s(self, model_id: str, now: float) -> float | None:
        """Seconds between row ends of the model here lately, counting the time since the last one (so a
        batch that stopped ending rows reads slower and slower); None with fewer than two ends in the window."""
        line = self._lines.get(model_id)
        if line is None:
            return None
        while line.ends and line.ends[0] < now - self._window_s:
            line.ends.popleft()
        if len(line.ends) < 2:
            return None
        return (now - line.ends[0]) / len(line.ends)

    def tell(self, model_id: str, earliest_s: float, predicted_gap_s: float, now: float) -> float:
        """The next refusal's retry-after: no earlier than `earliest_s` from now (the registry's answer, or
        the early-refusal window's), and one gap after the last place told that is still ahead."""
        line = self._lines.setdefault(model_id, _Line())
        while line.told and line.told[0] <= now:
            line.told.popleft()
        gap = max(predicted_gap_s, self.measured_gap_s(model_id, now) or 0.0)
        t = now + max(earliest_s, self._policy.min_retry_after_s)
        if line.told:
            t = max(t, line.told[-1] + gap)
        t = min(t, now + self._policy.max_retry_after_s)
        line.told.append(t)
        return t - now
