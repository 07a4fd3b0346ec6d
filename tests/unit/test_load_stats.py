"""The load benchmark's arithmetic against answers worked out by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from actors.tokenizer import Message
from benchmarks.load_scenarios import MIXED, Phase, Scenario, prompt_of, schedule, steady
from benchmarks.load_stats import (
    Record,
    Slo,
    Tail,
    by_class,
    closed_loop_rate,
    percentile,
    ratio,
    summarise,
    timeline,
)


def rec(cls="short", sent=100.0, ttft=0.1, e2e=0.5, status="200", error=None, tokens=5, t=0.0, start=None,
        dispatch=None):
    return Record(app="zeroqueue", scenario="s", index=0, cls=cls, t_sched=t, lag=0.0, sent=sent,
                  first_token=None if ttft is None else sent + ttft, end=sent + e2e, status=status, error=error,
                  output_tokens=tokens, server_start=start, server_dispatch=dispatch)


def test_percentile_interpolates_between_ranks_like_numpy():
    xs = list(range(1, 101))  # 1..100
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 100
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile(xs, 99.9) == pytest.approx(99.901)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_tail_spread_and_ratio():
    t = Tail.of([1.0] * 98 + [2.0, 3.0, None])
    assert t.n == 100 and t.p50 == 1.0
    assert t.p99 == pytest.approx(2.01) and t.spread == pytest.approx(2.01)
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0)) and ratio(1.0, 4.0) == 0.25


def test_record_derived_times_and_outcomes():
    r = rec(ttft=0.2, e2e=1.0, tokens=5, start=100.05)
    assert r.ok and r.ttft == pytest.approx(0.2) and r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx(0.8 / 4) and r.wait == pytest.approx(0.05)
    assert r.dispatch is None and not r.cold  # the baseline stamps no dispatch time
    hot = rec(dispatch=100.01, start=100.02)
    cold = rec(dispatch=100.01, start=101.5, ttft=1.6, e2e=2.0)
    assert hot.dispatch == pytest.approx(0.01) and not hot.cold and cold.cold
    assert rec(status="503", error="overloaded_error", ttft=None).outcome == "503 overloaded_error"
    broken = rec(status="200", error="api_error")  # an error event mid-stream is not a completion
    assert not broken.ok and broken.outcome == "200 api_error" and broken.tpot is None
    assert rec(status="timeout", error="client_timeout", ttft=None).outcome == "timeout client_timeout"


def test_slo_and_goodput():
    slo = Slo(ttft_s=1.0, e2e_factor=3.0, e2e_floor_s=1.0)
    service = {"short": 0.2, "long": 2.0}
    assert slo.e2e_s(0.2) == 1.0 and slo.e2e_s(2.0) == 6.0
    records = [
        rec("short", e2e=0.9, dispatch=100.01, start=101.05),  # good, though it started cold (> 1 s placing)
        rec("short", e2e=1.1),  # too slow end to end
        rec("short", ttft=1.5, e2e=0.95 + 1),  # TTFT over
        rec("long", ttft=0.5, e2e=5.9),  # good
        rec("long", status="503", error="overloaded_error", ttft=None, e2e=0.01),
        rec("long", status="timeout", error="client_timeout", ttft=None, e2e=30.0),
    ]
    s = summarise(records, window_s=2.0, slo=slo, service_s=service)
    assert (s.offered, s.completed, s.rejected, s.good, s.cold) == (6, 4, 1, 2, 1)
    assert s.goodput_rps == 1.0 and s.throughput_rps == 2.0
    assert s.rejection_rate == pytest.approx(1 / 6) and s.failure_rate == pytest.approx(1 / 6)
    assert s.failures == {"503 overloaded_error": 1, "timeout client_timeout": 1}
    assert s.reject_answer.p50 == pytest.approx(0.01) and s.reject_answer_max == pytest.approx(0.01)
    assert s.e2e.n == 4  # percentiles cover completed requests only
    per = by_class(records, ["short", "medium", "long"], 2.0, slo, service)
    assert list(per) == ["short", "long", "all"]
    assert per["short"].good == 1 and per["long"].good == 1 and per["all"].good == 2


def test_timeline_bins_by_arrival():
    records = [rec(t=0.2, ttft=0.1), rec(t=0.7, ttft=0.3), rec(t=1.5, status="503", error="overloaded_error"),
               rec(t=2.9, status="timeout", error="client_timeout", ttft=None)]
    bins = timeline(records, duration_s=3.0, bin_s=1.0)
    assert [b.offered for b in bins] == [2, 1, 1]
    assert [b.rejected for b in bins] == [0, 1, 0] and [b.failed for b in bins] == [0, 0, 1]
    assert bins[0].ttft_p50 == pytest.approx(0.2) and bins[0].ttft_max == pytest.approx(0.3)
    assert math.isnan(bins[1].ttft_p50)


def test_closed_loop_rate_counts_completions_ending_in_the_window():
    # The loop started at epoch 100; t_sched is each request's send time from then.
    def sent_at(t, e2e, status="200"):
        return replace(rec(sent=100.0 + t, e2e=e2e, status=status, error=None if status == "200" else "x"), t_sched=t)

    records = [
        sent_at(0.0, 1.5),  # ends at 1.5: in the warm-up
        sent_at(1.0, 1.5),  # ends at 2.5: counted
        sent_at(5.0, 4.0),  # ends at 9.0: counted
        sent_at(9.0, 2.0),  # ends at 11.0: after the window
        sent_at(3.0, 0.01, status="503"),  # refused: never counted
    ]
    assert closed_loop_rate(records, warmup_s=2.0, window_s=8.0) == (2, 0.25)
    with pytest.raises(ValueError):
        closed_loop_rate(records, 1.0, 0.0)


def test_refusals_slower_than_a_bound_are_counted():
    records = [rec(status="503", error="overloaded_error", ttft=None, e2e=e) for e in (0.01, 0.2, 0.3, 0.9)]
    s = summarise(records, 1.0, Slo(), {"short": 0.1})
    assert s.reject_answers == pytest.approx((0.01, 0.2, 0.3, 0.9))
    assert s.reject_slower_than(0.25) == 2 and s.reject_slower_than(1.0) == 0


def test_load_follows_the_phases():
    s = Scenario("b", "b", MIXED, (Phase(10, 0.0, 0.5), Phase(5, 10.0, 10.0)))
    assert s.duration_s == 15 and s.peak_load == 10.0
    assert s.load_at(0) == 0 and s.load_at(5) == pytest.approx(0.25) and s.load_at(12) == 10.0
    assert s.load_at(15) == 0.0


def test_schedule_is_deterministic_and_has_the_offered_rate():
    s = Scenario("m", "m", MIXED, steady(2000, 0.5))
    a, b = schedule(s, 2.0, seed=1), schedule(s, 2.0, seed=1)
    assert a == b and a != schedule(s, 2.0, seed=2)
    expected = 0.5 * 2.0 * 2000  # 2000 arrivals; Poisson: sd ~ 45
    assert abs(len(a) - expected) < 5 * math.sqrt(expected)
    assert all(0 <= x.t < 2000 for x in a) and [x.index for x in a] == list(range(len(a)))
    share = sum(x.cls == "long" for x in a) / len(a)
    assert abs(share - 0.1) < 0.03


def test_schedule_rate_follows_a_spike():
    s = Scenario("b", "b", MIXED, (Phase(200, 0.5, 0.5), Phase(20, 10.0, 10.0)))
    arrivals = schedule(s, 1.0, seed=3)
    base = sum(x.t < 200 for x in arrivals) / 200
    spike = sum(x.t >= 200 for x in arrivals) / 20
    assert 0.35 < base < 0.65 and 8 < spike < 12


class WordTokenizer:
    """One token per word, plus three for the chat template."""

    def encode_chat(self, messages, system=None):
        return [0, 0, 0] + [1] * len(messages[0].content.split())


def test_prompt_of_cuts_to_the_token_count():
    tok = WordTokenizer()
    for n in (4, 24, 600):
        assert len(tok.encode_chat([Message("user", prompt_of(tok, n))])) == n
    with pytest.raises(ValueError):
        prompt_of(tok, 3)


def test_the_servers_tier_says_cold_or_warm_and_older_records_fall_back_to_the_timing():
    from dataclasses import replace

    slow = rec(start=102.5, dispatch=100.02)  # 2.5 s from dispatch to compute start
    assert slow.cold and not slow.warm  # no tier: the timing says cold
    assert not replace(slow, tier="warm").cold and replace(slow, tier="warm").warm
    assert replace(rec(start=100.05, dispatch=100.02), tier="cold").cold  # the server's word wins
