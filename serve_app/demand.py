"""Demand per model and lane, as the capacity planner reads it (pure: no Ray).

Two halves, one on each side of the lease exchange (lease.py):
  - `DemandCounter`, on each ingress replica: its refusals for want of capacity (those the
    registry decided and those refused early at the edge, which the registry never sees) and its
    admissions with their predicted hold times, since its last report;
  - `DemandMeter`, in the registry: every replica's counts over `demand_window_s`, plus what the
    books show now (busy slots, rows per actor), turned into `LaneDemand`s for `plan_slots`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from serve_app.capacity import LaneDemand
from serve_app.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class LaneCount:
    """One replica's counts for a model and lane since its last report."""

    model: str
    lane: str
    num_refused: int = 0  # refused for want of capacity
    num_admitted: int = 0
    hold_s_sum: float = 0.0  # the admitted requests' predicted total seconds, summed


class DemandCounter:
    """A replica's counts between two lease exchanges (the event loop's only: no lock)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], list[float]] = {}

    def refused(self, model: str, lane: str) -> None:
        self._counts.setdefault((model, lane), [0, 0, 0.0])[0] += 1

    def admitted(self, model: str, lane: str, hold_s: float) -> None:
        c = self._counts.setdefault((model, lane), [0, 0, 0.0])
        c[1] += 1
        c[2] += hold_s

    def take(self) -> tuple[LaneCount, ...]:
        """Everything counted so far, handed over (the counter starts again from nothing)."""
        counts, self._counts = self._counts, {}
        return tuple(LaneCount(m, lane, int(r), int(a), h) for (m, lane), (r, a, h) in sorted(counts.items()))

    def put_back(self, counts: tuple[LaneCount, ...]) -> None:
        """Counts whose report never reached the registry: they go with the next one."""
        for c in counts:
            mine = self._counts.setdefault((c.model, c.lane), [0, 0, 0.0])
            mine[0] += c.num_refused
            mine[1] += c.num_admitted
            mine[2] += c.hold_s_sum


class DemandMeter:
    """Every replica's counts over the window, and the peak busy slots and rows per actor of each lane.

    Busy slots are a peak over the window, not the count now: a refusal happened because every slot was
    busy at that moment, and the planner, which runs later, must not see the demand as lower because
    those requests have ended since. The registry samples the books at each refusal and each plan.
    """

    def __init__(self, window_s: float, assumed_hold_s: float) -> None:
        self.window_s, self.assumed_hold_s = window_s, assumed_hold_s
        self._counts: deque[tuple[float, LaneCount]] = deque()
        self._busy: dict[tuple[str, str], deque[tuple[float, int, int]]] = {}  # (when, busy slots, most rows)

    def record(self, counts: tuple[LaneCount, ...], now: float) -> None:
        self._counts.extend((now, c) for c in counts)

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
        while self._counts and now - self._counts[0][0] > self.window_s:
            self._counts.popleft()
        for key in list(self._busy):
            samples = self._busy[key]
            while samples and now - samples[0][0] > self.window_s:
                samples.popleft()
            if not samples:
                del self._busy[key]
        refused: dict[tuple[str, str], int] = {}
        admitted: dict[tuple[str, str], tuple[int, float]] = {}
        for _, c in self._counts:
            key = (c.model, c.lane)
            refused[key] = refused.get(key, 0) + c.num_refused
            n, h = admitted.get(key, (0, 0.0))
            admitted[key] = (n + c.num_admitted, h + c.hold_s_sum)
        keys = set(refused) | {k for k, (n, _) in admitted.items() if n} | set(self._busy)
        demands = []
        for key in sorted(keys):
            samples = self._busy.get(key, ())
            n, hold_sum = admitted.get(key, (0, 0.0))
            model, lane = key
            # A model's warm pool goes with its first lane in order ("long" < "short"): counted once per model.
            is_first_lane = key == min(k for k in keys if k[0] == model)
            demands.append(LaneDemand(
                model, lane, max((b for _, b, _ in samples), default=0), max((r for _, _, r in samples), default=0),
                refused.get(key, 0) / self.window_s, hold_sum / n if n else self.assumed_hold_s,
                (warm_slots or {}).get(model, 0) if is_first_lane else 0))
        return demands


def warm_slots_needed(num_warm: int, max_actors_per_slot: int) -> int:
    """Slots `num_warm` warm actors need, packed `max_actors_per_slot` to a slot."""
    return math.ceil(num_warm / max(1, max_actors_per_slot))
