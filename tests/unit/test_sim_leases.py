"""The simulator's leased cluster (benchmarks/sim_leases.py): the real registry and lease books under a
simulated load keep their invariants, place most admissions on leases, leave nothing but leases behind,
and refuse no more than central once capacity is ample; the report names every design."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from benchmarks.sim_calibration import ServiceTimes
from benchmarks.sim_config import SimConfig
from benchmarks.sim_model import run_zero_queue
from benchmarks.simulate import workload_for, zero_queue_cluster
from benchmarks.simulate_leases import leased_cluster, main

CFG = SimConfig(num_slots=16, duration_services=8.0, loads=(0.5,), processes=("poisson",))


def _run(cfg: SimConfig, load: float, num_replicas: int):
    workload = workload_for(cfg, "poisson", load, 0)
    service = ServiceTimes.of(cfg.calibration, workload)
    cluster = leased_cluster(cfg, num_replicas, early_refusal_s=0.1)
    return workload, cluster, run_zero_queue(workload, service, cluster, cfg.calibration.model_numbers())


def test_leases_keep_the_books_place_most_rows_locally_and_leave_only_leases():
    workload, cluster, outcome = _run(CFG, 0.5, num_replicas=3)
    cluster.check_books()  # no row leased twice, bytes and rows conserved on every slot
    service = ServiceTimes.of(CFG.calibration, workload)
    central = run_zero_queue(workload, service, zero_queue_cluster(CFG), CFG.calibration.model_numbers())
    assert outcome.is_rejected.sum() <= central.is_rejected.sum()  # the same arrivals, simulated time
    assert cluster.counts.local > cluster.counts.slow_path  # the heartbeat, not the request, meets the registry
    assert cluster.counts.exchanges > 0
    # Every request ended: what rows the registry still holds are leases with nothing running in them.
    rows = [r for a in cluster.state.books.actors.values() for r in a.rows.values()]
    assert all(r.is_lease for r in rows), [r for r in rows if not r.is_lease][:3]
    assert not any(book.num_rows - book.num_free for book in cluster.books)


def test_with_capacity_to_spare_leases_refuse_nothing_central_would_serve():
    cfg = replace(CFG, loads=(0.3,))
    workload, cluster, outcome = _run(cfg, 0.3, num_replicas=4)
    service = ServiceTimes.of(cfg.calibration, workload)
    central = run_zero_queue(workload, service, zero_queue_cluster(cfg), cfg.calibration.model_numbers())
    assert not central.is_rejected.any()
    assert not outcome.is_rejected.any(), np.flatnonzero(outcome.is_rejected)[:5]


def test_the_report_runs_and_compares_each_design_with_central(tmp_path):
    out = tmp_path / "simulation_leases.md"
    args = ["--slots", "16", "--replicas", "1,2", "--loads", "0.9", "--duration-services", "4", "--out", str(out)]
    assert main(args) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert {(r["design"], r["num_replicas"]) for r in data["rows"]} == {("central", 0), ("leases", 1), ("leases", 2)}
    text = out.read_text()
    assert "| 0.9 | leases | 2 |" in text and "Erlang-B floor" in text
