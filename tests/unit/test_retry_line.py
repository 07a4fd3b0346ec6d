"""A replica's refused clients are told successive places, at the larger of the predicted and measured gaps."""

from __future__ import annotations

import pytest

from serve_app.policy import PolicyConfig
from serve_app.retry_line import RetryLines

POLICY = PolicyConfig()


def test_each_refusal_is_told_the_place_a_gap_after_the_last_one_told():
    lines = RetryLines(POLICY)
    told = [lines.tell("m", 0.5, 0.2, now=100.0) for _ in range(3)]
    assert told == pytest.approx([0.5, 0.7, 0.9])  # the registry's place, then one every predicted gap
    # A later answer of the registry is told as it is; the line goes on from it.
    assert lines.tell("m", 2.0, 0.2, now=100.0) == pytest.approx(2.0)
    assert lines.tell("m", 0.5, 0.2, now=100.0) == pytest.approx(2.2)
    # Each model has a line of its own.
    assert lines.tell("other", 0.5, 0.2, now=100.0) == pytest.approx(0.5)


def test_places_told_that_have_passed_no_longer_count():
    lines = RetryLines(POLICY)
    lines.tell("m", 0.5, 0.2, now=100.0)
    lines.tell("m", 0.5, 0.2, now=100.0)  # told 100.7
    assert lines.tell("m", 0.5, 0.2, now=101.0) == pytest.approx(0.5)


def test_rows_ending_slower_than_predicted_spread_the_line_at_the_measured_gap():
    # Rows ended 1 s apart over the last 4 s: the prediction's 0.05 s gap is not what places are doing.
    lines = RetryLines(POLICY)
    for t in (96.0, 97.0, 98.0, 99.0):
        lines.row_ended("m", t)
    assert lines.measured_gap_s("m", 100.0) == pytest.approx(1.0)  # 4 s since the first, 4 ends
    told = [lines.tell("m", 0.1, 0.05, now=100.0) for _ in range(3)]
    assert told == pytest.approx([0.1, 1.1, 2.1])
    # A batch that stopped ending rows reads slower as time passes; ends older than the window are forgotten.
    assert lines.measured_gap_s("m", 104.0) == pytest.approx(2.0)
    assert lines.measured_gap_s("m", 108.5) is None  # only the end at 99 is within the last 10 s


def test_the_delay_is_kept_within_the_policys_bounds():
    lines = RetryLines(POLICY)
    assert lines.tell("m", 0.0, 0.01, now=0.0) == POLICY.min_retry_after_s
    assert lines.tell("m", 1e6, 0.01, now=0.0) == POLICY.max_retry_after_s
