"""The load benchmark's goals (issue 12), judged from one run's per-point summaries. Pure: no I/O.

Every goal compares systems offered the very same schedule in the same run, at loads that
are fractions of the unbounded queue's measured capacity. A goal is met only if it holds
at every point it covers; a point or system that did not run leaves it unjudged (None),
never met by default. Tail figures carry their n and the refusal rate beside them: a tail
can look good because requests were refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from benchmarks.load_apps import BOUNDED, UNBOUNDED, ZEROQUEUE
from benchmarks.load_stats import Summary, ratio
from benchmarks.load_sweep import LOADS, OVERLOAD_LOADS, UNDERLOAD_MAX

MAX_UNDERLOAD_REFUSED = 0.05  # zeroqueue refuses at most this share at <= 0.7x
MIN_UNDERLOAD_GOODPUT = 0.95  # x the better baseline's goodput at <= 0.7x
MAX_SHORT_TTFT_SPREAD = 1.3  # short requests' TTFT P99/P50 at <= 0.7x
MIN_OVERLOAD_VS_UNBOUNDED = 1.5  # goodput at 1.2x and 2x, x the unbounded queue's
MIN_OVERLOAD_VS_BOUNDED = 1.0  # ... and x the bounded queue's

# load -> system -> class (and "all") -> Summary
Points = Mapping[float, Mapping[str, Mapping[str, Summary]]]


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    figures: str
    met: bool | None  # None: not measured in this run
    note: str = ""  # why a goal was missed, from this run's figures
    caveat: str = ""  # said beside the verdict: e.g. a tail that looks good because requests were refused


def f_(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def pct(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:.1f}%"


def _points(points: Points, loads: list[float], systems: tuple[str, ...]) -> list[float]:
    """The loads at which every one of `systems` ran."""
    return [f for f in loads if all(s in points.get(f, {}) for s in systems)]


def _judge(points: Points, loads: list[float], systems: tuple[str, ...],
           check: Callable[[float], tuple[bool | None, str]]) -> tuple[bool | None, list[str], list[float]]:
    """(met at every load, per-load figures, loads where it failed); None if a covered load did not run."""
    ran = _points(points, loads, systems)
    if not ran or len(ran) < len(loads):
        missing = [f for f in loads if f not in ran]
        figures = [f"{f:g}×: {check(f)[1]}" for f in ran] + [f"{', '.join(f'{f:g}×' for f in missing)}: not run"]
        return None, figures, []
    results = [(f, *check(f)) for f in ran]
    failed = [f for f, ok, _ in results if ok is False]
    met = None if any(ok is None for _, ok, _ in results) else not failed
    return met, [f"{f:g}×: {text}" for f, _, text in results], failed


def judge(points: Points, floors: Mapping[float, float], reject_bound_s: float,
          own_floors: Mapping[float, float] | None = None) -> list[Goal]:
    """Every goal, in the issue's order. `floors`: the Erlang-B refusal floor at each load; `own_floors`: the
    same at zeroqueue's own measured hold time (what its lower capacity alone would refuse)."""
    # The sweep's loads the goal covers (a load that did not run leaves the goal unjudged).
    under = sorted({f for f in (*LOADS, *points) if f <= UNDERLOAD_MAX + 1e-9})
    over = list(OVERLOAD_LOADS)
    zq = lambda f, cls="all": points[f][ZEROQUEUE][cls]  # noqa: E731
    sys_ = lambda f, s, cls="all": points[f][s][cls]  # noqa: E731
    goals = []

    def refused(f: float) -> tuple[bool | None, str]:
        x = zq(f)
        return (x.rejection_rate <= MAX_UNDERLOAD_REFUSED,
                f"{pct(x.rejection_rate)} of {x.offered} (Erlang-B floor {pct(floors.get(f, math.nan))})")

    met, figs, failed = _judge(points, under, (ZEROQUEUE,), refused)
    goals.append(Goal("1a. zeroqueue's refusals at ≤ 0.7× capacity", f"≤ {pct(MAX_UNDERLOAD_REFUSED)} refused",
                      "; ".join(figs), met, _why_refused(points, floors, failed, own_floors or {})))

    def goodput(f: float) -> tuple[bool | None, str]:
        best = max(sys_(f, UNBOUNDED).goodput_rps, sys_(f, BOUNDED).goodput_rps)
        g = ratio(zq(f).goodput_rps, best)
        return (None if math.isnan(g) else g >= MIN_UNDERLOAD_GOODPUT,
                f"{f_(zq(f).goodput_rps, 2)} vs {f_(best, 2)} good req/s = {f_(g, 2)}×")

    met, figs, failed = _judge(points, under, (ZEROQUEUE, UNBOUNDED, BOUNDED), goodput)
    goals.append(Goal("1b. zeroqueue's goodput at ≤ 0.7×", f"≥ {MIN_UNDERLOAD_GOODPUT} × the better baseline's",
                      "; ".join(figs), met, _why_goodput(points, failed)))

    def short_p99(f: float) -> tuple[bool | None, str]:
        mine, a, b = zq(f, "short").ttft, sys_(f, UNBOUNDED, "short").ttft, sys_(f, BOUNDED, "short").ttft
        ok = None if any(math.isnan(t.p99) for t in (mine, a, b)) else mine.p99 <= min(a.p99, b.p99)
        return ok, (f"{f_(mine.p99)} s (n {mine.n}) vs unbounded {f_(a.p99)} s (n {a.n}), bounded {f_(b.p99)} s "
                    f"(n {b.n})")

    met, figs, failed = _judge(points, under, (ZEROQUEUE, UNBOUNDED, BOUNDED), short_p99)
    goals.append(Goal("1c. short requests' TTFT P99 at ≤ 0.7×", "zeroqueue's ≤ both baselines'", "; ".join(figs),
                      met, _why_tail(points, failed), _refused_caveat(points, under)))

    def spread(f: float) -> tuple[bool | None, str]:
        t = zq(f, "short").ttft
        return (None if math.isnan(t.spread) else t.spread <= MAX_SHORT_TTFT_SPREAD,
                f"{f_(t.spread, 2)} (P50 {f_(t.p50)} s, P99 {f_(t.p99)} s, n {t.n})")

    met, figs, failed = _judge(points, under, (ZEROQUEUE,), spread)
    goals.append(Goal("2. short requests' TTFT P99/P50 at ≤ 0.7×", f"≤ {MAX_SHORT_TTFT_SPREAD} for zeroqueue",
                      "; ".join(figs), met, _why_tail(points, failed), _refused_caveat(points, under)))

    for baseline, minimum, label in ((UNBOUNDED, MIN_OVERLOAD_VS_UNBOUNDED, "3a"),
                                     (BOUNDED, MIN_OVERLOAD_VS_BOUNDED, "3b")):
        def vs(f: float, baseline: str = baseline, minimum: float = minimum) -> tuple[bool | None, str]:
            mine, theirs = zq(f), sys_(f, baseline)
            g = ratio(mine.goodput_rps, theirs.goodput_rps)
            if theirs.good == 0:  # a baseline that completed nothing within the SLO: any goodput beats it
                g = math.inf if mine.good else math.nan
            return (None if math.isnan(g) else g >= minimum,
                    f"{f_(mine.goodput_rps, 2)} vs {f_(theirs.goodput_rps, 2)} good req/s = {f_(g, 2)}×")

        met, figs, failed = _judge(points, over, (ZEROQUEUE, baseline), vs)
        goals.append(Goal(f"{label}. zeroqueue's goodput at 1.2× and 2×", f"≥ {minimum:g} × the {baseline} one's",
                          "; ".join(figs), met, _why_overload(points, baseline, failed)))

    def answered(f: float) -> tuple[bool | None, str]:
        x = zq(f)
        over_bound = x.reject_slower_than(reject_bound_s)
        if not x.rejected:
            return True, "no refusals"
        return (over_bound == 0, f"{x.rejected} refusals, P99 {f_(x.reject_answer.p99)} s, slowest "
                f"{f_(x.reject_answer_max)} s, {over_bound} over {reject_bound_s:g} s")

    met, figs, failed = _judge(points, over, (ZEROQUEUE,), answered)
    goals.append(Goal("3c. every zeroqueue refusal at 1.2× and 2× answered quickly", f"each 503 within "
                      f"{reject_bound_s:g} s", "; ".join(figs), met,
                      "" if not failed else "refusals slower than the bound at "
                      + ", ".join(f"{f:g}×" for f in failed) + ": the 503 waits for the proxy, the ingress and the "
                      "registry call on cores the batches are computing on"))
    return goals


def _refused_caveat(points: Points, loads: list[float]) -> str:
    rates = [(f, points[f][ZEROQUEUE]["short"].rejection_rate) for f in loads
             if ZEROQUEUE in points.get(f, {}) and "short" in points[f][ZEROQUEUE]]
    refused = [(f, r) for f, r in rates if r > 0]
    if not refused:
        return ""
    return "tails of completed requests; zeroqueue refused " + ", ".join(f"{pct(r)} of short requests at {f:g}×"
                                                                         for f, r in refused)


def _why_refused(points: Points, floors: Mapping[float, float], failed: list[float],
                 own_floors: Mapping[float, float]) -> str:
    parts = []
    for f in failed:
        x = points[f][ZEROQUEUE]["all"]
        floor, own = floors.get(f, math.nan), own_floors.get(f, math.nan)
        text = (f"at {f:g}× it refused {pct(x.rejection_rate)} where no queue-free system could refuse less "
                f"than {pct(floor)} (Erlang-B): {pct(max(0.0, x.rejection_rate - floor))} is the system's own doing")
        if not math.isnan(own):
            excess = max(0.0, x.rejection_rate - floor)
            capacity = min(excess, max(0.0, own - floor))
            text += (f" — {pct(capacity)} of it its lower capacity (the floor at zeroqueue's own measured hold is "
                     f"{pct(own)}), {pct(excess - capacity)} its admission")
        parts.append(f"{text}; {x.cold} completed requests started on a fresh actor")
    return "; ".join(parts)


def _why_goodput(points: Points, failed: list[float]) -> str:
    parts = []
    for f in failed:
        x = points[f][ZEROQUEUE]["all"]
        parts.append(f"at {f:g}× zeroqueue refused {x.rejected} and completed {x.completed} of {x.offered}, "
                     f"{x.completed - x.good} of them outside the SLO")
    return "; ".join(parts)


def _why_tail(points: Points, failed: list[float]) -> str:
    """Where zeroqueue's short requests spent their time to first token, beside the baselines' TTFT."""
    parts = []
    for f in failed:
        x, u, b = (points[f][s]["short"] for s in (ZEROQUEUE, UNBOUNDED, BOUNDED))
        parts.append(
            f"at {f:g}×: short TTFT P50 / P99 zeroqueue {f_(x.ttft.p50)} / {f_(x.ttft.p99)} s, unbounded "
            f"{f_(u.ttft.p50)} / {f_(u.ttft.p99)} s, bounded {f_(b.ttft.p50)} / {f_(b.ttft.p99)} s; zeroqueue's "
            f"arrival to decision (proxy, ingress, registry: a hop the baselines do not take) P50 "
            f"{f_(x.dispatch.p50)} s, P99 {f_(x.dispatch.p99)} s; decision to compute start (a join waits for "
            f"the running step) P50 {f_(x.placed.p50)} s, P99 {f_(x.placed.p99)} s; {x.cold} of {x.completed} "
            "started on a fresh actor")
    return "; ".join(parts)


def _why_overload(points: Points, baseline: str, failed: list[float]) -> str:
    parts = []
    for f in failed:
        x, b = points[f][ZEROQUEUE]["all"], points[f][baseline]["all"]
        parts.append(f"at {f:g}× zeroqueue refused {pct(x.rejection_rate)} and completed {x.completed} "
                     f"({x.good} within the SLO); {baseline} refused {pct(b.rejection_rate)}, completed "
                     f"{b.completed} ({b.good} within the SLO), {b.offered - b.completed - b.rejected} failed or "
                     "abandoned")
    return "; ".join(parts)
