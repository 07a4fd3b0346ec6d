"""The batch scheduler: every running row advances every step, and a prompt never stalls decoding rows for long."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.scheduler import RowProgress, plan_step

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
def test_while_a_row_decodes_prefill_work_per_step_is_bounded(rows, budget):
    plan = plan_step(rows, budget)
    prefill = [n for r, (_, n) in zip(rows, plan, strict=True) if r.is_prefilling]
    if len(prefill) < len(rows):  # someone is decoding: the step's prompt tokens are bounded
        assert sum(prefill) <= max(budget, len(prefill))
    else:  # nobody waits: whole prompts at once
        assert prefill == [r.num_remaining for r in rows]


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


def test_budget_is_shared_in_join_order_and_leftovers_go_to_the_earliest():
    rows = [RowProgress(0, 10, 10), RowProgress(1, 500, 0), RowProgress(2, 3, 0), RowProgress(3, 500, 100)]
    # share = 256 // 3 = 85; row 2 needs only 3, so 82 + 1 left over go to row 1 first.
    assert plan_step(rows, 256) == [(0, 1), (1, 85 + 83), (2, 3), (3, 85)]
