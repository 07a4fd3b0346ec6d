"""The batch scheduler: every running row advances every step, and a prompt never stalls decoding rows for long."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.scheduler import (
    MAX_STEP_STRETCH,
    PACE_SHARE,
    RowProgress,
    idle_step_limit_s,
    max_step_s,
    paced_due,
    plan_step,
    prefill_budget,
    step_terms,
)
from actors.step_cost import StepCost

rows_strategy = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(0, 3000)).map(lambda t: (t[0], min(t[0], t[1]))),
    min_size=1, max_size=16,
).map(lambda rs: [RowProgress(i, n, done) for i, (n, done) in enumerate(rs)])


@settings(max_examples=500, deadline=None)
@given(rows=rows_strategy, budget=st.integers(1, 1024))
def test_every_row_advances_every_step_within_its_prompt(rows, budget):
    plan = plan_step(rows, budget)
    assert [row_id for row_id, _ in plan] == [r.row_id for r in rows]  # every row, in join order
    for r, (_, n) in zip(rows, plan, strict=True):
        assert n >= 1
        if r.is_prefilling:
            assert n <= r.num_remaining  # a chunk never runs past the prompt
        else:
            assert n == 1  # a decoding row samples exactly one token per step


@settings(max_examples=500, deadline=None)
@given(rows=rows_strategy, budget=st.integers(1, 1024))
def test_a_budget_bounds_a_steps_prefill_work_whether_or_not_a_row_decodes(rows, budget):
    plan = plan_step(rows, budget)
    prefill = [n for r, (_, n) in zip(rows, plan, strict=True) if r.is_prefilling]
    assert sum(prefill) <= max(budget, len(prefill))


@settings(max_examples=300, deadline=None)
@given(rows=rows_strategy)
def test_without_a_budget_the_prompts_run_whole_and_only_while_no_row_decodes(rows):
    if all(r.is_prefilling for r in rows):
        assert plan_step(rows, None) == [(r.row_id, r.num_remaining) for r in rows]
    else:
        with pytest.raises(ValueError, match="decoding row"):
            plan_step(rows, None)


@settings(max_examples=200, deadline=None)
@given(rows=rows_strategy, budget=st.integers(1, 512))
def test_repeated_steps_finish_every_prompt_no_row_starves(rows, budget):
    """Stepping the plan to the end: every prompt completes, in a bounded number of steps."""
    state = {r.row_id: r for r in rows}
    for _ in range(10_000):
        current = list(state.values())
        if not any(r.is_prefilling for r in current):
            return
        for row_id, n in plan_step(current, budget):
            r = state[row_id]
            if r.is_prefilling:
                state[row_id] = RowProgress(r.row_id, r.num_prompt_tokens, r.num_prefilled + n)
    raise AssertionError("a prompt never finished")


def test_budget_is_shared_among_the_prompts_the_shortest_first_and_every_row_advances():
    rows = [RowProgress(0, 10, 10), RowProgress(1, 500, 0), RowProgress(2, 3, 0), RowProgress(3, 500, 100)]
    # One token each, then the 253 left water-filled: row 2 needs only 2 more, rows 3 (400 left) and 1
    # (500 left) share the 251 after it, the odd token to the shorter one.
    assert plan_step(rows, 256) == [(0, 1), (1, 126), (2, 3), (3, 127)]
    # Row 1 needs only 20 more: it takes them, and row 3 the rest (256 - 1 - 3 - 20 = 232 beyond its one).
    rows[1] = RowProgress(1, 500, 480)
    assert plan_step(rows, 256) == [(0, 1), (1, 20), (2, 3), (3, 233)]


def test_a_short_prompt_that_joins_behind_a_long_one_is_done_in_its_first_step():
    decoding, long_prompt, short_prompt = RowProgress(0, 10, 10), RowProgress(1, 600, 0), RowProgress(2, 24, 0)
    # 50 prompt tokens a step: first come, first served gave the short prompt 1 a step for 12 steps.
    assert plan_step([decoding, long_prompt, short_prompt], 50) == [(0, 1), (1, 26), (2, 24)]


decoding_and_prompts = st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 3000)), min_size=1, max_size=15).map(
    lambda rs: [RowProgress(0, 5, 5)] + [RowProgress(i + 1, n, min(n - 1, done)) for i, (n, done) in enumerate(rs)])


@settings(max_examples=500, deadline=None)
@given(rows=decoding_and_prompts, budget=st.integers(1, 1024))
def test_no_prompt_gets_more_of_a_step_than_a_longer_one_unless_it_finishes(rows, budget):
    plan = dict(plan_step(rows, budget))
    prompts = [r for r in rows if r.is_prefilling]
    assert sum(plan[r.row_id] for r in prompts) == max(len(prompts), min(budget, sum(r.num_remaining for r in prompts)))
    for a in prompts:
        for b in prompts:
            if a.num_remaining < b.num_remaining and plan[a.row_id] < a.num_remaining:
                assert plan[a.row_id] >= plan[b.row_id]


@settings(max_examples=300, deadline=None)
@given(rows=decoding_and_prompts, n=st.integers(1, 3000), extra=st.integers(0, 512))
def test_a_joiners_prompt_is_done_once_at_most_its_length_of_every_other_prompt_is(rows, n, extra):
    """What the router predicts a join from (ActorView.prompt_tokens_ahead): with `budget` prompt tokens a
    step, a joiner's n-token prompt is done within ceil((sum of min(left, n) over the other prompts + n) /
    budget) steps."""
    joiner = RowProgress(len(rows), n, 0)
    prompts = [r for r in rows if r.is_prefilling] + [joiner]
    budget = len(prompts) + extra
    ahead = sum(min(r.num_remaining, n) for r in prompts if r is not joiner)
    state = {r.row_id: r for r in [*rows, joiner]}
    num_steps = 0
    while state[joiner.row_id].is_prefilling:
        num_steps += 1
        for row_id, k in plan_step(list(state.values()), budget):
            r = state[row_id]
            if r.is_prefilling:
                state[row_id] = RowProgress(r.row_id, r.num_prompt_tokens, r.num_prefilled + k)
    assert num_steps <= -(-(ahead + n) // budget)


# ---- the budget: steps bounded by the tightest TPOT target of the decoding rows

targeted_rows = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(0, 3000), st.integers(0, 500),
              st.one_of(st.none(), st.floats(0.005, 2.0))),
    min_size=1, max_size=16,
).map(lambda rs: [RowProgress(i, n, min(n, done), min(n, done) + (out if done >= n else 0), target)
                  for i, (n, done, out, target) in enumerate(rs)])
# Prompt attention unpriced (the rule's default) or priced from a tenth to ten times SmolLM2's measured rate.
costs = st.builds(StepCost, decode_s_per_token=st.floats(0.001, 0.1), batch_row_cost=st.floats(0.0, 0.5),
                  prefill_tokens_per_s=st.floats(100.0, 20_000.0), kv_read_bytes_per_s=st.floats(1e8, 1e11),
                  attention_pairs_per_s=st.one_of(st.just(float("inf")), st.floats(1.5e5, 1.5e7)))
KV_BYTES_PER_TOKEN = 4096


def _planned_s(rows, plan, cost):
    return cost.step_s(*step_terms(rows, plan)[:3], KV_BYTES_PER_TOKEN, step_terms(rows, plan)[3])


def _budget(rows, cap, cost):
    def predict(num_rows, extra, kv, pairs):
        return cost.step_s(num_rows, extra, kv, KV_BYTES_PER_TOKEN, pairs)
    return prefill_budget(rows, cap, predict, cost.prefill_token_s(KV_BYTES_PER_TOKEN),
                          1.0 / cost.attention_pairs_per_s)


@settings(max_examples=500, deadline=None)
@given(rows=targeted_rows, cap=st.integers(1, 1024), cost=costs)
def test_a_planned_step_keeps_every_decoding_row_within_its_target_where_any_step_could(rows, cap, cost):
    plan = plan_step(rows, _budget(rows, cap, cost))
    decoding = [r for r in rows if not r.is_prefilling]
    targets = [r.tpot_target_s for r in decoding if r.tpot_target_s is not None]
    prefilling = [r for r in rows if r.is_prefilling]
    prefill = sum(n for r, (_, n) in zip(rows, plan, strict=True) if r.is_prefilling)
    if decoding:
        assert prefill <= max(cap, len(prefilling))  # never past the configured cap
    if not targets or not prefilling:
        return
    # The shortest step possible: the decode work and one token per prefilling row.
    shortest = plan_step(rows, 1)
    if _planned_s(rows, shortest, cost) <= min(targets):
        assert _planned_s(rows, plan, cost) <= min(targets) * (1 + 1e-9)
    else:  # the target was broken at admission: the step is the shortest one
        assert plan == shortest


@settings(max_examples=500, deadline=None)
@given(rows=targeted_rows, cap=st.integers(1, 1024), cost=costs)
def test_while_no_row_decodes_a_joiners_wait_is_bounded_by_the_rows_tightest_target(rows, cap, cost):
    """The step a joiner arriving now waits for: within twice the prompts' tightest TPOT target where any step
    could be, at most the cap; the prompts whole where none states a target."""
    prefilling = [dataclasses.replace(r, num_prefilled=min(r.num_prefilled, r.num_prompt_tokens - 1),
                                      num_cached=min(r.num_prefilled, r.num_prompt_tokens - 1)) for r in rows]
    targets = [r.tpot_target_s for r in prefilling if r.tpot_target_s is not None]
    budget = _budget(prefilling, cap, cost)
    plan = plan_step(prefilling, budget)
    if not targets:
        assert budget is None and plan == [(r.row_id, r.num_remaining) for r in prefilling]
        return
    assert sum(n for _, n in plan) <= max(cap, len(prefilling))
    shortest = plan_step(prefilling, 1)
    limit = idle_step_limit_s(min(targets))
    assert limit == MAX_STEP_STRETCH * min(targets)
    if _planned_s(prefilling, shortest, cost) <= limit:
        assert _planned_s(prefilling, plan, cost) <= limit * (1 + 1e-9)
    else:  # one token per prompt is already past it: the shortest step
        assert plan == shortest


def test_a_long_prompt_alone_runs_in_steps_a_joiner_can_join_between():
    cost = StepCost(decode_s_per_token=0.02, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e12)
    long = RowProgress(0, 4000, 0, 0, tpot_target_s=0.1)
    # Twice the 0.1 s target, less the step's 0.02 s pass over the weights, buys 180 prompt tokens at 1 ms each:
    # a 4,000-token prompt goes in 23 steps of at most 0.2 s, not one of 4 s.
    assert _budget([long], 256, cost) == 180
    assert plan_step([long], 180) == [(0, 180)]
    assert _budget([long], 100, cost) == 100  # never past the cap
    assert _budget([dataclasses.replace(long, tpot_target_s=None)], 256, cost) is None  # nobody bounds it: whole


@settings(max_examples=200, deadline=None)
@given(rows=targeted_rows, cap=st.integers(1, 512), cost=costs)
def test_with_targets_every_prompt_still_finishes(rows, cap, cost):
    state = {r.row_id: r for r in rows}
    for _ in range(10_000):
        current = list(state.values())
        if not any(r.is_prefilling for r in current):
            return
        for row_id, n in plan_step(current, _budget(current, cap, cost)):
            r = state[row_id]
            state[row_id] = RowProgress(r.row_id, r.num_prompt_tokens, min(r.num_prompt_tokens, r.num_prefilled + n),
                                        r.num_cached + n, r.tpot_target_s)
    raise AssertionError("a prompt never finished")


def test_a_long_prompts_later_chunks_shrink_as_what_they_attend_to_grows():
    # SmolLM2's fit on 2 threads (configs/serve.yaml): a 1,024-token prompt's attention is a third of its time.
    cost = StepCost(decode_s_per_token=0.0118, batch_row_cost=0.046, prefill_tokens_per_s=1408.0,
                    kv_read_bytes_per_s=1.86e10, attention_pairs_per_s=1.53e6)
    flat = dataclasses.replace(cost, attention_pairs_per_s=float("inf"))
    decoding = RowProgress(0, 100, 100, 150, tpot_target_s=0.1, max_step_s=0.2)
    first, late = RowProgress(1, 4000, 0, 0), RowProgress(1, 4000, 3000, 3000)
    # The flat price gives any chunk of the prompt the same ~260 tokens; priced, a chunk after 3,000 cached
    # positions computes ~3,000 pairs a token more than the first and gets about a quarter of the first's tokens.
    assert abs(_budget([decoding, first], 1024, flat) - _budget([decoding, late], 1024, flat)) <= 1  # KV reads
    first_budget, late_budget = _budget([decoding, first], 1024, cost), _budget([decoding, late], 1024, cost)
    assert late_budget < first_budget / 2
    for rows, budget in (([decoding, first], first_budget), ([decoding, late], late_budget)):
        assert _planned_s(rows, plan_step(rows, budget), cost) <= 0.2  # within the decoding row's limit
        assert _planned_s(rows, plan_step(rows, budget + 1), cost) > 0.2  # and the largest that is


def test_a_tight_target_shrinks_the_chunk_and_no_target_leaves_the_cap():
    cost = StepCost(decode_s_per_token=0.02, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e12)
    decoding = RowProgress(0, 10, 10, 10, tpot_target_s=0.07)
    joiner = RowProgress(1, 600, 0, 0)
    # A step of both rows' one token each is 0.02 s; the 0.05 s left buys 49 prompt tokens more at 1 ms
    # each (the KV term is ~0 here, and just short of the 50th).
    assert _budget([decoding, joiner], 256, cost) == 50
    assert plan_step([decoding, joiner], 50) == [(0, 1), (1, 50)]
    loose = RowProgress(0, 10, 10, 10, tpot_target_s=None)
    assert _budget([loose, joiner], 256, cost) == 256
    broken = RowProgress(0, 10, 10, 10, tpot_target_s=0.01)  # below the decode work alone
    assert _budget([broken, joiner, RowProgress(2, 5, 0, 0)], 256, cost) == 2  # one token per prefilling row


# ---- slack: a TPOT target bounds a row's mean time per token, not each step

def test_a_rows_step_limit_is_its_target_plus_the_slack_its_faster_steps_left_at_most_twice_the_target():
    assert max_step_s(None, 5, 1.0) is None
    assert max_step_s(0.2, 1, 0.05) == pytest.approx(0.15)  # first token 50 ms ago: the gap counts already
    assert max_step_s(0.2, 5, 0.6) == pytest.approx(0.2 + 0.9 * 0.2)  # 4 steps of 0.15 s: 0.2 s of slack
    assert max_step_s(0.2, 50, 5.0) == pytest.approx(MAX_STEP_STRETCH * 0.2)  # more slack than one step may spend
    assert max_step_s(0.2, 5, 1.2) == pytest.approx(-0.2)  # behind its target: the shortest step possible


@settings(max_examples=300, deadline=None)
@given(target=st.floats(0.01, 1.0), steps=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=60),
       decode_share=st.floats(0.05, 1.0))
def test_steps_planned_within_the_limit_keep_every_rows_mean_time_per_token_within_its_target(
        target, steps, decode_share):
    # Each step takes what the scheduler allows it (a share `pressure` of the limit, as prefill work fills
    # it), never less than the decode work itself (decode_share * target): the mean stays within the target.
    elapsed, n = 0.0, 1
    for pressure in steps:
        limit = max_step_s(target, n, elapsed)
        decode_s = decode_share * target
        step = decode_s if limit <= decode_s else decode_s + pressure * (limit - decode_s)
        assert step <= MAX_STEP_STRETCH * target + 1e-12
        elapsed, n = elapsed + step, n + 1
        assert elapsed / (n - 1) <= target * (1 + 1e-9)


def test_a_decoding_row_with_slack_lets_a_joiner_take_a_larger_chunk():
    cost = StepCost(decode_s_per_token=0.02, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e12)
    joiner = RowProgress(1, 600, 0, 0)
    fresh = RowProgress(0, 10, 10, 10, tpot_target_s=0.07, max_step_s=0.07)
    rested = RowProgress(0, 10, 10, 10, tpot_target_s=0.07, max_step_s=0.14)  # its steps ran at 20 ms
    assert _budget([fresh, joiner], 256, cost) == 50
    assert _budget([rested, joiner], 256, cost) == 120  # 0.12 s left beyond the 20 ms decode step


# ---- a prompt's first token due: the TTFT target the ingress admitted it with

def _broken_batch():
    """A decoding row already past its TPOT target (a busy host): the TPOT bound alone gives a joiner one token a
    step. The cost: 20 ms a step, 1 ms a further prompt token, KV reads ~free."""
    cost = StepCost(decode_s_per_token=0.02, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e15)
    return cost, RowProgress(0, 10, 10, 10, tpot_target_s=0.07, max_step_s=-0.1)


def test_an_overdue_prompt_runs_whole_beside_rows_past_their_target():
    cost, decoding = _broken_batch()
    joiner = RowProgress(1, 150, 0, 0)
    assert _budget([decoding, joiner], 256, cost) == 1  # no due: one token a step, the batch's end its first token
    assert _budget([decoding, dataclasses.replace(joiner, first_token_in_s=0.0)], 256, cost) == 150
    assert _budget([decoding, dataclasses.replace(joiner, first_token_in_s=-1.0)], 100, cost) == 100  # the cap holds


def test_a_prompt_due_later_is_spread_over_the_steps_that_fit_before_it_is_due():
    cost, decoding = _broken_batch()
    # 600 tokens cost 0.6 s; the 0.41 s left fit 20 steps of 20 ms: 30 tokens a step.
    joiner = RowProgress(1, 600, 0, 0, first_token_in_s=1.01)
    assert _budget([decoding, joiner], 256, cost) == 30
    # Rows that accept more than the due needs keep their larger chunk.
    rested = dataclasses.replace(decoding, max_step_s=0.14)
    assert _budget([rested, joiner], 256, cost) == 120
    # Two prompts: the one due later counts the tokens of the one due first.
    first = RowProgress(2, 100, 0, 0, first_token_in_s=0.51)  # (0.51 - 0.1) / 0.02: 20 steps, 5 tokens a step
    later = RowProgress(1, 600, 0, 0, first_token_in_s=1.11)  # (1.11 - 0.7) / 0.02: 20 steps, 700 / 20 = 35
    assert _budget([decoding, later, first], 256, cost) == 35


def test_a_prompt_plans_its_first_token_a_share_of_the_way_to_its_due_fixed_when_it_joins():
    assert PACE_SHARE == 0.5
    assert paced_due(100.0, 101.0) == 100.5  # a 1 s target: planned for half a second after joining
    assert paced_due(100.0, 99.0) == 100.0  # already past: at once


@settings(max_examples=300, deadline=None)
@given(rows=targeted_rows, n=st.integers(1, 2000), slack=st.floats(0.0, 5.0), cost=costs)
def test_a_prompt_that_can_be_done_by_its_due_is_whatever_the_decoding_rows_targets(rows, n, slack, cost):
    """Steps run as predicted: a joiner whose whole prompt in one step beside the batch would be done by its due
    is done by it, however tight (or broken) the decoding rows' targets, in steps planned one at a time."""
    cost = dataclasses.replace(cost, kv_read_bytes_per_s=1e15)  # no KV growth between steps: each as planned
    decoding = [dataclasses.replace(r, num_prefilled=r.num_prompt_tokens) for r in rows]
    whole = _planned_s([*decoding, RowProgress(99, n, 0, 0)], [*[(r.row_id, 1) for r in decoding], (99, n)], cost)
    due = whole * (1 + slack)
    state = [*decoding, RowProgress(99, n, 0, 0, first_token_in_s=due)]
    elapsed = 0.0
    for _ in range(n):
        plan = plan_step(state, _budget(state, n, cost))
        elapsed += _planned_s(state, plan, cost)
        joiner, chunk = state[-1], plan[-1][1]
        state[-1] = dataclasses.replace(joiner, num_prefilled=joiner.num_prefilled + chunk,
                                        num_cached=joiner.num_cached + chunk, first_token_in_s=due - elapsed)
        if not state[-1].is_prefilling:
            break
    assert not state[-1].is_prefilling
    assert elapsed <= due * (1 + 1e-9) + 1e-12


@settings(max_examples=300, deadline=None)
@given(rows=targeted_rows, cap=st.integers(1, 1024), cost=costs, due=st.floats(-1.0, 10.0))
def test_a_due_never_shrinks_a_steps_prefill_nor_passes_the_cap(rows, cap, cost, due):
    with_due = [dataclasses.replace(r, first_token_in_s=due) if r.is_prefilling else r for r in rows]
    budget, plain = _budget(with_due, cap, cost), _budget(rows, cap, cost)
    if plain is None:  # nobody bounds the step: the prompts whole, due or not
        assert budget is None
        return
    assert plain <= budget <= max(cap, sum(r.is_prefilling for r in rows), 1)
