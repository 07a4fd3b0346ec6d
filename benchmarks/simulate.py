"""Cluster simulator: zero-queue (the real `decide()`) against a FIFO-queued cluster, over offered load.

    .venv/bin/python -m benchmarks.simulate            # the full sweep, a few minutes on one core
    .venv/bin/python -m benchmarks.simulate --quick    # 40 slots, 5 loads, short runs: seconds
    .venv/bin/python -m benchmarks.simulate --tpot-target none   # without the places-by-prediction run

A discrete-event simulation of `--slots` accelerator slots under the mixed-length mix (10%
long, 50% medium, 40% short), Poisson and bursty arrivals, offered load 0.3 .. 1.5 x
capacity (capacity = what always-hot replicas running full batches of `--max-batch` rows
serve at most). Each load point runs the same arrivals through four clusters: zero-queue,
every slot holding a prewarmed hot actor that batches; a central FIFO queue in front of
always-hot batching replicas, unbounded and bounded; and Ray Serve's routing with the
per-replica limit of Ray Serve LLM's default (every request sent to a replica at once,
power of two choices, waiting in that replica's own queue beyond its batch). Beside each
load point's zero-queue refusal rate the report prints the Erlang-B floor B(c, A) with
c = slots x max_batch and A = offered rate x mean hot service time (benchmarks/erlang.py).
Places by prediction: every request also states a TPOT target (`--tpot-target`, by default
twice the calibration's one-row step) and zero-queue runs a second time on the same arrivals,
joins admitted by the scorer's predicted TPOT (up to `--zq-max-batch` rows, a safety cap)
instead of 8 fixed places; the queued baselines keep `--max-batch`. The scorer `decide` uses
is the rule priced with the calibration (sim_scorer.py), here and in the fixed run.
Writes benchmarks/results/simulation.md and its PNG plots. See sim_calibration.py (service
model, calibration), sim_model.py (the engines and the batching model), sim_clusters.py (the
zero-queue books), sim_config.py (what a sweep simulates), sim_results.py (what it produces: the
metrics), sim_report.py (tables, plots, the report) and sim_report_text.py (the prose).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.sim_calibration import (
    CPU_MEASURED,
    PRESETS,
    ArrivalKind,
    ServiceTimes,
    Workload,
    make_workload,
)
from benchmarks.sim_clusters import IncrementalCluster, RegistryCluster
from benchmarks.sim_config import DEFAULT_LOADS, SimConfig
from benchmarks.sim_model import Outcome, run_queued, run_zero_queue
from benchmarks.sim_report import write_report
from benchmarks.sim_results import (
    SYSTEM_NAMES,
    ZQ_BY_PREDICTION,
    ClassMetrics,
    DecisionCost,
    PointResult,
    ScorerCheck,
    class_metrics,
)
from benchmarks.sim_scorer import sim_scorer
from serve_app.scorer import RULE_SCORER, Scorer

log = logging.getLogger("benchmarks.simulate")

SYSTEMS = SYSTEM_NAMES  # zero-queue, queued FIFO, queued FIFO bounded, queued Serve default


def workload_for(cfg: SimConfig, process: ArrivalKind, load: float, index: int) -> Workload:
    # One seed per point, shared by the four systems: they see the very same arrivals.
    rng = np.random.default_rng([cfg.seed, index, 0 if process == "poisson" else 1])
    burst = cfg.burst if process == "bursty" else None
    return make_workload(cfg.mix, load * cfg.capacity_per_s, cfg.horizon_s, cfg.warmup_fraction * cfg.horizon_s,
                         rng, burst, cfg.mean_service_s)


def zero_queue_cluster(cfg: SimConfig, backend: str = "incremental", scorer: Scorer = RULE_SCORER,
                       by_prediction: bool = False) -> IncrementalCluster | RegistryCluster:
    """Zero-queue's cluster: fixed places (`max_batch`), or `by_prediction` (capped at `zq_max_batch`). The default
    scorer is the placeholder rule (simulate_leases compares with it); the sweep passes `sim_scorer`."""
    policy = cfg.policy(by_prediction)
    numbers = cfg.calibration.model_numbers()
    cls = IncrementalCluster if backend == "incremental" else RegistryCluster
    short, long = cfg.num_hot
    return cls([cfg.calibration.slot_bytes] * cfg.num_slots, policy, numbers.weight_bytes + policy.actor_overhead_bytes,
               short, scorer, cfg.slots_per_node, long)


def run_system(cfg: SimConfig, system: str, workload: Workload, service: ServiceTimes,
               scorer: Scorer | None = None) -> Outcome:
    """One system on one workload. `scorer`: zero-queue's; None, the rule priced with the calibration."""
    scorer = sim_scorer(cfg.calibration) if scorer is None else scorer
    if system in ("zero-queue", ZQ_BY_PREDICTION):
        by_prediction = system == ZQ_BY_PREDICTION
        return run_zero_queue(workload, service, zero_queue_cluster(cfg, scorer=scorer, by_prediction=by_prediction),
                              cfg.calibration.model_numbers(), cfg.tpot_target_s if by_prediction else None)
    if system == "queued Serve default":
        return run_queued(workload, service, cfg.num_slots, cfg.serve_max_ongoing, None, cfg.seed, cfg.max_batch)
    bound = cfg.bounded_queue if system == "queued FIFO, bounded" else None
    return run_queued(workload, service, cfg.num_slots, cfg.max_batch, bound, cfg.seed, cfg.max_batch)


def sweep(cfg: SimConfig, scorer: Scorer | None = None) -> list[PointResult]:
    results = []
    for process in cfg.processes:
        for index, load in enumerate(cfg.loads):
            workload = workload_for(cfg, process, load, index)
            service = ServiceTimes.of(cfg.calibration, workload)
            extra = (ZQ_BY_PREDICTION,) if load in cfg.measured_target_loads else ()
            for system in (*SYSTEMS, *extra):
                start = time.perf_counter()
                outcome = run_system(cfg, system, workload, service, scorer)
                wall = time.perf_counter() - start
                # Every system's TPOT is held against the target, whether it admitted by it or not.
                metrics = class_metrics(workload, service, outcome, cfg.mix, cfg.calibration.slo_extra_s,
                                        cfg.work_capacity, cfg.tpot_target_s)
                results.append(PointResult(process, load, system, metrics, wall, outcome.rows_per_busy_actor))
                log.info("%s load %.1f %-32s %6d arrivals, %5.1f%% rejected, %.1f s", process, load, system,
                         len(workload.arrival_s), 100 * metrics["all"].reject_rate, wall)
    return results


def decision_cost(cfg: SimConfig, num_arrivals: int = 2000, load: float = 1.0,
                  by_prediction: bool = False) -> DecisionCost:
    """Both zero-queue backends on the first arrivals of one load point: time and agreement. `by_prediction`: every
    request states the TPOT target and batches are capped at `zq_max_batch`."""
    full = workload_for(cfg, "poisson", load, 999)
    n = min(num_arrivals, len(full.arrival_s))
    workload = Workload(full.arrival_s[:n], full.class_index[:n], full.input_tokens[:n], full.output_tokens[:n],
                        0.0, float(full.arrival_s[n - 1]))
    service = ServiceTimes.of(cfg.calibration, workload)
    numbers, scorer = cfg.calibration.model_numbers(), sim_scorer(cfg.calibration)
    target = cfg.tpot_target_s if by_prediction else None
    times, outcomes = [], []
    for backend in ("registry", "incremental"):
        cluster = zero_queue_cluster(cfg, backend, scorer, by_prediction)
        start = time.perf_counter()
        outcomes.append(run_zero_queue(workload, service, cluster, numbers, target))
        times.append((time.perf_counter() - start) / n * 1e6)
    a, b = outcomes
    return DecisionCost(n, times[0], times[1], _identical(a, b), float(b.is_joined[~b.is_rejected].mean()))


def _identical(a: Outcome, b: Outcome) -> bool:
    return (np.array_equal(a.slot, b.slot) and np.array_equal(a.is_cold, b.is_cold)
            and np.array_equal(a.is_joined, b.is_joined) and np.array_equal(a.e2e_s, b.e2e_s, equal_nan=True))


def scorer_check(cfg: SimConfig, load: float, process: ArrivalKind = "poisson") -> ScorerCheck:
    """The fixed-places zero-queue of one sweep point (the same arrivals) decided by the placeholder rule scorer
    and by the calibrated one: does pricing the scorer with the simulation's model change the fixed run?"""
    workload = workload_for(cfg, process, load, cfg.loads.index(load))
    service = ServiceTimes.of(cfg.calibration, workload)
    default, calibrated = (run_system(cfg, "zero-queue", workload, service, s)
                           for s in (RULE_SCORER, sim_scorer(cfg.calibration)))
    # Refusals over the measured window, as the sweep's tables count them.
    window = (workload.arrival_s >= workload.warmup_s) & (workload.arrival_s < workload.horizon_s)
    return ScorerCheck(process, load, len(workload.arrival_s), _identical(default, calibrated),
                       float(np.mean(default.slot == calibrated.slot)), float(default.is_rejected[window].mean()),
                       float(calibrated.is_rejected[window].mean()))


def unloaded_metrics(cfg: SimConfig) -> dict[str, ClassMetrics]:
    """Every request of a load-1.0 Poisson workload on a hot actor with no wait: the floor of the mix."""
    workload = workload_for(cfg, "poisson", 1.0, 998)
    service = ServiceTimes.of(cfg.calibration, workload)
    outcome = Outcome.empty(len(workload.arrival_s))
    outcome.ttft_s[:], outcome.e2e_s[:] = service.hot_ttft_s, service.hot_e2e_s
    return class_metrics(workload, service, outcome, cfg.mix, cfg.calibration.slo_extra_s, cfg.work_capacity)


def _loads(text: str) -> tuple[float, ...]:
    if ":" in text:
        lo, hi, step = (float(x) for x in text.split(":"))
        return tuple(round(x, 3) for x in np.arange(lo, hi + step / 2, step))
    return tuple(float(x) for x in text.split(","))


def _tpot_target(text: str, step_s: float) -> float | None:
    """'none', seconds, or 'Nx': N one-row steps of the calibration."""
    if text.lower() == "none":
        return None
    return float(text[:-1]) * step_s if text.lower().endswith("x") else float(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=CPU_MEASURED.name)
    parser.add_argument("--slots", type=int, default=SimConfig.num_slots)
    parser.add_argument("--max-batch", type=int, default=SimConfig.max_batch, help="rows per actor or replica")
    parser.add_argument("--loads", type=_loads, default=DEFAULT_LOADS, help="lo:hi:step or a,b,c (x capacity)")
    parser.add_argument("--processes", default="poisson,bursty")
    parser.add_argument("--duration-services", type=float, default=60.0)
    parser.add_argument("--hot-fraction", type=float, default=1.0, help="slots holding a prewarmed hot actor")
    parser.add_argument("--serve-max-ongoing", type=int, default=None,
                        help="the Serve baseline's max_ongoing_requests (default: no limit, Ray Serve LLM's)")
    parser.add_argument("--queue-bound", type=int, default=None,
                        help="the bounded FIFO's queue length (default: capacity x half the SLO slack)")
    parser.add_argument("--tpot-target", default="2x",
                        help="the TPOT every request states in the places-by-prediction run: seconds, 'Nx' (N one-row "
                             "decode steps of the calibration) or 'none' (no such run); default 2x")
    parser.add_argument("--zq-max-batch", type=int, default=SimConfig.zq_max_batch,
                        help="places by prediction: zero-queue's safety cap on rows per actor")
    parser.add_argument("--target-loads", type=_loads, default=None,
                        help="the loads of the places-by-prediction run (default: every load)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="40 slots, 5 loads, 20 mean service times")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/simulation.md"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cal = PRESETS[args.preset]
    cfg = SimConfig(calibration=cal, num_slots=args.slots, max_batch=args.max_batch, loads=args.loads,
                    processes=tuple(p.strip() for p in args.processes.split(",")),  # type: ignore[misc]
                    duration_services=args.duration_services, hot_fraction=args.hot_fraction,
                    serve_max_ongoing=args.serve_max_ongoing, queue_bound=args.queue_bound,
                    tpot_target_s=_tpot_target(args.tpot_target, cal.decode_s_per_token),
                    zq_max_batch=args.zq_max_batch, target_loads=args.target_loads, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, num_slots=40, loads=(0.3, 0.6, 0.9, 1.2, 1.5), duration_services=20.0)
    start = time.perf_counter()
    costs = [decision_cost(cfg, by_prediction=by) for by in (False, True)[:1 + (cfg.tpot_target_s is not None)]]
    for cost in costs:
        log.info("decision cost per arrival: registry %.0f us, incremental %.0f us, identical: %s, joined %.0f%%",
                 cost.registry_us, cost.incremental_us, cost.is_identical, 100 * cost.join_rate)
    # Near capacity and at the top of the sweep: where joins are many, the scorer ranks most.
    checks = [scorer_check(cfg, x) for x in dict.fromkeys((min(cfg.loads, key=lambda x: abs(x - 1.0)), cfg.loads[-1]))]
    for check in checks:
        log.info("scorer check at %.1f: identical %s, same place %.3f", check.load, check.is_identical,
                 check.same_place)
    results = sweep(cfg)
    wall = time.perf_counter() - start
    command = " ".join([".venv/bin/python -m benchmarks.simulate", *(sys.argv[1:] if argv is None else argv)])
    write_report(args.out, cfg, results, costs, checks, unloaded_metrics(cfg), wall, command)
    print(f"wrote {args.out} in {wall:.0f} s")


if __name__ == "__main__":
    main()
