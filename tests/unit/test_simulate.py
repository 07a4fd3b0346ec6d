"""The cluster simulator: exact small cases, conservation, determinism, and the restricted
snapshot against the real RegistryState, request by request."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.sim_calibration import (
    CPU_MEASURED,
    MIXED_LENGTH,
    Burst,
    ServiceTimes,
    Workload,
    make_workload,
    short_lane_share,
)
from benchmarks.sim_model import IncrementalCluster, RegistryCluster, run_queued, run_zero_queue
from benchmarks.simulate import SimConfig, main, run_system, workload_for
from serve_app.policy import PolicyConfig
from serve_app.scorer import Prediction

NUMBERS = CPU_MEASURED.model_numbers()
GiB = 1 << 30


def _workload(arrivals, inputs=100, outputs=50) -> Workload:
    n = len(arrivals)
    return Workload(np.array(arrivals, float), np.zeros(n, np.int8), np.full(n, inputs), np.full(n, outputs),
                    0.0, float(max(arrivals)) + 1)


def _service(n, hot=0.5, cold=3.0, decode=4.5) -> ServiceTimes:
    return ServiceTimes(np.full(n, hot), np.full(n, cold), np.full(n, decode))


def _policy(**kw) -> PolicyConfig:
    return PolicyConfig(actor_overhead_bytes=CPU_MEASURED.actor_overhead_bytes, **kw)


def _resident(policy: PolicyConfig) -> int:
    return NUMBERS.weight_bytes + policy.actor_overhead_bytes


@pytest.mark.parametrize("backend", [IncrementalCluster, RegistryCluster])
def test_one_hot_slot_serves_or_refuses_at_once(backend):
    policy = _policy(max_hot_short_actors=1)
    cluster = backend([2 * GiB], policy, _resident(policy), num_prewarmed=1)
    out = run_zero_queue(_workload([0.0, 1.0, 5.0, 10.0]), _service(4), cluster, NUMBERS)
    # 0: the idle hot actor (ends at 5); 1: nothing idle, no free slot -> refused; 5: the actor is
    # idle again at exactly 5 (ends before arrivals at equal times); 10: idle.
    assert out.is_rejected.tolist() == [False, True, False, False]
    np.testing.assert_array_equal(out.ttft_s, [0.5, np.nan, 0.5, 0.5])
    np.testing.assert_array_equal(out.e2e_s, [5.0, np.nan, 5.0, 5.0])
    assert not out.is_cold.any() and out.reject_reason.tolist() == [-1, 0, -1, -1]


@pytest.mark.parametrize("backend", [IncrementalCluster, RegistryCluster])
def test_without_hot_actors_every_request_cold_starts_and_frees_its_slot(backend):
    policy = _policy(max_hot_short_actors=0)
    cluster = backend([2 * GiB], policy, _resident(policy))
    out = run_zero_queue(_workload([0.0, 7.0, 7.5, 8.0]), _service(4), cluster, NUMBERS)
    # Cold: TTFT 3.0, end to end 7.5; the slot frees at 7.5 and takes the arrival at 7.5.
    assert out.is_rejected.tolist() == [False, True, False, True]
    np.testing.assert_array_equal(out.e2e_s, [7.5, np.nan, 7.5, np.nan])
    assert out.is_cold.tolist() == [True, False, True, False]


def test_long_requests_never_take_a_short_lane_actor():
    policy = _policy(max_hot_short_actors=1)
    cluster = IncrementalCluster([2 * GiB], policy, _resident(policy), num_prewarmed=1)
    out = run_zero_queue(_workload([0.0], inputs=3000, outputs=700), _service(1), cluster, NUMBERS)
    assert out.is_rejected.tolist() == [True]  # the only slot holds an idle short-lane actor


def test_one_replica_queue_is_fifo_with_exact_waits():
    out = run_queued(_workload([0.0, 1.0, 2.0, 20.0]), _service(4), num_replicas=1)
    # Service 5 s each: 0 runs 0-5, 1 waits 4 s (5-10), 2 waits 8 s (10-15), 20 runs at once.
    np.testing.assert_array_equal(out.ttft_s, [0.5, 4.5, 8.5, 0.5])
    np.testing.assert_array_equal(out.e2e_s, [5.0, 9.0, 13.0, 5.0])
    assert not out.is_rejected.any()


def test_a_bounded_queue_refuses_what_does_not_fit():
    out = run_queued(_workload([0.0, 1.0, 2.0, 3.0]), _service(4), num_replicas=1, max_queued=1)
    assert out.is_rejected.tolist() == [False, False, True, True]
    np.testing.assert_array_equal(out.e2e_s, [5.0, 9.0, np.nan, np.nan])


def test_serve_routing_can_queue_behind_a_busy_replica_while_another_is_idle():
    # Replicas 0 and 1 run 100 s requests; a short request arriving at 1 s picks two of the three
    # replicas with room: when both picks are busy it waits ~99 s although one replica is idle.
    workload = _workload([0.0, 0.0, 1.0])
    service = ServiceTimes(np.array([0.5, 0.5, 0.1]), np.zeros(3), np.array([99.5, 99.5, 0.9]))
    waits = {round(float(run_queued(workload, service, 3, max_ongoing=5, seed=s).ttft_s[2] - 0.1), 3)
             for s in range(30)}
    assert waits == {0.0, 99.0}
    fifo = run_queued(workload, service, 3, max_ongoing=1)
    assert fifo.ttft_s[2] == pytest.approx(0.1)


SMALL = SimConfig(num_slots=40, duration_services=8.0, loads=(0.2, 1.5))


@pytest.mark.parametrize("system", ["zero-queue", "queued FIFO", "queued FIFO, bounded", "queued Serve default"])
def test_every_arrival_ends_finished_or_rejected(system):
    workload = workload_for(SMALL, "bursty", 1.5, 1)
    service = ServiceTimes.of(SMALL.calibration, workload)
    out = run_system(SMALL, system, workload, service)
    finished = np.isfinite(out.e2e_s)
    assert np.array_equal(finished, ~out.is_rejected)
    assert np.all(out.slot[finished] >= 0) and np.all(out.slot[~finished] == -1)
    # Nobody is faster than unloaded, and decode is the same everywhere.
    assert np.all(out.e2e_s[finished] >= service.hot_e2e_s[finished] - 1e-9)
    np.testing.assert_allclose((out.e2e_s - out.ttft_s)[finished], service.decode_s[finished])
    if system in ("queued FIFO", "queued Serve default"):
        assert not out.is_rejected.any()  # unbounded: it waits instead
    else:
        assert out.is_rejected.any()  # 1.5x capacity in bursts: a bound or no queue must refuse some


def test_at_low_load_zero_queue_refuses_nothing_and_short_requests_stay_hot():
    workload = workload_for(SMALL, "poisson", 0.2, 0)
    out = run_system(SMALL, "zero-queue", workload, ServiceTimes.of(SMALL.calibration, workload))
    assert not out.is_rejected.any()
    is_long = workload.class_index == 2
    assert out.is_cold[is_long].all() and not out.is_cold[~is_long].any()


def test_runs_are_deterministic_given_the_seed():
    def run(cfg):
        workload = workload_for(cfg, "poisson", 1.2, 3)
        return workload, run_system(cfg, "zero-queue", workload, ServiceTimes.of(cfg.calibration, workload))

    (w1, a), (w2, b), (w3, _) = run(SMALL), run(SMALL), run(replace(SMALL, seed=1))
    assert np.array_equal(w1.arrival_s, w2.arrival_s) and np.array_equal(a.slot, b.slot)
    np.testing.assert_array_equal(a.e2e_s, b.e2e_s)
    assert len(w1.arrival_s) != len(w3.arrival_s) or not np.array_equal(w1.arrival_s, w3.arrival_s)


class RecordingScorer:
    """Prefers later candidates and nodes with fewer busy actors; records what it was shown."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def predict(self, features, candidates):
        self.seen.append(tuple(candidates))
        return [Prediction(t, t + 1.0) for t in
                (1.0 / (1 + i) + 0.01 * c.node_num_busy + (0.5 if c.kind == "cold" else 0.0)
                 + c.slot_free_bytes * 1e-12 for i, c in enumerate(candidates))]


@pytest.mark.parametrize("max_actors_per_slot", [1, 2])
def test_restricted_snapshot_decides_exactly_as_the_registry(max_actors_per_slot):
    # Half the slots are too small for a long request; both lanes keep hot actors; few candidates.
    policy = _policy(max_hot_short_actors=3, max_hot_long_actors=2, max_candidates=3,
                     max_actors_per_slot=max_actors_per_slot)
    slots = [2 * GiB if i % 2 == 0 else 500_000_000 for i in range(12)]
    workload = make_workload(MIXED_LENGTH, 1.6, 900.0, 0.0, np.random.default_rng(7))
    service = ServiceTimes.of(CPU_MEASURED, workload)
    runs = []
    for backend in (RegistryCluster, IncrementalCluster):
        scorer = RecordingScorer()
        cluster = backend(slots, policy, _resident(policy), 2, scorer, slots_per_node=4)
        runs.append((run_zero_queue(workload, service, cluster, NUMBERS), scorer.seen))
    (a, seen_a), (b, seen_b) = runs
    assert len(workload.arrival_s) > 1000 and a.is_rejected.any() and a.is_cold.any() and (~a.is_cold).any()
    assert seen_a == seen_b  # every candidate, every field (free bytes, node_num_busy), in order
    assert np.array_equal(a.slot, b.slot) and np.array_equal(a.is_cold, b.is_cold)
    assert np.array_equal(a.reject_reason, b.reject_reason)


def test_calibration_goes_through_the_measured_points():
    cal = CPU_MEASURED
    for tokens, seconds in cal.hot_ttft_points:
        assert float(cal.hot_ttft_s(tokens)) == pytest.approx(seconds)
    assert float(cal.cold_from_start_s(cal.cold_reference_tokens)) == pytest.approx(cal.cold_first_token_s)
    # Beyond the last point prefill keeps growing along the last segment.
    (x1, y1), (x2, y2) = cal.hot_ttft_points[-2:]
    assert float(cal.hot_ttft_s(2 * x2 - x1)) == pytest.approx(2 * y2 - y1)
    assert np.all(cal.cold_ttft_s([16, 900, 3000]) > cal.hot_ttft_s([16, 900, 3000]) + cal.spawn_to_start_s)
    assert 0.5 < short_lane_share(cal, MIXED_LENGTH, PolicyConfig()) < 0.9


def test_bursty_arrivals_keep_the_mean_and_spike_tenfold():
    burst = Burst(multiplier=10.0, spike_services=1.0, period_services=20.0)
    w = make_workload(MIXED_LENGTH, 50.0, 2000.0, 0.0, np.random.default_rng(0), burst, mean_service_s=10.0)
    assert len(w.arrival_s) == pytest.approx(50.0 * 2000.0, rel=0.02)
    phase = w.arrival_s % 200.0
    in_spike = ((phase >= 100.0) & (phase < 110.0)).sum() / (10 * 10)  # per second, 10 spikes of 10 s
    outside = (~((phase >= 100.0) & (phase < 110.0))).sum() / (190 * 10)
    assert in_spike / outside == pytest.approx(10.0, rel=0.1)
    assert np.all(np.diff(w.arrival_s) >= 0) and math.isclose(w.horizon_s, 2000.0)


def test_cli_writes_the_report_and_plots(tmp_path):
    out = tmp_path / "simulation.md"
    main(["--slots", "16", "--loads", "0.5,1.5", "--duration-services", "4", "--processes", "poisson",
          "--out", str(out)])
    text = out.read_text()
    assert "queued FIFO" in text and "## What the simulation does not model" in text
    assert "outcomes identical: **yes**" in text
    assert (tmp_path / "simulation_poisson.png").stat().st_size > 10_000
