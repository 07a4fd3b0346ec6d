"""Demand per model and lane, as the capacity planner reads it (pure: no Ray).

Two halves, one on each side of the lease exchange (lease.py):
  - `DemandCounter`, on each ingress replica: its refusals for want of capacity (those the
    registry decided and those refused early at the edge, which the registry never sees), each with
    how long it would have held its row (`refused_hold_s`; an early refusal, refused before it was
    tokenized, counts as the lane and hold of the refusal that opened its window), since its last
    report. A report that timed out is sent again with the next one: should the registry have taken
    it after all, those refusals count twice, for one window;
  - `DemandMeter`, in the registry: every replica's counts over `demand_window_s`, plus what the
    books show now (busy slots, rows per actor), turned into `LaneDemand`s for `plan_slots`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from serve_app.capacity import LaneDemand
from serve_app.scorer import Candidate, Scorer
from serve_app.snapshot import ClusterSnapshot, RequestFeatures


@dataclass(frozen=True)
class LaneCount:
    """One replica's refusals for want of capacity for a model and lane, since its last report."""

    model: str
    lane: str
    num_refused: int = 0
    hold_s_sum: float = 0.0  # how long each would have held its row, summed (refused_hold_s)


def refused_hold_s(features: RequestFeatures, scorer: Scorer) -> float:
    """How long a refused request would have held its row: the scorer's prediction on a hot actor of its own.
    The refusal has no prediction of its own (nothing could place it)."""
    hot = Candidate("hot", "", None, 0, 0, 0.0, 0.0, resident_fraction=1.0)
    return scorer.predict(features, [hot])[0].total_s


class DemandCounter:
    """A replica's counts between two lease exchanges (the event loop's only: no lock)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], tuple[int, float]] = {}

    def refused(self, model: str, lane: str, hold_s: float) -> None:
        n, h = self._counts.get((model, lane), (0, 0.0))
        self._counts[(model, lane)] = (n + 1, h + hold_s)

    def take(self) -> tuple[LaneCount, ...]:
        """Everything counted so far, handed over (the counter starts again from nothing)."""
        counts, self._counts = self._counts, {}
        return tuple(LaneCount(m, lane, n, h) for (m, lane), (n, h) in sorted(counts.items()))

    def put_back(self, counts: tuple[LaneCount, ...]) -> None:
        """Counts whose report never reached the registry: they go with the next one."""
        for c in counts:
            n, h = self._counts.get((c.model, c.lane), (0, 0.0))
            self._counts[(c.model, c.lane)] = (n + c.num_refused, h + c.hold_s_sum)


# The shortest time a refusal rate is measured over (within the window): refusals that began within it are
# counted as a rate over all of it.
MIN_RATE_SPAN_S = 5.0


class DemandMeter:
    """Every replica's counts over the window, and the peak busy slots and rows per actor of each lane.

    Busy slots are a peak over the window, not the count now: a refusal happened because every slot was
    busy at that moment, and the planner, which runs later, must not see the demand as lower because
    those requests have ended since. The registry samples the books at each refusal and each plan.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._counts: deque[tuple[float, LaneCount]] = deque()
        self._busy: dict[tuple[str, str], deque[tuple[float, int, int]]] = {}  # (when, busy slots, most rows)

    def record(self, counts: tuple[LaneCount, ...], now: float) -> None:
        self._counts.extend((now, c) for c in counts)
        self._prune(now)

    def forget_refusals(self) -> None:
        """Drop the refusals counted so far: the capacity they asked for has arrived."""
        self._counts.clear()

    def _prune(self, now: float) -> None:
        while self._counts and now - self._counts[0][0] > self.window_s:
            self._counts.popleft()

    def observe(self, snapshot: ClusterSnapshot, now: float) -> None:
        """Sample each lane's busy slots and its fullest actor's rows in the books now."""
        busy: dict[tuple[str, str], set[str]] = {}
        rows: dict[tuple[str, str], int] = {}
        for a in snapshot.actors:
            running = sum(1 for r in a.rows if r.num_tokens)  # a leased row with nothing in it is free
            if a.state == "starting" or running:
                key = (a.model, a.lane)
                busy.setdefault(key, set()).add(a.slot_id)
                rows[key] = max(rows.get(key, 0), running)
        for key, slots in busy.items():
            self._busy.setdefault(key, deque()).append((now, len(slots), rows[key]))

    def lane_demands(self, snapshot: ClusterSnapshot, now: float,
                     warm_slots: dict[str, int] | None = None) -> list[LaneDemand]:
        """Each model and lane with demand or busy slots in the window. `warm_slots`: model -> the slots its
        warm pool needs, counted for models with demand in the window (an idle model's pool retires)."""
        self.observe(snapshot, now)
        self._prune(now)
        # Refusals per second over the time they have been coming, within the window: a burst that began a
        # second ago is its own rate, not a window's average (at least MIN_RATE_SPAN_S: one refusal is not a
        # rate of one a heartbeat).
        span = min(self.window_s, max(MIN_RATE_SPAN_S, now - self._counts[0][0])) if self._counts else self.window_s
        for key in list(self._busy):
            samples = self._busy[key]
            while samples and now - samples[0][0] > self.window_s:
                samples.popleft()
            if not samples:
                del self._busy[key]
        refused: dict[tuple[str, str], tuple[int, float]] = {}
        for _, c in self._counts:
            n, h = refused.get((c.model, c.lane), (0, 0.0))
            refused[(c.model, c.lane)] = (n + c.num_refused, h + c.hold_s_sum)
        keys = set(refused) | set(self._busy)
        demands = []
        for key in sorted(keys):
            samples = self._busy.get(key, ())
            n, hold_sum = refused.get(key, (0, 0.0))
            model, lane = key
            # A model's warm pool goes with its first lane in order ("long" < "short"): counted once per model.
            is_first_lane = key == min(k for k in keys if k[0] == model)
            demands.append(LaneDemand(
                model, lane, max((b for _, b, _ in samples), default=0), max((r for _, _, r in samples), default=0),
                n / span, hold_sum / n if n else 0.0,
                (warm_slots or {}).get(model, 0) if is_first_lane else 0))
        return demands


def warm_slots_needed(num_warm: int, max_actors_per_slot: int) -> int:
    """Slots `num_warm` warm actors need, packed `max_actors_per_slot` to a slot."""
    return math.ceil(num_warm / max(1, max_actors_per_slot))
