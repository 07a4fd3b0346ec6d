"""Planning the load sweep: which offered loads, how long each point lasts, and the Erlang-B floor at each.

Capacity is measured live, closed loop, before any point is planned (bench_load): the
queued baseline with an unbounded queue is deployed first, and its saturation throughput
X (completed requests per second with every one of its c = slots x max_batch rows kept
busy) sets every offered load: a point at load f offers f x X requests per second, Poisson,
to every system alike. So "0.7x" means 70% of what the unbounded queue's engine actually
finishes on this machine, not a figure estimated from an idle engine.

A point's duration is sized so that it holds about `target_n` requests (tail percentiles
need a few hundred), clamped to [min_s, max_s]; if the sweep of all systems would not fit
the run's time budget, every duration is scaled down by one factor (never below
`floor_s`), so the points keep their relative weight and every system sees the same
schedules. Stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.erlang import erlang_b
from benchmarks.load_scenarios import MIXED, Scenario, steady

# Fractions of the unbounded baseline's measured saturation throughput (issue 12, item 5).
LOADS = (0.3, 0.5, 0.7, 0.9, 1.2, 2.0)
# The goals' two regimes: below capacity, and overload.
UNDERLOAD_MAX = 0.7
OVERLOAD_LOADS = (1.2, 2.0)


@dataclass(frozen=True)
class Budget:
    """How long a run may take, and what a point should hold."""

    total_s: float  # the whole run, start to report
    target_n: int = 300  # requests a point should hold
    min_s: float = 30.0  # a point lasts at least this (before scaling)...
    max_s: float = 150.0  # ... and at most this
    floor_s: float = 10.0  # scaling never shortens a point below this


@dataclass(frozen=True)
class Overheads:
    """Wall time the sweep costs beside the offered windows, per system and per point (estimates).

    `per_system_s` is measured on the first system (deploy, warm-up, closed-loop capacity,
    removal); `per_point_s` is settling and starting the client; `overload_tail_s` is the
    client waiting out the deadline of requests still queued when an overload point ends:
    only the unbounded queue holds requests that long, so it is counted once per point, not
    once per system.
    """

    per_system_s: float
    per_point_s: float
    overload_tail_s: float


def point_duration(rate_rps: float, budget: Budget) -> float:
    """Seconds a point at `rate_rps` should last to hold ~target_n requests, within [min_s, max_s]."""
    if not rate_rps > 0:
        raise ValueError(f"the offered rate must be > 0, got {rate_rps}")
    return min(budget.max_s, max(budget.min_s, budget.target_n / rate_rps))


def sweep_cost_s(durations: Sequence[float], loads: Sequence[float], num_systems: int, overheads: Overheads) -> float:
    """Wall time of every system's points, given their durations."""
    each = sum(d + overheads.per_point_s for d in durations)
    tails = sum(overheads.overload_tail_s for f in loads if f >= 1.0)
    return num_systems * each + tails


def plan_durations(loads: Sequence[float], capacity_rps: float, budget: Budget, left_s: float,
                   num_systems: int, systems_to_deploy: int, overheads: Overheads) -> tuple[list[float], float]:
    """Each point's duration, and the factor they were scaled by (1.0: not scaled).

    `left_s` is what remains of the budget now; `systems_to_deploy` systems still pay
    `per_system_s` each. When the natural durations overflow what is left, they are all
    scaled by one factor so the sweep fits, but none below `floor_s` (then the run is
    longer than the budget, and the caller says so).
    """
    natural = [point_duration(f * capacity_rps, budget) for f in loads]
    fixed = systems_to_deploy * overheads.per_system_s + sweep_cost_s([0.0] * len(loads), loads, num_systems,
                                                                       overheads)
    available = left_s - fixed
    wanted = num_systems * sum(natural)
    if wanted <= available:
        return natural, 1.0
    scale = max(0.0, available) / wanted
    return [max(budget.floor_s, d * scale) for d in natural], scale


def sweep_scenarios(loads: Sequence[float], durations: Sequence[float]) -> tuple[Scenario, ...]:
    """One steady Poisson point of the mixed-length mix per load."""
    return tuple(Scenario(point_name(f), f"mixed lengths at {f:g}×", MIXED, steady(d, f))
                 for f, d in zip(loads, durations, strict=True))


def point_name(load: float) -> str:
    return f"load-{load:g}"


def hold_time_s(places: int, saturation_rps: float) -> float:
    """How long a request holds one of `places` when the engine runs full: c / X (Little's law)."""
    if not saturation_rps > 0:
        return math.nan
    return places / saturation_rps


def refusal_floor_at(places: int, offered_rps: float, saturation_rps: float) -> float:
    """Erlang-B B(c, A) with A = offered rate x (c / the unbounded baseline's saturation throughput)."""
    hold = hold_time_s(places, saturation_rps)
    if math.isnan(hold) or not offered_rps >= 0:
        return math.nan
    return erlang_b(places, offered_rps * hold)
