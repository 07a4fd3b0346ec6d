"""What a simulation sweep produces: per-class metrics of each (arrival process, load, system) point, and a decision's cost.

`benchmarks.simulate` computes them; the report (`benchmarks.sim_report`,
`benchmarks.sim_report_text`) reads them. Both import them from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from benchmarks.sim_calibration import ArrivalKind, RequestClass, ServiceTimes, Workload
from benchmarks.sim_model import Outcome

QUANTILES = (50.0, 99.0, 99.9)
SYSTEM_NAMES = ("zero-queue", "queued FIFO", "queued FIFO, bounded", "queued Serve default")
# Zero-queue again, every request stating the sweep's TPOT target: places by prediction (SimConfig.tpot_target_s).
ZQ_BY_PREDICTION = "zero-queue, places by prediction"


@dataclass(frozen=True)
class ClassMetrics:
    num_arrivals: int  # measured: arrived after the warm-up and before the horizon
    reject_rate: float
    cold_rate: float  # of the admitted: served by an actor spawned for them
    join_rate: float  # of the admitted: joined a batch that was already running
    ttft_s: tuple[float, float, float]  # P50, P99, P99.9 over the admitted
    e2e_s: tuple[float, float, float]
    slowdown_p99: float  # P99 of end to end / the request's own unloaded (hot) end to end
    throughput_per_s: float  # completions inside the measured window, per second
    goodput_per_s: float  # of those, the ones that met the SLO
    # The good completions' unloaded (hot, one-row) service time per second, over what the cluster
    # completes of it per second at capacity: the share of the cluster that did useful work in
    # time; unlike goodput it does not favour short requests.
    good_work_fraction: float
    # Per admitted request, its time per output token once decoding: (e2e - TTFT) / (output tokens - 1). P50, P99,
    # P99.9, and the share over the sweep's TPOT target (NaN without one).
    tpot_s: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    tpot_over_target: float = math.nan

    @property
    def e2e_ratio(self) -> float:
        return self.e2e_s[1] / self.e2e_s[0] if self.e2e_s[0] > 0 else math.nan

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_s[1] / self.ttft_s[0] if self.ttft_s[0] > 0 else math.nan


def _quantiles(x: np.ndarray) -> tuple[float, float, float]:
    if len(x) == 0:
        return (math.nan,) * 3  # type: ignore[return-value]
    q = np.percentile(x, QUANTILES)
    return float(q[0]), float(q[1]), float(q[2])


def class_metrics(workload: Workload, service: ServiceTimes, outcome: Outcome, mix: tuple[RequestClass, ...],
                  slo_extra_s: float, work_capacity: float,
                  tpot_target_s: float | None = None) -> dict[str, ClassMetrics]:
    """Per class and for "all". Latency and rejections: over the arrivals in the measured window;
    throughput and goodput: completions inside it (an unbounded queue finishes late, not more).
    `work_capacity`: seconds of hot one-row service the cluster completes per second at capacity.
    `tpot_target_s`: what each admitted request's TPOT is held against (every system's, queued or not)."""
    start, end = workload.warmup_s, workload.horizon_s
    window = end - start
    arrived = (workload.arrival_s >= start) & (workload.arrival_s < end)
    admitted = ~outcome.is_rejected
    done_at = workload.arrival_s + outcome.e2e_s  # NaN when rejected
    with np.errstate(invalid="ignore"):
        ended_inside = admitted & (done_at >= start) & (done_at < end)
        good = ended_inside & (outcome.ttft_s - service.hot_ttft_s <= slo_extra_s)
    slowdown = outcome.e2e_s / service.hot_e2e_s
    decoded = workload.output_tokens > 1  # a one-token answer has no time per output token
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(decoded, (outcome.e2e_s - outcome.ttft_s) / (workload.output_tokens - 1), np.nan)
    # Relative: a TPOT equal to the target up to float rounding keeps it.
    over = tpot > tpot_target_s * (1 + 1e-9) if tpot_target_s is not None else None
    out: dict[str, ClassMetrics] = {}
    for index, name in [*enumerate(c.name for c in mix), (-1, "all")]:
        of_class = np.ones_like(arrived) if index < 0 else workload.class_index == index
        sel, served = arrived & of_class, arrived & of_class & admitted
        timed = served & decoded
        n = int(sel.sum())
        out[name] = ClassMetrics(
            num_arrivals=n,
            reject_rate=float(outcome.is_rejected[sel].mean()) if n else math.nan,
            cold_rate=float(outcome.is_cold[served].mean()) if served.any() else math.nan,
            join_rate=float(outcome.is_joined[served].mean()) if served.any() else math.nan,
            ttft_s=_quantiles(outcome.ttft_s[served]),
            e2e_s=_quantiles(outcome.e2e_s[served]),
            slowdown_p99=_quantiles(slowdown[served])[1],
            throughput_per_s=float((ended_inside & of_class).sum()) / window,
            goodput_per_s=float((good & of_class).sum()) / window,
            good_work_fraction=float(service.hot_e2e_s[good & of_class].sum()) / (window * work_capacity),
            tpot_s=_quantiles(tpot[timed]),
            tpot_over_target=float(over[timed].mean()) if over is not None and timed.any() else math.nan,
        )
    return out


@dataclass(frozen=True)
class PointResult:
    process: ArrivalKind
    load: float
    system: str
    metrics: dict[str, ClassMetrics]  # per class name, and "all"
    wall_s: float
    rows_per_busy_actor: float = math.nan  # mean over the measured window, every actor or replica while it runs rows


@dataclass(frozen=True)
class DecisionCost:
    num_arrivals: int
    registry_us: float  # per arrival: RegistryState.admit on the full snapshot, commit, finish
    incremental_us: float  # per arrival: the restricted snapshot, decide, incremental books
    is_identical: bool  # the two gave every request the same slot, kind and latency
    join_rate: float  # of the admitted: joined a running batch


@dataclass(frozen=True)
class ScorerCheck:
    """One load point's zero-queue (fixed places) decided with the default rule scorer and with the calibrated one."""

    process: str
    load: float
    num_arrivals: int
    is_identical: bool  # every request the same slot, kind and latency
    same_place: float  # share of the arrivals both refused, or both placed on the same slot
    reject_default: float  # over the arrivals in the measured window
    reject_calibrated: float


def point(results: list[PointResult], process: str, load: float, system: str) -> PointResult:
    """The result of one (arrival process, load, system) point."""
    return next(r for r in results if r.process == process and r.load == load and r.system == system)
