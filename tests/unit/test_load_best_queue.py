"""Issue 23's load goals: the best-configured queue picked by its own goodput, and zeroqueue judged against it."""

from __future__ import annotations

import pytest

from benchmarks import load_apps
from benchmarks.load_apps import BOUNDED, UNBOUNDED, ZEROQUEUE, ongoing_system
from benchmarks.load_best_queue import best_queue, judge
from tests.unit.test_load_goals import summary

Q12, Q16 = ongoing_system(12), ongoing_system(16)


def run(zq_short_ttft=(0.05, 0.09), zq_refused_at_07=0) -> dict:
    points = {}
    for f, good in ((0.3, (100, 100, 100)), (0.7, (90, 95, 60)), (1.2, (30, 50, 20))):
        zq_all = summary(rejected=zq_refused_at_07 if f == 0.7 else 0)
        points[f] = {ZEROQUEUE: {"all": zq_all, "short": summary(ttft=zq_short_ttft)},
                     UNBOUNDED: {"all": summary(good=good[0]), "short": summary(ttft=(0.05, 0.1))},
                     BOUNDED: {"all": summary(), "short": summary(ttft=(0.05, 0.1))},
                     Q12: {"all": summary(good=good[1]), "short": summary()},
                     Q16: {"all": summary(good=good[2]), "short": summary()}}
    return points


CAPACITY = {ZEROQUEUE: {"rps": 9.4}, UNBOUNDED: {"rps": 9.0}, BOUNDED: {"rps": 9.0}, Q16: {"rps": 11.0},
            Q12: {"rps": 10.0}}


def by_name(goals) -> dict:
    return {g.name.split(" ")[0]: g for g in goals}


def test_the_best_queue_is_the_one_with_most_goodput_not_most_saturation():
    best, sums = best_queue(run(), CAPACITY)
    assert best == Q12  # Q16 saturates highest but serves fewest within the SLO
    assert sums == {UNBOUNDED: 22.0, Q12: 24.5, Q16: 18.0}


def test_zeroqueue_is_judged_against_the_best_queue_as_well_as_its_own_batch():
    goals, table = judge(run(), CAPACITY, max_batch=8)
    g = by_name(goals)
    assert list(g) == ["23.a", "23.b", "23.c", "23.d"]
    # 9.4 / 9.0 >= 1.0 but 9.4 / 10.0 < 0.95: missed, against the best queue only.
    assert g["23.a"].met is False and "0.94× queue-ongoing-12" in g["23.a"].figures
    assert g["23.b"].met and g["23.c"].met and g["23.d"].met
    assert any(f"{Q12} (best) | 12 |" in row for row in table) and any(f"{UNBOUNDED} | 8 |" in row for row in table)


def _closed_loop(classes_and_tokens, warmup_s=1.0, window_s=10.0) -> dict:
    """A closed loop's capacity entry whose requests end at 2 s, 3 s, ... (all within the window after 1 s)."""
    records = [{"app": "a", "scenario": "capacity", "index": i, "cls": cls, "t_sched": 0.0, "lag": 0.0, "sent": 100.0,
                "first_token": 100.5, "end": 102.0 + i, "status": "200", "error": None, "output_tokens": tokens,
                "server_start": None}
               for i, (cls, tokens) in enumerate(classes_and_tokens)]
    return {"rps": len(records) / window_s, "records": records, "warmup_s": warmup_s, "window_s": window_s}


def test_saturation_is_also_stated_in_output_tokens_where_the_classes_completed_differ():
    # zeroqueue completes more requests, all short (4 tokens); the best queue fewer, two of them long (64 tokens).
    capacity = {ZEROQUEUE: _closed_loop([("short", 4)] * 8), UNBOUNDED: _closed_loop([("short", 4)] * 4),
                BOUNDED: _closed_loop([("short", 4)] * 4), Q12: _closed_loop([("long", 64)] * 2 + [("short", 4)] * 4),
                Q16: _closed_loop([("short", 4)] * 3)}
    g = by_name(judge(run(), capacity, max_batch=8)[0])
    # 8 against 4 and 6 requests: 2.00x and 1.33x; 32 output tokens against 16 and 144: 2.00x and 0.22x.
    assert "2.00× queue-unbounded, 1.33× queue-ongoing-12" in g["23.a"].figures
    assert "in output tokens 2.00× and 0.22×" in g["23.a"].figures


def test_a_wide_tail_or_refusals_at_07x_miss_their_goals():
    g = by_name(judge(run(zq_short_ttft=(0.05, 0.2), zq_refused_at_07=6), CAPACITY, max_batch=8)[0])
    assert g["23.b"].met is False and "0.3×: 4.00" in g["23.b"].figures
    assert g["23.c"].met is False  # 0.2 s against the baselines' 0.1 s
    assert g["23.d"].met is False and "6.0%" in g["23.d"].figures


def test_the_unbounded_queue_at_other_batches_runs_after_the_three_systems_with_its_own_clients():
    args = {"slots": {"num_cpu_slots": 2}, "policy": {"max_batch": 8}}
    assert load_apps.run_order((12, 16)) == (*load_apps.RUN_ORDER, Q12, Q16)
    assert load_apps.run_order(()) == load_apps.RUN_ORDER
    assert load_apps.places(args) == 16 and load_apps.places(args, Q16) == 32
    assert load_apps.max_ongoing(UNBOUNDED, args) == 8


def test_the_baseline_refuses_a_batch_it_cannot_run_before_anything_starts():
    from benchmarks.baseline.app import baseline_config  # imports Ray and Serve, starts neither

    for bad in ({"max_ongoing_requests": 0}, {"max_ongoing": 12}):
        with pytest.raises(ValueError, match="max_ongoing_requests"):
            baseline_config({"models": [], "baseline": bad})
