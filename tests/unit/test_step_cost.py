"""The step rule and its run-time check: one formula for the planner and the router, corrected by measured steps."""

from __future__ import annotations

import dataclasses
import math

import pytest

from actors.step_cost import StepCheck, StepCost, prompt_pairs
from serve_app.scorer import RuleScorer
from serve_app.snapshot import RequestFeatures


def test_a_step_is_its_decode_work_its_prompt_tokens_and_its_kv_reads():
    cost = StepCost(decode_s_per_token=0.02, batch_row_cost=0.1, prefill_tokens_per_s=1000.0, kv_read_bytes_per_s=1e9)
    assert cost.step_s(1, 0, 0, 1000) == pytest.approx(0.02)
    assert cost.step_s(5, 0, 0, 1000) == pytest.approx(0.02 * 1.4)  # 4 more rows, 10% each
    assert cost.step_s(1, 299, 0, 1000) == pytest.approx(0.02 + 0.299)  # a 300-token prompt alone
    assert cost.prefill_s(300) == pytest.approx(0.02 + 0.299)
    assert cost.step_s(2, 100, 2_000_000, 1000) == pytest.approx(0.022 + 0.1 + 2.0)
    assert cost.prefill_token_s(1000) == pytest.approx(1e-3 + 1e-6)


def test_a_prompt_tokens_attention_to_the_tokens_before_it_grows_with_the_square_of_the_prompt():
    assert prompt_pairs(0, 1) == 0 and prompt_pairs(0, 4) == 6  # keys 0, 1, 2, 3 before queries 1, 2, 3
    assert prompt_pairs(10, 4) == 40 + 6  # a chunk after 10 cached positions: each query reads them all
    # Chunks of a prompt compute the pairs of the whole prompt at once.
    assert prompt_pairs(0, 300) + prompt_pairs(300, 700) == prompt_pairs(0, 1000)
    cost = StepCost(decode_s_per_token=0.02, batch_row_cost=0.1, prefill_tokens_per_s=1000.0, kv_read_bytes_per_s=1e9,
                    attention_pairs_per_s=1e6)
    assert cost.prefill_s(1000) == pytest.approx(0.02 + 0.999 + 0.4995)
    assert cost.prompt_attention_s(4, 10) == pytest.approx(46e-6)
    assert cost.step_s(1, 999, 0, 1000, prompt_pairs(0, 1000)) == pytest.approx(cost.prefill_s(1000))
    # Unpriced by default: a short prompt's pairs are within the fitted per-token rate.
    assert StepCost().prefill_s(1000) == StepCost().decode_s_per_token + 999 / StepCost().prefill_tokens_per_s


def test_the_router_prices_a_long_prompt_with_its_attention():
    rule = RuleScorer(decode_s_per_token=0.01, prefill_tokens_per_s=1500.0, attention_pairs_per_s=2e6)
    short, long = (rule.step_cost().prefill_s(n) for n in (130, 1030))
    assert short == pytest.approx(0.01 + 129 / 1500 + 130 * 129 / 2 / 2e6)  # 4 ms of 100
    assert long - rule.step_cost().decode_s_per_token - 1029 / 1500 == pytest.approx(1030 * 1029 / 2 / 2e6)  # 0.26 s


def test_the_router_counts_a_long_prompts_chunks_with_their_attention():
    # Alone on an actor, a prompt with a TPOT target runs in chunks whose steps stay within twice it, each chunk
    # past the first one more pass over the weights. A chunk's attention grows with the prompt before it: 4,000
    # tokens under a 0.3 s target take 14 chunks priced (the engine's budgets step by step) against 5 flat.
    rule = RuleScorer(decode_s_per_token=0.0118, batch_row_cost=0.046, prefill_tokens_per_s=1408.0,
                      kv_read_bytes_per_s=1.86e10, attention_pairs_per_s=1.53e6)
    flat = dataclasses.replace(rule, attention_pairs_per_s=math.inf)
    long = RequestFeatures("m", 4000, 16, 10**8, 27_648, 0, tpot_target_s=0.3)
    assert flat._chunk_passes_s(long, 1.0) == pytest.approx(4 * 0.0118)
    assert rule._chunk_passes_s(long, 1.0) == pytest.approx(13 * 0.0118)
    assert rule._chunk_passes_s(dataclasses.replace(long, tpot_target_s=None), 1.0) == 0.0  # whole: one pass
    assert rule._chunk_passes_s(dataclasses.replace(long, input_tokens=130), 1.0) == 0.0  # one chunk


def test_the_router_predicts_decode_steps_with_the_same_rule():
    rule = RuleScorer(decode_s_per_token=0.05, batch_row_cost=0.2, prefill_tokens_per_s=500.0, kv_read_bytes_per_s=4e9)
    assert rule.step_cost() == StepCost(0.05, 0.2, 500.0, 4e9)
    assert rule.step_s(3, 1000, 2048) == rule.step_cost().step_s(3, 0, 1000, 2048)


@pytest.mark.parametrize("field", ["prefill_tokens_per_s", "kv_read_bytes_per_s", "attention_pairs_per_s"])
def test_rates_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        StepCost(**{field: 0.0})


def test_the_correction_follows_steps_that_run_slower_than_the_rule_and_the_error_shrinks():
    check = StepCheck(weight=0.2)
    for _ in range(60):  # the constants were measured on a machine 3x as fast
        check.observe(0.01, 0.03)
    assert check.correction == pytest.approx(3.0, rel=1e-3)
    assert check.median_error() < 0.01  # the corrected prediction is what is checked
    assert check.num_steps == 60


def test_one_stalled_step_moves_the_correction_by_a_bounded_amount():
    check = StepCheck(weight=0.1, max_correction=4.0)
    check.observe(0.01, 100.0)  # the machine stalled for 100 s
    assert check.correction == pytest.approx(0.9 + 0.1 * 4.0)
    assert check.median_error() == pytest.approx(100.0 / 0.01 - 1)


def test_a_step_without_a_prediction_or_a_time_is_not_counted():
    check = StepCheck()
    check.observe(0.0, 0.5)
    check.observe(0.5, 0.0)
    assert (check.num_steps, check.correction, check.median_error()) == (0, 1.0, None)


def test_the_baseline_is_the_measured_level_from_the_first_steps_and_moves_slowly_after():
    check = StepCheck(weight=0.1, baseline_weight=0.01)
    assert check.baseline == 1.0  # nothing measured: the constants' own
    check.observe(0.01, 0.036)  # fp32 steps where the constants were fitted in bf16: 3.6x
    assert check.baseline == pytest.approx(3.6)  # the first step sets it; the correction has moved a tenth
    assert check.correction == pytest.approx(0.9 + 0.36)
    for _ in range(99):
        check.observe(0.01, 0.036)
    assert check.baseline == pytest.approx(3.6)
    for _ in range(20):  # a burst on a busy host, twice as slow: the correction follows, the baseline barely does
        check.observe(0.01, 0.072)
    assert check.correction == pytest.approx(7.2, rel=0.15)  # within max_correction (8)
    assert check.baseline == pytest.approx(3.6 + (7.2 - 3.6) * (1 - 0.99 ** 20))  # a fifth of the way there


def test_the_baseline_is_a_mean_of_the_first_steps_not_the_first_one_alone():
    check = StepCheck(baseline_weight=0.01)
    check.observe(0.01, 0.04)  # a first forward's page faults: 4x
    for _ in range(9):
        check.observe(0.01, 0.01)  # then the constants' own speed
    assert check.baseline == pytest.approx((4.0 + 9 * 1.0) / 10)


def test_a_seeded_check_starts_at_the_others_figures_and_counts_only_its_own_steps():
    other = StepCheck()
    for _ in range(50):
        other.observe(0.01, 0.03)
    seeded = StepCheck.seeded_from(other)
    assert (seeded.correction, seeded.baseline) == (other.correction, other.baseline)
    assert seeded.num_steps == 0 and not seeded.recent_errors
    seeded.observe(0.01, 0.05)  # its own first step sets its baseline: a plain mean of its own steps
    assert seeded.baseline == pytest.approx(5.0) and other.baseline == pytest.approx(3.0)


def test_a_host_turned_slower_is_priced_so_within_a_few_steps_and_one_stalled_step_moves_nothing():
    check = StepCheck(weight=0.1, recent_steps=3)
    for _ in range(50):
        check.observe(0.01, 0.02)  # 2x the rule, as usual here
    before = check.mean
    check.observe(0.01, 0.5)  # one step stalled (50x): the median of the last three is still 2x
    assert check.correction == pytest.approx(0.9 * before + 0.1 * 8.0)  # the mean's bounded move alone
    for _ in range(3):
        check.observe(0.01, 0.02)
    for _ in range(2):
        check.observe(0.01, 0.06)  # a load generator starts beside the server: 6x
    assert check.correction == pytest.approx(6.0)  # two steps on
    assert check.mean < 4.0  # the mean alone lags far behind
    for _ in range(2):
        check.observe(0.01, 0.02)  # it ends: two steps on, the median is back, the mean decays as it would
    assert check.correction == pytest.approx(check.mean) and check.mean > 2.0
    unlifted = StepCheck(weight=0.1, recent_steps=0)
    for _ in range(2):
        unlifted.observe(0.01, 0.06)
    assert unlifted.correction == unlifted.mean < 2.0
    seeded = StepCheck.seeded_from(check)
    assert seeded.recent.maxlen == 3 and not seeded.recent and seeded.correction == check.correction
