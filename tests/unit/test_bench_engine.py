"""bench_engine's fit of the rule's prompt rates: per token and per attention pair, from two prompts."""

from __future__ import annotations

import math

import pytest

from actors.step_cost import StepCost
from benchmarks.bench_engine import prefill_rates


def test_two_prompts_give_back_the_per_token_and_per_pair_rates_that_made_them():
    cost = StepCost(decode_s_per_token=0.01, prefill_tokens_per_s=1500.0, attention_pairs_per_s=2e6)
    points = tuple((n, cost.prefill_s(n) - cost.decode_s_per_token) for n in (128, 1024))
    rates = prefill_rates(points)
    assert rates["prefill_tokens_per_s"] == pytest.approx(1500.0)
    assert rates["attention_pairs_per_s"] == pytest.approx(2e6)


def test_a_long_prompt_no_slower_per_token_prices_no_attention():
    rates = prefill_rates(((128, 127 / 1500), (1024, 1023 / 1600)))  # noise: the long one a little faster
    assert rates["attention_pairs_per_s"] == math.inf
    assert 1500 < rates["prefill_tokens_per_s"] < 1600
