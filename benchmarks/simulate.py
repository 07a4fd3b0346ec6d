"""Cluster simulator: zero-queue (the real `decide()`) against a FIFO-queued cluster, over offered load.

    .venv/bin/python -m benchmarks.simulate            # the full sweep, a few minutes on one core
    .venv/bin/python -m benchmarks.simulate --quick    # 40 slots, 5 loads, short runs: seconds

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
from benchmarks.sim_results import SYSTEM_NAMES, ClassMetrics, DecisionCost, PointResult, class_metrics
from serve_app.scorer import RULE_SCORER, Scorer

log = logging.getLogger("benchmarks.simulate")

SYSTEMS = SYSTEM_NAMES  # zero-queue, queued FIFO, queued FIFO bounded, queued Serve default


def workload_for(cfg: SimConfig, process: ArrivalKind, load: float, index: int) -> Workload:
    # One seed per point, shared by the four systems: they see the very same arrivals.
    rng = np.random.default_rng([cfg.seed, index, 0 if process == "poisson" else 1])
    burst = cfg.burst if process == "bursty" else None
    return make_workload(cfg.mix, load * cfg.capacity_per_s, cfg.horizon_s, cfg.warmup_fraction * cfg.horizon_s,
                         rng, burst, cfg.mean_service_s)


def zero_queue_cluster(cfg: SimConfig, backend: str = "incremental",
                       scorer: Scorer = RULE_SCORER) -> IncrementalCluster | RegistryCluster:
    policy = cfg.policy()
    numbers = cfg.calibration.model_numbers()
    cls = IncrementalCluster if backend == "incremental" else RegistryCluster
    short, long = cfg.num_hot
    return cls([cfg.calibration.slot_bytes] * cfg.num_slots, policy, numbers.weight_bytes + policy.actor_overhead_bytes,
               short, scorer, cfg.slots_per_node, long)


def run_system(cfg: SimConfig, system: str, workload: Workload, service: ServiceTimes,
               scorer: Scorer = RULE_SCORER) -> Outcome:
    if system == "zero-queue":
        return run_zero_queue(workload, service, zero_queue_cluster(cfg, scorer=scorer),
                              cfg.calibration.model_numbers())
    if system == "queued Serve default":
        return run_queued(workload, service, cfg.num_slots, cfg.serve_max_ongoing, None, cfg.seed, cfg.max_batch)
    bound = cfg.bounded_queue if system == "queued FIFO, bounded" else None
    return run_queued(workload, service, cfg.num_slots, cfg.max_batch, bound, cfg.seed, cfg.max_batch)


def sweep(cfg: SimConfig, scorer: Scorer = RULE_SCORER) -> list[PointResult]:
    results = []
    for process in cfg.processes:
        for index, load in enumerate(cfg.loads):
            workload = workload_for(cfg, process, load, index)
            service = ServiceTimes.of(cfg.calibration, workload)
            for system in SYSTEMS:
                start = time.perf_counter()
                outcome = run_system(cfg, system, workload, service, scorer)
                wall = time.perf_counter() - start
                metrics = class_metrics(workload, service, outcome, cfg.mix, cfg.calibration.slo_extra_s,
                                        cfg.work_capacity)
                results.append(PointResult(process, load, system, metrics, wall))
                log.info("%s load %.1f %-21s %6d arrivals, %5.1f%% rejected, %.1f s", process, load, system,
                         len(workload.arrival_s), 100 * metrics["all"].reject_rate, wall)
    return results


def decision_cost(cfg: SimConfig, num_arrivals: int = 2000, load: float = 1.0) -> DecisionCost:
    """Both zero-queue backends on the first arrivals of one load point: time and agreement."""
    full = workload_for(cfg, "poisson", load, 999)
    n = min(num_arrivals, len(full.arrival_s))
    workload = Workload(full.arrival_s[:n], full.class_index[:n], full.input_tokens[:n], full.output_tokens[:n],
                        0.0, float(full.arrival_s[n - 1]))
    service = ServiceTimes.of(cfg.calibration, workload)
    numbers = cfg.calibration.model_numbers()
    times, outcomes = [], []
    for backend in ("registry", "incremental"):
        cluster = zero_queue_cluster(cfg, backend)
        start = time.perf_counter()
        outcomes.append(run_zero_queue(workload, service, cluster, numbers))
        times.append((time.perf_counter() - start) / n * 1e6)
    a, b = outcomes
    same = (np.array_equal(a.slot, b.slot) and np.array_equal(a.is_cold, b.is_cold)
            and np.array_equal(a.is_joined, b.is_joined) and np.array_equal(a.e2e_s, b.e2e_s, equal_nan=True))
    return DecisionCost(n, times[0], times[1], same, float(b.is_joined[~b.is_rejected].mean()))


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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="40 slots, 5 loads, 20 mean service times")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/simulation.md"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = SimConfig(calibration=PRESETS[args.preset], num_slots=args.slots, max_batch=args.max_batch, loads=args.loads,
                    processes=tuple(p.strip() for p in args.processes.split(",")),  # type: ignore[misc]
                    duration_services=args.duration_services, hot_fraction=args.hot_fraction,
                    serve_max_ongoing=args.serve_max_ongoing, queue_bound=args.queue_bound, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, num_slots=40, loads=(0.3, 0.6, 0.9, 1.2, 1.5), duration_services=20.0)
    start = time.perf_counter()
    cost = decision_cost(cfg)
    log.info("decision cost per arrival: registry %.0f us, incremental %.0f us, identical: %s, joined %.0f%%",
             cost.registry_us, cost.incremental_us, cost.is_identical, 100 * cost.join_rate)
    results = sweep(cfg)
    wall = time.perf_counter() - start
    command = " ".join([".venv/bin/python -m benchmarks.simulate", *(sys.argv[1:] if argv is None else argv)])
    write_report(args.out, cfg, results, cost, unloaded_metrics(cfg), wall, command)
    print(f"wrote {args.out} in {wall:.0f} s")


if __name__ == "__main__":
    main()
