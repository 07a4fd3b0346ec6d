"""Planning the live load sweep: point durations, fitting the budget, the Erlang-B floor column, the extras."""

from __future__ import annotations

import math

import pytest

from benchmarks.erlang import erlang_b
from benchmarks.load_scenarios import EXTRAS, extra_scenarios
from benchmarks.load_sweep import (
    LOADS,
    Budget,
    Overheads,
    hold_time_s,
    plan_durations,
    point_duration,
    point_name,
    refusal_floor_at,
    sweep_cost_s,
    sweep_scenarios,
)

BUDGET = Budget(total_s=25 * 60)  # 300 requests a point, 30..150 s, never below 10 s
NO_OVERHEAD = Overheads(per_system_s=0.0, per_point_s=0.0, overload_tail_s=0.0)


def test_the_loads_are_the_issues():
    assert LOADS == (0.3, 0.5, 0.7, 0.9, 1.2, 2.0)


def test_a_point_holds_about_300_requests_within_its_clamp():
    assert point_duration(5.0, BUDGET) == 60.0  # 300 / 5
    assert point_duration(20.0, BUDGET) == 30.0  # 15 s would hold 300, but at least 30 s
    assert point_duration(1.0, BUDGET) == 150.0  # 300 s would hold 300, but at most 150 s
    with pytest.raises(ValueError):
        point_duration(0.0, BUDGET)


def test_sweep_cost_counts_every_system_and_the_unbounded_queues_tails_once():
    overheads = Overheads(per_system_s=60.0, per_point_s=5.0, overload_tail_s=35.0)
    # 3 systems x (10 + 5 + 20 + 5) + 1 overload point's tail, once
    assert sweep_cost_s([10.0, 20.0], [0.5, 1.2], 3, overheads) == pytest.approx(3 * 40 + 35)


def test_durations_are_natural_when_they_fit():
    # capacity 10 req/s: rates 3, 5, 7, 9, 12, 20 -> 100, 60, 42.9, 33.3, 30, 30 s
    durations, scale = plan_durations(LOADS, 10.0, BUDGET, left_s=3600, num_systems=3, systems_to_deploy=2,
                                      overheads=NO_OVERHEAD)
    assert scale == 1.0
    assert durations == pytest.approx([100.0, 60.0, 300 / 7, 300 / 9, 30.0, 30.0])


def test_durations_are_scaled_by_one_factor_to_fit_what_is_left():
    overheads = Overheads(per_system_s=80.0, per_point_s=5.0, overload_tail_s=35.0)
    natural = [100.0, 60.0, 300 / 7, 300 / 9, 30.0, 30.0]  # 296.2 s a system
    fixed = 2 * 80 + 3 * 6 * 5 + 2 * 35  # two more deployments, 18 points' settling, two tails = 320 s
    left = fixed + 0.5 * 3 * sum(natural)
    durations, scale = plan_durations(LOADS, 10.0, BUDGET, left, 3, 2, overheads)
    assert scale == pytest.approx(0.5)
    assert durations == pytest.approx([max(10.0, 0.5 * d) for d in natural])
    # ... and then the whole plan takes exactly what was left
    assert 2 * 80 + sweep_cost_s(durations, LOADS, 3, overheads) == pytest.approx(left)


def test_scaling_never_goes_below_the_floor():
    durations, scale = plan_durations(LOADS, 10.0, BUDGET, left_s=50.0, num_systems=3, systems_to_deploy=2,
                                      overheads=NO_OVERHEAD)
    assert scale < 0.1 and durations == [10.0] * len(LOADS)
    durations, scale = plan_durations(LOADS, 10.0, BUDGET, left_s=-50.0, num_systems=3, systems_to_deploy=2,
                                      overheads=NO_OVERHEAD)
    assert scale == 0.0 and durations == [10.0] * len(LOADS)


def test_sweep_scenarios_are_steady_points_of_the_mix():
    points = sweep_scenarios((0.3, 2.0), (90.0, 30.0))
    assert [p.name for p in points] == [point_name(0.3), point_name(2.0)] == ["load-0.3", "load-2"]
    assert points[0].duration_s == 90.0 and points[0].load_at(45.0) == 0.3
    assert points[1].peak_load == 2.0 and not points[1].lossy and points[1].ttft_target_s is None


def test_the_floor_is_erlang_b_with_each_place_held_c_over_x():
    # 16 places, the baseline completes 10 req/s full: each request holds a place 1.6 s.
    assert hold_time_s(16, 10.0) == pytest.approx(1.6)
    # At 0.7x: 7 req/s x 1.6 s = 11.2 Erlangs on 16 places.
    assert refusal_floor_at(16, 7.0, 10.0) == pytest.approx(erlang_b(16, 11.2))
    # DESIGN's figures for 2 x 8 rows: ~0% at 0.3x, 1.7% at 0.6x, 4.3% at 0.7x.
    assert refusal_floor_at(16, 3.0, 10.0) < 1e-3
    assert refusal_floor_at(16, 6.0, 10.0) == pytest.approx(0.017, abs=0.001)
    assert refusal_floor_at(16, 7.0, 10.0) == pytest.approx(0.043, abs=0.001)
    assert math.isnan(refusal_floor_at(16, 7.0, 0.0)) and math.isnan(hold_time_s(16, 0.0))


def test_extras_are_named_and_unknown_ones_refused():
    assert [s.name for s in extra_scenarios(["slo", "burst"], quick=True)] == ["burst", "slo"]
    full = {s.name: s for s in extra_scenarios(EXTRAS, quick=False)}
    assert full["burst"].peak_load == 10.0 and full["burst"].spike == (25.0, 30.0)
    assert full["lossy"].lossy and full["slo"].ttft_target_s == 2.0
    assert extra_scenarios([], quick=False) == ()
    with pytest.raises(ValueError, match="unknown extras"):
        extra_scenarios(["steady"], quick=False)
