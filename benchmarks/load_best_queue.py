"""Issue 23's goals on the load benchmark: against the best-configured queue, not only the queue at our settings.

The queue's configurations are `queue-unbounded` (each replica takes zeroqueue's max_batch at
once) and every `queue-ongoing-N` that ran (N at once). The best is the one with the most
goodput summed over the sweep's points, its own measure of how well it served the very
same schedules. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.load_apps import BOUNDED, ONGOING_PREFIX, UNBOUNDED, ZEROQUEUE
from benchmarks.load_goals import Goal, Points, f_, pct
from benchmarks.load_stats import Record, output_tokens_per_s, window_completions
from benchmarks.load_sweep import UNDERLOAD_MAX

MAX_SHORT_TTFT_SPREAD = 2.0  # short requests' TTFT P99/P50 at <= 0.7x
MAX_REFUSED_AT = (0.7, 0.05)  # zeroqueue refuses at most 5% at 0.7x
MIN_SATURATION_VS_UNBOUNDED = 1.0
MIN_SATURATION_VS_BEST = 0.95


def queues(capacity: Mapping[str, Any]) -> list[str]:
    """The queue's configurations that ran, queue-unbounded first."""
    return [s for s in (UNBOUNDED, *sorted((s for s in capacity if s.startswith(ONGOING_PREFIX)),
                                           key=lambda s: int(s.removeprefix(ONGOING_PREFIX))))
            if s in capacity]


def best_queue(points: Points, capacity: Mapping[str, Any]) -> tuple[str | None, dict[str, float]]:
    """(the configuration with the most goodput over the points every configuration ran, each one's sum)."""
    qs = queues(capacity)
    loads = [f for f in points if all(q in points[f] for q in qs)]
    sums = {q: sum(points[f][q]["all"].goodput_rps for f in loads) for q in qs}
    return (max(sums, key=sums.get) if sums else None), sums


def closed_loop_tokens_per_s(cap: Mapping[str, Any]) -> float | None:
    """Output tokens of the requests a closed loop completed in its window, per second of it (None: no records)."""
    if not cap.get("records"):
        return None
    done = window_completions([Record(**r) for r in cap["records"]], cap["warmup_s"], cap["window_s"])
    return output_tokens_per_s(done, cap["window_s"])


def judge(points: Points, capacity: Mapping[str, Any], max_batch: int) -> tuple[list[Goal], list[str]]:
    """(issue 23's load goals judged, a table of the queue's configurations)."""
    best, sums = best_queue(points, capacity)
    rps = {s: cap["rps"] for s, cap in capacity.items()}
    table = ["| queue configuration | max_ongoing_requests (batch) | saturation req/s | goodput summed over the "
             "sweep req/s |", "|---|--:|--:|--:|"]
    for q in queues(capacity):
        n = int(q.removeprefix(ONGOING_PREFIX)) if q.startswith(ONGOING_PREFIX) else max_batch
        table.append(f"| {q}{' (best)' if q == best else ''} | {n} | {rps[q]:.2f} | {sums.get(q, float('nan')):.2f} |")
    goals = []
    zq = rps.get(ZEROQUEUE)
    if zq is not None and UNBOUNDED in rps and best is not None:
        vs_u, vs_b = zq / rps[UNBOUNDED], zq / rps[best]
        tokens = {s: closed_loop_tokens_per_s(capacity[s]) for s in (ZEROQUEUE, UNBOUNDED, best)}
        in_tokens = (f"; in output tokens {tokens[ZEROQUEUE] / tokens[UNBOUNDED]:.2f}× and "
                     f"{tokens[ZEROQUEUE] / tokens[best]:.2f}× (the requests completed differ by class: the capacity "
                     "table)") if all(tokens.values()) else ""
        goals.append(Goal("23.a saturation throughput", f"≥ {MIN_SATURATION_VS_UNBOUNDED:g}× {UNBOUNDED}'s and "
                          f"≥ {MIN_SATURATION_VS_BEST:g}× the best queue's", f"{vs_u:.2f}× {UNBOUNDED}, {vs_b:.2f}× "
                          f"{best} ({zq:.2f} against {rps[UNBOUNDED]:.2f} and {rps[best]:.2f} req/s){in_tokens}",
                          vs_u >= MIN_SATURATION_VS_UNBOUNDED and vs_b >= MIN_SATURATION_VS_BEST))
    under = [f for f in points if f <= UNDERLOAD_MAX + 1e-9 and ZEROQUEUE in points[f]]
    spreads = {f: points[f][ZEROQUEUE]["short"].ttft.spread for f in under if "short" in points[f][ZEROQUEUE]}
    if spreads:
        goals.append(Goal("23.b short TTFT P99/P50", f"≤ {MAX_SHORT_TTFT_SPREAD:g} at ≤ {UNDERLOAD_MAX:g}×",
                          "; ".join(f"{f:g}×: {f_(s, 2)}" for f, s in spreads.items()),
                          all(s <= MAX_SHORT_TTFT_SPREAD for s in spreads.values())))

    def p99(f: float, s: str) -> float:
        return points[f][s]["short"].ttft.p99

    compared = [f for f in under if all(s in points[f] for s in (UNBOUNDED, BOUNDED))]
    if compared:
        goals.append(Goal("23.c short TTFT P99 ≤ both baselines'", f"at every load ≤ {UNDERLOAD_MAX:g}×", "; ".join(
            f"{f:g}×: {f_(p99(f, ZEROQUEUE))} s against {f_(p99(f, UNBOUNDED))} / {f_(p99(f, BOUNDED))} s"
            for f in compared), all(p99(f, ZEROQUEUE) <= min(p99(f, UNBOUNDED), p99(f, BOUNDED)) for f in compared)))
    load, most = MAX_REFUSED_AT
    at = next((f for f in points if abs(f - load) < 1e-9 and ZEROQUEUE in points[f]), None)
    if at is not None:
        x = points[at][ZEROQUEUE]["all"]
        goals.append(Goal("23.d refused at 0.7×", f"≤ {pct(most)}", f"{pct(x.rejection_rate)} "
                          f"({x.rejected}/{x.offered})", x.rejection_rate <= most))
    return goals, table
