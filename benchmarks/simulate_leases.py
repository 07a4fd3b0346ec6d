"""The cluster simulator with leases and N ingress replicas: refusals against the central design and Erlang-B.

    .venv/bin/python -m benchmarks.simulate_leases           # 200 slots, 1/2/4/8 replicas; minutes on one core
    .venv/bin/python -m benchmarks.simulate_leases --slots 1000 --loads 0.9 --replicas 4 --duration-services 5
    .venv/bin/python -m benchmarks.simulate_leases --quick   # 40 slots: seconds

The same arrivals (simulate.py's workloads: the mixed-length mix, Poisson) run through the zero-queue
cluster twice over: central (every admission decided by the registry on the whole cluster, as
simulate.py's zero-queue system) and with leases (sim_leases.py: the real `RegistryState` and one real
`LeaseBook` per ingress replica, heartbeats every second, arrivals dealt to replicas at random). A refusal
with leases that central did not make is capacity a replica could not reach from its leases and the slow
path did not win back. Beside each: the Erlang-B floor for c = slots x max_batch places, and what the
leases cost the registry (slow-path calls and exchanges per admitted request, against central's two calls:
admit and finish).

Writes benchmarks/results/simulation_leases.md and .json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.common import cores, load_text, python_version
from benchmarks.sim_calibration import CPU_MEASURED, PRESETS, ServiceTimes
from benchmarks.sim_config import SimConfig
from benchmarks.sim_leases import LeasedCluster
from benchmarks.sim_model import run_zero_queue
from benchmarks.sim_results import class_metrics
from benchmarks.simulate import workload_for, zero_queue_cluster

log = logging.getLogger("benchmarks.simulate_leases")


def leased_cluster(cfg: SimConfig, num_replicas: int, early_refusal_s: float) -> LeasedCluster:
    policy, numbers = cfg.policy(), cfg.calibration.model_numbers()
    short, long = cfg.num_hot
    return LeasedCluster([cfg.calibration.slot_bytes] * cfg.num_slots, policy,
                         numbers.weight_bytes + policy.actor_overhead_bytes, short, slots_per_node=cfg.slots_per_node,
                         num_prewarmed_long=long, num_replicas=num_replicas, early_refusal_s=early_refusal_s,
                         seed=cfg.seed)


def run_point(cfg: SimConfig, load: float, index: int, replicas: list[int], early_refusal_s: float) -> list[dict]:
    workload = workload_for(cfg, "poisson", load, index)
    service = ServiceTimes.of(cfg.calibration, workload)
    numbers = cfg.calibration.model_numbers()
    out = []
    systems: list[tuple[str, int]] = [("central", 0)] + [("leases", n) for n in replicas]
    for design, n in systems:
        start = time.perf_counter()
        cluster = zero_queue_cluster(cfg) if design == "central" else leased_cluster(cfg, n, early_refusal_s)
        outcome = run_zero_queue(workload, service, cluster, numbers)
        cluster.check_books()
        wall = time.perf_counter() - start
        m = class_metrics(workload, service, outcome, cfg.mix, cfg.calibration.slo_extra_s, cfg.work_capacity)["all"]
        num_admitted = int((~outcome.is_rejected).sum())
        row = {"load": load, "design": design, "num_replicas": n, "arrivals": len(workload.arrival_s),
               "measured": m.num_arrivals, "reject_rate": m.reject_rate, "ttft_p99_s": m.ttft_s[1],
               "join_rate": m.join_rate, "erlang_floor": cfg.erlang_floor(load), "num_admitted": num_admitted,
               "wall_s": wall, "horizon_s": workload.horizon_s}
        if design == "leases":
            row["counts"] = asdict(cluster.counts)
        out.append(row)
        log.info("load %.1f %-7s %d replicas: %5.2f%% refused (floor %.2f%%), %.0f s", load, design, n,
                 100 * m.reject_rate, 100 * cfg.erlang_floor(load), wall)
    return out


def report(data: dict[str, Any]) -> str:
    rows = data["rows"]
    lines = [
        "# The cluster simulator with leases and N ingress replicas", "",
        f"Command: `{data['command']}`. Run {data['started']}, {data['wall_s'] / 60:.1f} minutes of wall time on one "
        f"core ({data['cores']} cores, Python {data['python']}; load average at the end {data['load']}: simulated "
        "time does not depend on it).", "",
        f"- cluster: {data['num_slots']} slots, one prewarmed hot actor each (simulate.py's zero-queue system: "
        f"{data['num_hot'][0]} of the short lane, {data['num_hot'][1]} of the long), batches of "
        f"{data['max_batch']} rows; the mixed-length mix, Poisson arrivals, {data['duration_services']:g} mean "
        "service times a load point (the first 10% not measured); preset "
        f"`{data['preset']}`",
        "- central: the registry decides every admission on the whole cluster (simulate.py's zero-queue system)",
        "- leases: sim_leases.py — the real `RegistryState` and one real `LeaseBook` per ingress replica; each "
        "arrival dealt to a replica at random; heartbeat exchanges every 1 s, staggered; "
        f"lease defaults (ttl 5 heartbeats, headroom 1 row, demand window 5 s); early refusal "
        f"{data['early_refusal_s']:g} s. Calls take no simulated time.", "",
        "| load | design | ingress replicas | rejected % | vs central (points) | Erlang-B floor % | TTFT P99 s | "
        "joined % | placed on a lease % | registry calls per admitted: slow path / give-backs / exchanges | "
        "early refusals % | turned away |",
        "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    central = {r["load"]: r for r in rows if r["design"] == "central"}
    for r in rows:
        c, k = central[r["load"]], r.get("counts")
        admitted = max(1, r["num_admitted"])
        extra = (f"{100 * k['local'] / admitted:.1f} | {k['slow_path'] / admitted:.3f} / "
                 f"{k['give_backs'] / admitted:.3f} / {k['exchanges'] / admitted:.3f} | "
                 f"{100 * k['early_refusals'] / r['arrivals']:.2f} | {k['turned_away']}") if k else \
            "— | 2 (admit, finish) | — | —"
        lines.append(f"| {r['load']:.1f} | {r['design']} | {r['num_replicas'] or '—'} | {100 * r['reject_rate']:.2f} | "
                     f"{100 * (r['reject_rate'] - c['reject_rate']):+.2f} | {100 * r['erlang_floor']:.2f} | "
                     f"{r['ttft_p99_s']:.2f} | {100 * r['join_rate']:.1f} | {extra} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=CPU_MEASURED.name)
    parser.add_argument("--slots", type=int, default=200)
    parser.add_argument("--replicas", default="1,2,4,8")
    parser.add_argument("--loads", default="0.6,0.9,1.2")
    parser.add_argument("--duration-services", type=float, default=20.0)
    parser.add_argument("--early-refusal-s", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="40 slots, 2 replicas at most, short runs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/simulation_leases.md"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    replicas = [int(x) for x in args.replicas.split(",")]
    loads = tuple(float(x) for x in args.loads.split(","))
    cfg = SimConfig(calibration=PRESETS[args.preset], num_slots=args.slots, loads=loads, processes=("poisson",),
                    duration_services=args.duration_services, seed=args.seed)
    if args.quick:
        cfg, replicas = replace(cfg, num_slots=40, duration_services=10.0), [1, 2]
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    rows = [row for index, load in enumerate(cfg.loads)
            for row in run_point(cfg, load, index, replicas, args.early_refusal_s)]
    data = {"command": " ".join([".venv/bin/python -m benchmarks.simulate_leases",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "started": started, "wall_s": time.perf_counter() - t0, "cores": cores(), "python": python_version(),
            "load": load_text(), "num_slots": cfg.num_slots, "num_hot": cfg.num_hot, "max_batch": cfg.max_batch,
            "duration_services": cfg.duration_services, "preset": cfg.calibration.name,
            "early_refusal_s": args.early_refusal_s, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    args.out.write_text(report(data))
    print(f"wrote {args.out} in {data['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
