"""The edge's early refusals are told successive places, not one instant for the whole burst."""

from __future__ import annotations

import pytest

from serve_app.admission import _EarlyRefusal
from serve_app.policy import PolicyConfig


def _window(retry_at: float, place_gap_s: float) -> _EarlyRefusal:
    return _EarlyRefusal(until=100.1, retry_at=retry_at, place_gap_s=place_gap_s, num_freed=0, lane="short",
                         hold_s=0.8)


def test_each_early_refusal_is_told_the_place_after_the_last_one_told():
    policy = PolicyConfig()
    window = _window(retry_at=100.5, place_gap_s=0.2)  # the slow path's refusal was told 100.5
    told = [window.next_retry_after_s(100.0, policy) for _ in range(3)]
    assert told == pytest.approx([0.7, 0.9, 1.1])  # the second, third and fourth places


def test_the_delay_is_from_now_and_kept_within_the_policys_bounds():
    policy = PolicyConfig()
    window = _window(retry_at=100.0, place_gap_s=0.01)
    assert window.next_retry_after_s(100.5, policy) == policy.min_retry_after_s  # that place is already past
    far = _window(retry_at=100.0, place_gap_s=1e6)
    assert far.next_retry_after_s(100.0, policy) == policy.max_retry_after_s
