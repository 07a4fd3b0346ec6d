"""The cluster simulator: exact small cases (alone and batched), conservation, determinism, the
restricted snapshot against the real RegistryState request by request, exact books under
batching, and the Erlang-B floor in the report."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.erlang import erlang_b
from benchmarks.sim_calibration import (
    CPU_MEASURED,
    MIXED_LENGTH,
    Burst,
    ServiceTimes,
    Workload,
    capacity_per_s,
    make_workload,
    mean_hot_service_s,
    short_lane_share,
)
from benchmarks.sim_clusters import IncrementalCluster, RegistryCluster
from benchmarks.sim_model import run_queued, run_zero_queue
from benchmarks.sim_report import FLOOR_HEADER
from benchmarks.sim_report_target import TARGET_FLOOR_HEADER, TARGET_SECTION
from benchmarks.sim_results import ZQ_BY_PREDICTION, class_metrics
from benchmarks.sim_scorer import rows_within, sim_scorer
from benchmarks.simulate import SimConfig, main, run_system, workload_for, zero_queue_cluster
from serve_app.decisions import Join
from serve_app.policy import PolicyConfig
from serve_app.scorer import Prediction

NUMBERS = CPU_MEASURED.model_numbers()
GiB = 1 << 30


def _workload(arrivals, inputs=100, outputs=50) -> Workload:
    n = len(arrivals)
    return Workload(np.array(arrivals, float), np.zeros(n, np.int8), np.full(n, inputs), np.full(n, outputs),
                    0.0, float(max(arrivals)) + 1)


def _service(n, hot=0.5, cold=3.0, decode=4.5, step_s=0.0, batch_row_cost=0.0) -> ServiceTimes:
    return ServiceTimes(np.full(n, hot), np.full(n, cold), np.full(n, decode), step_s, batch_row_cost)


def _policy(**kw) -> PolicyConfig:
    # The simulator's clusters model no eviction (benchmarks/sim_clusters.py).
    return PolicyConfig(actor_overhead_bytes=CPU_MEASURED.actor_overhead_bytes, is_eviction_enabled=False, **kw)


def _resident(policy: PolicyConfig) -> int:
    return NUMBERS.weight_bytes + policy.actor_overhead_bytes


@pytest.mark.parametrize("backend", [IncrementalCluster, RegistryCluster])
def test_one_hot_slot_serves_or_refuses_at_once(backend):
    policy = _policy(max_hot_short_actors=1, max_batch=1)
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


# A two-row batch, exactly: a step of b rows takes 0.1 s x (1 + 0.5 (b - 1)).
BATCHED = dict(step_s=0.1, batch_row_cost=0.5)


@pytest.mark.parametrize("backend", [IncrementalCluster, RegistryCluster])
def test_a_hot_actor_takes_a_second_row_and_both_slow_down(backend):
    policy = _policy(max_hot_short_actors=1, max_batch=2)
    cluster = backend([2 * GiB], policy, _resident(policy), num_prewarmed=1)
    out = run_zero_queue(_workload([0.0, 1.0, 2.0, 7.5]), _service(4, **BATCHED), cluster, NUMBERS)
    # 0: alone, first token at 0.5, then 0.5 s of its 4.5 s of decode alone by 1.0.
    # 1: joins at 1.0: waits one two-row step (0.15 s), prefills 0.5 s: first token at 1.65.
    #    From 1.0 the batch runs at 1/1.5: 0 ends at 1.0 + 4.0 x 1.5 = 7.0. At 1.65 the clock
    #    reads 1.0 + 0.65 / 1.5, so 1 has 0.5 + 0.65 / 1.5 left at 7.0: 0.5 of it alone until 7.5,
    #    when 3 joins, the rest at 1/1.5: 1 ends at 7.5 + (0.65 / 1.5) x 1.5 = 8.15.
    # 2: both rows taken and no other slot: refused. 3: first token at 8.15, then alone.
    assert out.is_rejected.tolist() == [False, False, True, False]
    assert out.is_joined.tolist() == [False, True, False, True] and not out.is_cold.any()
    np.testing.assert_allclose(out.ttft_s, [0.5, 0.65, np.nan, 0.65])
    np.testing.assert_allclose(out.e2e_s, [7.0, 8.15 - 1.0, np.nan, 0.65 + 4.5])
    # The measured window is [0, 8.5): busy throughout; 1 row until 1.0, 2 until 7.0, 1 until 7.5, 2 until 8.15.
    assert out.busy_s == pytest.approx(8.5)
    assert out.rows_per_busy_actor == pytest.approx((1.0 + 2 * 6.0 + 0.5 + 2 * 0.65 + 0.35) / 8.5)


def test_a_replica_batches_exactly_as_an_actor_and_queues_the_rest():
    out = run_queued(_workload([0.0, 1.0, 2.0, 7.5]), _service(4, **BATCHED), num_replicas=1, max_ongoing=2,
                     max_batch=2)
    # 0 and 1 as in the zero-queue case until 7.0, when 2, queued since 2.0, joins 1 (0.15 + 0.5):
    # 1 ends at 7.0 + (0.5 + 0.65 / 1.5) x 1.5 = 8.4.
    np.testing.assert_allclose(out.ttft_s[:3], [0.5, 0.65, 5.0 + 0.65])
    np.testing.assert_allclose(out.e2e_s[:2], [7.0, 8.4 - 1.0])
    assert out.is_joined.tolist() == [False, True, True, True] and not out.is_rejected.any()


def test_a_long_request_takes_an_idle_short_lane_actor_only_where_it_would_be_refused():
    policy = _policy(max_hot_short_actors=1)
    cluster = IncrementalCluster([2 * GiB], policy, _resident(policy), num_prewarmed=1)
    out = run_zero_queue(_workload([0.0], inputs=3000, outputs=700), _service(1), cluster, NUMBERS)
    # The only slot holds an idle short-lane actor: it serves the request (once refused) with no process start.
    assert out.is_rejected.tolist() == [False] and out.is_cold.tolist() == [False]
    # Room for a fresh actor of the long lane: that one, not the short lane's.
    cluster = IncrementalCluster([2 * GiB, 2 * GiB], policy, _resident(policy), num_prewarmed=1)
    out = run_zero_queue(_workload([0.0], inputs=3000, outputs=700), _service(1), cluster, NUMBERS)
    assert out.is_rejected.tolist() == [False] and out.is_cold.tolist() == [True]


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
    # Nobody is faster than unloaded; decode is stretched by the batch, never past a full one's steps.
    assert np.all(out.e2e_s[finished] >= service.hot_e2e_s[finished] - 1e-9)
    decode, alone = (out.e2e_s - out.ttft_s)[finished], service.decode_s[finished]
    assert np.all(decode >= alone - 1e-9) and np.all(decode <= alone * service.slowdown(SMALL.max_batch) + 1e-9)
    assert (decode > alone + 1e-6).any() and out.is_joined.any()
    if system in ("queued FIFO", "queued Serve default"):
        assert not out.is_rejected.any()  # unbounded: it waits instead
    else:
        assert out.is_rejected.any()  # 1.5x capacity in bursts: a bound or no queue must refuse some


def test_at_low_load_zero_queue_refuses_nothing_and_runs_everything_hot():
    workload = workload_for(SMALL, "poisson", 0.2, 0)
    out = run_system(SMALL, "zero-queue", workload, ServiceTimes.of(SMALL.calibration, workload))
    assert not out.is_rejected.any() and not out.is_cold.any()
    # With half the slots hot, a request joins a hot batch before it cold-starts on a free slot.
    cfg = replace(SMALL, hot_fraction=0.5)
    out = run_zero_queue(workload, ServiceTimes.of(cfg.calibration, workload), zero_queue_cluster(cfg), NUMBERS)
    assert not out.is_rejected.any() and not out.is_cold.any() and out.is_joined.any()
    assert out.slot.max() < sum(cfg.num_hot) == SMALL.num_slots // 2


def test_runs_are_deterministic_given_the_seed():
    def run(cfg):
        workload = workload_for(cfg, "poisson", 1.2, 3)
        return workload, run_system(cfg, "zero-queue", workload, ServiceTimes.of(cfg.calibration, workload))

    (w1, a), (w2, b), (w3, _) = run(SMALL), run(SMALL), run(replace(SMALL, seed=1))
    assert np.array_equal(w1.arrival_s, w2.arrival_s) and np.array_equal(a.slot, b.slot)
    np.testing.assert_array_equal(a.e2e_s, b.e2e_s)
    assert len(w1.arrival_s) != len(w3.arrival_s) or not np.array_equal(w1.arrival_s, w3.arrival_s)


class RecordingScorer:
    """Prefers later candidates, smaller batches and nodes with fewer busy actors; records what it was shown."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def predict(self, features, candidates):
        self.seen.append(tuple(candidates))
        return [Prediction(t, t + 1.0, 0.01) for t in
                (1.0 / (1 + i) + 0.01 * c.node_num_busy + (0.5 if c.kind == "cold" else 0.0)
                 + 0.02 * c.batch_rows + 1e-7 * c.batch_tokens + c.slot_free_bytes * 1e-12
                 for i, c in enumerate(candidates))]


@pytest.mark.parametrize(("max_actors_per_slot", "max_batch"), [(1, 1), (2, 1), (1, 4), (2, 3)])
def test_restricted_snapshot_decides_exactly_as_the_registry(max_actors_per_slot, max_batch):
    # Half the slots are too small for a long request; both lanes keep hot actors; few candidates.
    policy = _policy(max_hot_short_actors=3, max_hot_long_actors=2, max_candidates=3,
                     max_actors_per_slot=max_actors_per_slot, max_batch=max_batch)
    slots = [2 * GiB if i % 2 == 0 else 500_000_000 for i in range(12)]
    workload = make_workload(MIXED_LENGTH, 1.6 * max_batch, 900.0, 0.0, np.random.default_rng(7))
    service = ServiceTimes.of(CPU_MEASURED, workload)
    runs = []
    for backend in (RegistryCluster, IncrementalCluster):
        scorer = RecordingScorer()
        cluster = backend(slots, policy, _resident(policy), 2, scorer, slots_per_node=4, num_prewarmed_long=1)
        runs.append((run_zero_queue(workload, service, cluster, NUMBERS), scorer.seen))
    (a, seen_a), (b, seen_b) = runs
    assert len(workload.arrival_s) > 1000 and a.is_rejected.any() and a.is_cold.any() and (~a.is_cold).any()
    assert a.is_joined.any() == (max_batch > 1)
    assert seen_a == seen_b  # every candidate, every field (free bytes, node_num_busy, batch rows), in order
    assert np.array_equal(a.slot, b.slot) and np.array_equal(a.is_cold, b.is_cold)
    assert np.array_equal(a.is_joined, b.is_joined) and np.array_equal(a.reject_reason, b.reject_reason)
    np.testing.assert_array_equal(a.e2e_s, b.e2e_s)


def _checked(backend):
    """The backend, checking its books after every admission, first token and row end."""

    class Checked(backend):
        def admit(self, features, now, request):
            decision = super().admit(features, now, request)
            self.check_books()
            return decision

        def started(self, name):
            super().started(name)
            self.check_books()

        def finish(self, name, request, now):
            super().finish(name, request, now)
            self.check_books()

    return Checked


@pytest.mark.parametrize("backend", [IncrementalCluster, RegistryCluster])
def test_under_load_requests_join_batches_and_the_books_stay_exact(backend):
    cfg = SimConfig(num_slots=6, max_batch=4, duration_services=12.0)
    workload = workload_for(cfg, "poisson", 1.2, 5)
    short, long = cfg.num_hot
    policy = cfg.policy()
    cluster = _checked(backend)([cfg.calibration.slot_bytes] * cfg.num_slots, policy, _resident(policy), short,
                                slots_per_node=cfg.slots_per_node, num_prewarmed_long=long)
    out = run_zero_queue(workload, ServiceTimes.of(cfg.calibration, workload), cluster, NUMBERS)
    admitted = ~out.is_rejected
    assert len(workload.arrival_s) > 250 and out.is_rejected.any()
    assert out.is_joined[admitted].mean() > 0.5  # at 1.2x most admissions are rows of a running batch
    # Every row ended and released its bytes: only idle hot actors' resident bytes are held.
    if backend is IncrementalCluster:
        assert all(a.state == "idle" and not a.rows for a in cluster.actors.values())
        assert cluster.reserved == [_resident(policy)] * cfg.num_slots
    else:
        snapshot = cluster.state.snapshot()
        assert all(a.state == "idle" and not a.rows for a in snapshot.actors)
        assert [s.reserved_bytes for s in snapshot.slots] == [_resident(policy)] * cfg.num_slots


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
    # One row at a time: capacity is slots over the mean service; a full batch of 8 serves more,
    # about 8 / slowdown(8) times as much: its decode steps are slower, its prefills are not.
    one = capacity_per_s(cal, MIXED_LENGTH, 10)
    assert one == pytest.approx(10 / mean_hot_service_s(cal, MIXED_LENGTH))
    eight = capacity_per_s(cal, MIXED_LENGTH, 10, 8)
    assert eight / one == pytest.approx(8 / cal.slowdown(8), rel=0.03)


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
    assert "outcomes identical: **yes**" in text and "Command: `.venv/bin/python -m benchmarks.simulate --slots 16" in text
    assert (tmp_path / "simulation_poisson.png").stat().st_size > 10_000


def test_the_report_prints_the_erlang_floor_beside_the_refusal_rate(tmp_path):
    out = tmp_path / "simulation.md"
    main(["--slots", "4", "--max-batch", "4", "--loads", "0.6,1.4", "--duration-services", "4",
          "--processes", "poisson", "--tpot-target", "none", "--out", str(out)])
    cfg = SimConfig(num_slots=4, max_batch=4)
    header, rows = None, []
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if FLOOR_HEADER in cells:
            header = cells
        elif header is not None and len(cells) == len(header) and cells[0] in ("0.6", "1.4"):
            rows.append(dict(zip(header, cells, strict=True)))
        elif header is not None and not line.startswith("|"):
            break
    assert TARGET_SECTION not in out.read_text()  # --tpot-target none: no places-by-prediction run
    assert [r["load"] for r in rows] == ["0.6", "1.4"]
    for row in rows:
        load = float(row["load"])
        floor = erlang_b(16, load * cfg.capacity_per_s * mean_hot_service_s(cfg.calibration, cfg.mix))
        assert row[FLOOR_HEADER] == f"{100 * floor:.1f}" and float(row["rejected %: zq all"]) >= 0
    assert float(rows[1][FLOOR_HEADER]) > 1.0  # 16 places at 1.4x: a floor, not a formality


# ---------------------------------------------------------------- places by prediction

STEP, ROW_COST = CPU_MEASURED.decode_s_per_token, CPU_MEASURED.batch_row_cost


def test_the_rows_a_target_allows_and_the_scorer_prices_the_simulated_step():
    assert rows_within(CPU_MEASURED, 2 * STEP, 32) == 18  # slowdown(18) = 1.95, slowdown(19) = 2.01
    assert rows_within(CPU_MEASURED, 2 * STEP, 12) == 12  # the safety cap
    assert rows_within(CPU_MEASURED, STEP * (1 + ROW_COST / 2), 32) == 1
    assert rows_within(CPU_MEASURED, 0.9 * STEP, 32) == 0
    scorer = sim_scorer(CPU_MEASURED)
    for rows in (1, 8, 18):  # a step of any batch, KV reads left out as the fluid model does
        assert scorer.step_s(rows, 4000, NUMBERS.kv_bytes_per_token) == pytest.approx(STEP * CPU_MEASURED.slowdown(rows))


def _recording(backend):
    """The backend, recording the rows of each actor after every join, and each join's prediction."""

    class Recording(backend):
        joins: list[tuple[float, int]]

        def admit(self, features, now, request):
            decision, name = super().admit(features, now, request)
            if isinstance(decision, Join):
                rows = (len(self.actors[name].rows) if hasattr(self, "actors")
                        else self.state.snapshot().actor(name).num_rows)
                self.__dict__.setdefault("joins", []).append((decision.prediction.tpot_s, rows))
            return decision, name

    return Recording


TARGETED = SimConfig(num_slots=6, duration_services=12.0, tpot_target_s=2 * STEP)


def _targeted_run(cfg: SimConfig, load: float, backend=IncrementalCluster):
    workload = workload_for(cfg, "poisson", load, 5)
    short, long = cfg.num_hot
    policy = cfg.policy(by_prediction=True)
    cluster = _recording(backend)([cfg.calibration.slot_bytes] * cfg.num_slots, policy, _resident(policy), short,
                                  sim_scorer(cfg.calibration), cfg.slots_per_node, long)
    service = ServiceTimes.of(cfg.calibration, workload)
    return workload, cluster, run_zero_queue(workload, service, cluster, NUMBERS, cfg.tpot_target_s)


def test_places_by_prediction_run_more_rows_than_eight_and_no_join_past_a_target():
    workload, cluster, out = _targeted_run(TARGETED, 1.5)
    allowed = rows_within(CPU_MEASURED, TARGETED.tpot_target_s, TARGETED.zq_max_batch)
    predicted, rows = np.array(cluster.joins).T
    assert rows.max() > TARGETED.max_batch  # the target, not a count of 8, bounds the batch
    assert rows.max() <= allowed  # and no join past it: every row states the same target
    assert np.all(predicted <= TARGETED.tpot_target_s)
    # The scorer's step is the simulated one: no admitted request decodes slower than its target.
    admitted = ~out.is_rejected
    tpot = ((out.e2e_s - out.ttft_s) / (workload.output_tokens - 1))[admitted]
    assert np.all(tpot <= TARGETED.tpot_target_s * (1 + 1e-9))
    # The same arrivals with 8 fixed places refuse more.
    fixed = run_zero_queue(workload, ServiceTimes.of(CPU_MEASURED, workload),
                           zero_queue_cluster(TARGETED, scorer=sim_scorer(CPU_MEASURED)), NUMBERS)
    assert fixed.is_rejected.sum() > out.is_rejected.sum()


def test_a_target_only_one_row_keeps_means_no_joins():
    cfg = replace(TARGETED, tpot_target_s=STEP * (1 + ROW_COST / 2))
    _, cluster, out = _targeted_run(cfg, 0.6)
    assert not out.is_joined.any() and not cluster.__dict__.get("joins")
    assert out.is_rejected.any()  # one request per actor: 0.6 of 8-row capacity does not fit 6 places


class PricedRecording:
    """The priced rule scorer, recording what it was shown since the last `calls.clear()`."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.rule = sim_scorer(CPU_MEASURED)

    def predict(self, features, candidates):
        self.calls.append(tuple(candidates))
        return self.rule.predict(features, candidates)


def _first_calls(backend):
    """The backend, keeping per admission the candidates of decide's first `predict` call: with targets the
    registry asks the scorer again for a refusal's retry-after, which the incremental books do not compute."""

    class FirstCalls(backend):
        def admit(self, features, now, request):
            self.scorer.calls.clear()
            out = super().admit(features, now, request)
            self.__dict__.setdefault("seen", []).append(self.scorer.calls[:1])
            return out

    return FirstCalls


def test_both_backends_decide_alike_with_targets_and_hot_spawns():
    # A hot pool larger than the prewarmed actors: spawned actors stay hot and are joined, so their first row's
    # target counts too. A tight target (5 rows) makes rows bind.
    policy = _policy(max_hot_short_actors=4, max_hot_long_actors=2, max_batch=32)
    target = STEP * CPU_MEASURED.slowdown(5)
    workload = make_workload(MIXED_LENGTH, 4.0, 400.0, 0.0, np.random.default_rng(3))
    service = ServiceTimes.of(CPU_MEASURED, workload)
    runs = []
    for backend in (RegistryCluster, IncrementalCluster):
        cluster = _first_calls(backend)([2 * GiB] * 8, policy, _resident(policy), 1, PricedRecording(), 4, 1)
        runs.append((run_zero_queue(workload, service, cluster, NUMBERS, target), cluster.seen))
    (a, seen_a), (b, seen_b) = runs
    assert a.is_cold.any() and a.is_joined.any() and a.is_rejected.any()
    # Every candidate alike, a batch's tightest target (`batch_tpot_target_s`) included.
    assert seen_a == seen_b
    assert np.array_equal(a.slot, b.slot) and np.array_equal(a.is_joined, b.is_joined)
    np.testing.assert_array_equal(a.e2e_s, b.e2e_s)


def test_tpot_is_measured_against_the_target():
    workload = _workload([0.0, 10.0])
    service = _service(2)
    out = run_zero_queue(workload, service, IncrementalCluster([2 * GiB], _policy(max_hot_short_actors=1), _resident(
        _policy()), num_prewarmed=1), NUMBERS)
    tpot = 4.5 / 49  # alone: 4.5 s of decode over 49 tokens after the first
    for target, over in ((tpot, 0.0), (0.9 * tpot, 1.0)):
        m = class_metrics(workload, service, out, MIXED_LENGTH[:1], 5.0, 1.0, target)["all"]
        assert m.tpot_s[0] == pytest.approx(tpot) and m.tpot_over_target == over


def test_the_report_compares_places_by_prediction(tmp_path):
    out = tmp_path / "simulation.md"
    main(["--slots", "6", "--loads", "0.6,1.5", "--target-loads", "1.5", "--duration-services", "4",
          "--processes", "poisson", "--out", str(out)])
    text = out.read_text()
    section = text[text.index(TARGET_SECTION):text.index("### poisson arrivals, short requests")]
    assert "T = 82.3 ms" in section and "**18 rows**" in section and "loads 1.5" in section
    assert TARGET_FLOOR_HEADER in section and "outcomes identical: **yes**" in section
    rows = [line for line in section.splitlines() if line.startswith("| 1.5 |")]
    assert len(rows) == 3 and all("–" not in row for row in rows)  # every system ran at 1.5
    assert any(line.startswith("| 0.6 |") and "| – |" in line for line in section.splitlines())
    assert f"| 1.5 | {ZQ_BY_PREDICTION} |" in text  # beside the others in the per-class tables
