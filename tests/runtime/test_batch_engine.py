"""The batched engine: a row's output in a batch is its output alone, rows join and leave at any step.

A real tiny checkpoint (its tokenizer, chat template and stop handling), fp32, with weights
re-drawn at a larger std so that greedy choices are far from ties.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from actors import engine as engine_module
from actors.checkpoint import load_hf_checkpoint
from actors.engine import Engine
from actors.events import BatchFullError, FinishEvent, StartEvent, TokenEvent
from actors.sampling import SamplingParams
from actors.scheduler import RowProgress, plan_step
from actors.step_cost import StepCost
from actors.tokenizer import Message, Tokenizer
from weights_tool.synth import synthesize

PROMPTS = ["Hi", "Tell me about queues, please, in some detail.", "Why do tails matter?",
           "A much longer prompt that keeps going about serving systems, batching, memory and the tail "
           "latency that every user of an interactive product sees when one request waits behind another."]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = synthesize("tiny", tmp_path_factory.mktemp("tiny"), dtype="float32", seed=3)
    model, config = load_hf_checkpoint(path)
    torch.manual_seed(0)
    model.init_weights(std=0.15)
    return model, Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids)


def make_engine(parts, max_batch=8, prefill_chunk_tokens=256) -> Engine:
    model, tokenizer = parts
    engine = Engine(model, tokenizer, max_batch=max_batch, prefill_chunk_tokens=prefill_chunk_tokens)
    engine.eos_token_ids = frozenset()  # every row runs to max_tokens: the test decides when rows leave
    return engine


def prompt_ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([Message("user", text)])


def alone(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [e.token_id for e in engine.generate(prompt, params) if isinstance(e, TokenEvent)]


class Recorder:
    """One row's events, as the engine delivers them."""

    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, event) -> None:
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEvent)]

    @property
    def finish(self) -> FinishEvent | None:
        done = [e for e in self.events if isinstance(e, FinishEvent)]
        assert len(done) <= 1
        return done[0] if done else None


def run_schedule(engine: Engine, joins: dict[int, list[tuple[list[int], SamplingParams]]],
                 cancels: dict[int, list[int]] | None = None) -> list[Recorder]:
    """Step the engine; at step s, add the rows `joins[s]` and cancel the rows `cancels[s]` (by add order)."""
    recorders: list[Recorder] = []
    rows = []
    step = 0
    while step <= max(joins) or engine.has_work:
        for prompt, params in joins.get(step, []):
            rec = Recorder()
            rows.append(engine.add(prompt, params, rec))
            recorders.append(rec)
        for i in (cancels or {}).get(step, []):
            engine.cancel(rows[i])
        engine.step()
        step += 1
        assert step < 10_000
    return recorders


def join_and_leave_tokens(model, tokenizer: Tokenizer, compiled=None, **engine_kw) -> list[list[int]]:
    """Greedy tokens of PROMPTS on `model` in one batch: rows of different prompt lengths join at different steps
    (prompts chunked by 7) and leave at different steps (each runs to its own max_tokens, 32 or more). `compiled`:
    the engine's compiled step (actors/compiled_step.py), None: eager; `engine_kw`: the Engine's other settings."""
    return alone_and_batched(model, tokenizer, is_alone_run=False, compiled=compiled, **engine_kw)[1]


def alone_and_batched(model, tokenizer: Tokenizer, is_alone_run: bool = True,
                      **engine_kw) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of PROMPTS on one engine: each request alone (where `is_alone_run`, else []), then all of them
    in join_and_leave_tokens' batch."""
    engine = Engine(model, tokenizer, max_batch=8, prefill_chunk_tokens=7, **engine_kw)
    engine.eos_token_ids = frozenset()  # every row runs to max_tokens: the schedule decides who leaves
    requests = [(tokenizer.encode_chat([Message("user", p)]), SamplingParams(max_tokens=n, temperature=0.0))
                for p, n in zip(PROMPTS, (32, 40, 33, 36), strict=True)]
    alone = [run_schedule(engine, {0: [r]})[0].tokens for r in requests] if is_alone_run else []
    batched = [r.tokens for r in run_schedule(engine, {0: requests[:2], 3: [requests[2]], 11: [requests[3]]})]
    return alone, batched


@pytest.mark.parametrize("chunk", [256, 5])
def test_greedy_tokens_in_a_batch_equal_each_request_alone(parts, chunk):
    engine = make_engine(parts, prefill_chunk_tokens=chunk)
    requests = [(prompt_ids(engine, p), SamplingParams(max_tokens=n, temperature=0.0))
                for p, n in zip(PROMPTS, (32, 40, 33, 36), strict=True)]
    expected = [alone(engine, p, s) for p, s in requests]
    # Rows of different prompt lengths join at different steps and leave at different steps.
    recorders = run_schedule(engine, {0: requests[:2], 3: [requests[2]], 11: [requests[3]]})
    for rec, want, (_, params) in zip(recorders, expected, requests, strict=True):
        assert rec.tokens == want
        assert len(want) == params.max_tokens >= 32
        assert rec.finish.stop_reason == "max_tokens"
    assert not engine.has_work and engine.kv_bytes() == 0


def test_same_seed_samples_the_same_in_a_batch_as_alone(parts):
    engine = make_engine(parts)
    a = (prompt_ids(engine, PROMPTS[1]), SamplingParams(max_tokens=32, temperature=1.0, top_p=0.9, seed=11))
    b = (prompt_ids(engine, PROMPTS[2]), SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=12))
    expected = [alone(engine, *a), alone(engine, *b)]
    recorders = run_schedule(engine, {0: [a], 2: [b]})
    assert [r.tokens for r in recorders] == expected
    assert expected[0] != alone(engine, a[0], SamplingParams(max_tokens=32, temperature=1.0, top_p=0.9, seed=13))


def test_greedy_rows_sampled_together_and_rows_sampled_alone_each_get_their_tokens_alone(parts):
    # The greedy rows of a step take one argmax together (Engine._sample); a seeded sampled row and a greedy row
    # short of its min_tokens sample one by one beside them, in between them in the batch's order.
    engine = make_engine(parts)
    requests = [(prompt_ids(engine, p), params) for p, params in zip(PROMPTS, (
        SamplingParams(max_tokens=32, temperature=0.0),
        SamplingParams(max_tokens=34, temperature=1.0, seed=5),
        SamplingParams(max_tokens=33, temperature=0.0, min_tokens=8),
        SamplingParams(max_tokens=32, temperature=0.0)), strict=True)]
    expected = [alone(engine, p, s) for p, s in requests]
    recorders = run_schedule(engine, {0: requests[:2], 2: requests[2:]})
    assert [r.tokens for r in recorders] == expected


def test_cancelling_one_row_stops_it_within_a_step_and_no_other(parts):
    engine = make_engine(parts)
    requests = [(prompt_ids(engine, p), SamplingParams(max_tokens=32, temperature=0.0)) for p in PROMPTS[:3]]
    expected = [alone(engine, p, s) for p, s in requests]
    recorders = run_schedule(engine, {0: requests}, cancels={6: [1]})
    cancelled = recorders[1]
    assert cancelled.finish.stop_reason == "cancelled"
    # Step 6 is where the cancel lands: rows sampled one token in each of steps 0..5.
    assert cancelled.tokens == expected[1][:6] and cancelled.finish.output_tokens == 6
    assert recorders[0].tokens == expected[0] and recorders[2].tokens == expected[2]


def test_every_row_gets_one_start_then_tokens_then_one_finish(parts):
    engine = make_engine(parts, prefill_chunk_tokens=3)
    reqs = [(prompt_ids(engine, p), SamplingParams(max_tokens=5, temperature=0.0)) for p in PROMPTS]
    for rec in run_schedule(engine, {0: reqs[:2], 1: reqs[2:]}):
        kinds = [type(e) for e in rec.events]
        assert kinds == [StartEvent] + [TokenEvent] * 5 + [FinishEvent]
        start, finish = rec.events[0], rec.events[-1]
        assert finish.compute_start == start.time <= finish.first_token_time <= finish.last_token_time
        assert [e.num_output_tokens for e in rec.events[1:-1]] == [1, 2, 3, 4, 5]


def test_kv_memory_is_each_rows_own_size_and_is_freed_before_its_finish_is_heard(parts):
    engine = make_engine(parts)
    config = engine.model.config
    per_token = config.kv_bytes_per_token("float32")
    seen: list[tuple[str, int]] = []

    def watcher(name):
        def emit(event):
            if isinstance(event, (StartEvent, FinishEvent)):
                seen.append((name, engine.kv_bytes()))
        return emit

    p1, p2 = prompt_ids(engine, PROMPTS[0]), prompt_ids(engine, PROMPTS[3])
    engine.add(p1, SamplingParams(max_tokens=4, temperature=0.0), watcher("a"))
    engine.add(p2, SamplingParams(max_tokens=9, temperature=0.0), watcher("b"))
    engine.step()
    assert engine.kv_bytes() == per_token * ((len(p1) + 4) + (len(p2) + 9))
    while engine.has_work:
        engine.step()
    # a's finish was delivered after its cache left the batch: only b's was still there.
    assert seen[-2] == ("a", per_token * (len(p2) + 9)) and seen[-1] == ("b", 0)


def test_a_full_batch_refuses_at_once_and_a_cancelled_row_frees_its_place(parts):
    engine = make_engine(parts, max_batch=2)
    prompt = prompt_ids(engine, PROMPTS[0])
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = engine.add(prompt, params, Recorder())
    engine.add(prompt, params, Recorder())
    with pytest.raises(BatchFullError):
        engine.add(prompt, params, Recorder())
    engine.cancel(first)
    engine.add(prompt, params, Recorder())  # the cancelled row leaves at the next boundary
    engine.step()
    assert len(engine._rows) == 2
    while engine.has_work:
        engine.step()


def test_a_failing_step_ends_every_row_with_the_error(parts, monkeypatch):
    engine = make_engine(parts)
    recs = [Recorder(), Recorder()]
    for rec in recs:
        engine.add(prompt_ids(engine, PROMPTS[0]), SamplingParams(max_tokens=4), rec)

    def broken(*args, **kwargs):
        raise OSError("frame 3: checksum mismatch")

    monkeypatch.setattr(engine.model, "forward_rows", broken)
    with pytest.raises(OSError) as e:
        engine.step()
    engine.fail_all(e.value)
    assert [type(r.events[-1]) for r in recs] == [OSError, OSError]
    assert not engine.has_work


def test_the_step_clock_gives_each_row_the_steps_it_ran_in_and_their_rows(parts, monkeypatch):
    # Every step lasts 0.25 s by the clock: what is checked is which steps count for which row.
    monkeypatch.setattr(engine_module._StepClock, "seconds", lambda self: 0.25)
    engine = make_engine(parts)
    first, second = Recorder(), Recorder()
    engine.add(prompt_ids(engine, PROMPTS[0]), SamplingParams(max_tokens=6, temperature=0.0), first)
    engine.step()  # a alone: its prompt whole, its first token
    engine.step()
    engine.add(prompt_ids(engine, PROMPTS[1]), SamplingParams(max_tokens=2, temperature=0.0), second)
    while engine.has_work:
        engine.step()
    done_a, done_b = first.events[-1], second.events[-1]
    assert isinstance(done_a, FinishEvent) and isinstance(done_b, FinishEvent)
    # a: 6 steps (one a token each), b joined for 2 of them; b: those 2 steps, both with a.
    assert (done_a.num_steps, done_a.num_step_rows, done_a.engine_s) == (6, 6 + 2, 6 * 0.25)
    assert (done_b.num_steps, done_b.num_step_rows, done_b.engine_s) == (2, 4, 2 * 0.25)


def test_each_row_sums_the_threads_its_steps_computed_on(parts):
    """The governor may change torch's threads between steps: a row counts each step's own."""
    engine = make_engine(parts)
    rec = Recorder()
    engine.add(prompt_ids(engine, PROMPTS[0]), SamplingParams(max_tokens=4, temperature=0.0), rec)
    threads = [1, 2, 2, 1]
    try:
        for n in threads:
            torch.set_num_threads(n)
            engine.step()
    finally:
        torch.set_num_threads(1)  # this module's tests compute on one thread (conftest)
    done = rec.events[-1]
    assert isinstance(done, FinishEvent) and done.num_steps == 4 and done.num_step_threads == sum(threads)


def test_a_steps_prediction_counts_its_prompt_chunks_attention_and_the_check_sees_it(parts):
    # A chunk of 30 prompt tokens after 20 cached ones computes 30 * 20 + 30 * 29 / 2 (query, key) pairs; a row
    # decoding beside it reads its cache (the KV term) and adds none.
    cost = StepCost(decode_s_per_token=0.01, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e15, attention_pairs_per_s=1e5)
    engine = Engine(*parts, max_batch=4, prefill_chunk_tokens=256, step_cost=cost)
    prefilling, decoding = RowProgress(0, 80, 20, 20), RowProgress(1, 5, 5, 12)
    unpriced = Engine(*parts, max_batch=4, prefill_chunk_tokens=256,
                      step_cost=dataclasses.replace(cost, attention_pairs_per_s=math.inf))
    plan = [(0, 30), (1, 1)]
    extra = engine._predict([prefilling, decoding], plan) - unpriced._predict([prefilling, decoding], plan)
    assert extra == pytest.approx((30 * 20 + 30 * 29 // 2) / 1e5)


def test_a_decoding_rows_target_buys_a_late_chunk_fewer_tokens_once_its_attention_is_priced(parts):
    # The decoding row accepts 0.1 s steps; a step costs 10 ms, 1 ms a prompt token and 10 us per (query, key)
    # pair. Unpriced, the budget is ~90 tokens wherever the prompt stands; priced, a chunk after 20 cached positions
    # gets ~61 (its tokens and 0.2 ms of pairs each, a fifth of its cost), one after 400 only ~16.
    cost = StepCost(decode_s_per_token=0.01, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e15, attention_pairs_per_s=1e5)
    priced = Engine(*parts, max_batch=4, prefill_chunk_tokens=256, step_cost=cost)
    unpriced = Engine(*parts, max_batch=4, prefill_chunk_tokens=256,
                      step_cost=dataclasses.replace(cost, attention_pairs_per_s=math.inf))
    decoding = RowProgress(1, 5, 5, 12, tpot_target_s=0.1, max_step_s=0.1)
    early, late = ([RowProgress(0, 800, n, n), decoding] for n in (20, 400))
    assert unpriced._prefill_budget(early) == unpriced._prefill_budget(late) == 90
    assert 16 <= priced._prefill_budget(late) < priced._prefill_budget(early) < 90
    for rows in (early, late):  # and the largest within the limit
        budget = priced._prefill_budget(rows)
        assert priced._predict(rows, plan_step(rows, budget)) <= 0.1 < priced._predict(rows, plan_step(rows, budget + 1))


def test_a_decoding_rows_tpot_target_chunks_a_joiners_prompt_finer_and_tokens_stay_the_same(parts, monkeypatch):
    # The rule prices a step at 10 ms of decode plus 1 ms per prompt token (KV reads ~free), and the
    # clock agrees with it exactly, so the correction stays 1 and the budget is the rule's.
    cost = StepCost(decode_s_per_token=0.01, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e15)
    reference = make_engine(parts)
    long_prompt = prompt_ids(reference, PROMPTS[3]) * 3  # ~350 tokens: two chunks at the cap
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = alone(reference, long_prompt, params)
    engine = Engine(*parts, max_batch=4, prefill_chunk_tokens=256, step_cost=cost)
    engine.eos_token_ids = frozenset()
    chunks: list[int] = []
    real_step = engine.step

    def step(wait_layer=None):  # what the joiner prefilled in each step
        before = joiner.num_prefilled if joiner is not None else 0
        real_step(wait_layer)
        if joiner is not None and before < len(long_prompt):
            chunks.append(joiner.num_prefilled - before)

    joiner = None
    monkeypatch.setattr(engine, "step", step)
    predicted: list[float] = []
    real_predict = engine._predict
    monkeypatch.setattr(engine, "_predict", lambda *a: predicted.append(real_predict(*a)) or predicted[-1])
    monkeypatch.setattr(engine_module._StepClock, "seconds", lambda self: predicted[-1])
    running, joined = Recorder(), Recorder()
    # A decoding row that accepts 40 ms steps: 10 ms of decode leaves 30 prompt tokens a step.
    engine.add(prompt_ids(engine, PROMPTS[0]), SamplingParams(max_tokens=60, temperature=0.0), running,
               tpot_target_s=0.04)
    engine.step()
    check_at_join = (engine.step_check.correction, engine.step_check.baseline)
    joiner = engine.add(long_prompt, params, joined)
    while engine.has_work:
        engine.step()
    assert joined.tokens == expected  # chunking changes when tokens are computed, not which
    # The joiner's StartEvent tells the router how this actor's steps compare with the rule, now and as a rule.
    start = next(e for e in joined.events if isinstance(e, StartEvent))
    assert (start.step_correction, start.step_baseline) == check_at_join
    # At most 30 prompt tokens a step, give or take the one that a step's rounding below its 40 ms leaves as
    # slack for the next (actors/scheduler.py: the target bounds the row's mean time per token).
    assert max(chunks) <= 31 and sum(chunks) == len(long_prompt) and len(chunks) >= len(long_prompt) // 31
    done = running.finish
    assert done.predicted_step_s > 0 and done.checked_step_s == pytest.approx(done.predicted_step_s)
    assert engine.step_check.num_steps >= len(chunks)


def test_compute_density_is_engine_time_over_the_time_in_the_system():
    from actors.messages import Completion, Timings

    timings = Timings(actor_start=0.0, request_arrival=100.0, first_layer_resident=None, embeddings_resident=None,
                      all_layers_resident=None, compute_start=100.5, first_layer_compute_start=100.5,
                      first_token=100.8, last_token=102.0)
    done = Completion("req_1", "max_tokens", None, 10, 8, False, 0, timings, engine_s=1.5, mean_step_rows=3.0)
    assert done.compute_density(100.0) == pytest.approx(0.75)  # waited 0.5 s of its 2 s
    assert done.compute_density(101.999) == 1.0  # another clock's arrival: never above 1
    no_token = dataclasses.replace(timings, first_token=None, last_token=None)
    assert Completion("req_2", "cancelled", None, 10, 0, False, 0, no_token).compute_density(100.0) is None


def test_steps_on_another_thread_count_are_checked_apart(parts, monkeypatch):
    """The governor's count changes a step's time by up to 2x: each count keeps its own correction, the first
    steps on a new count starting from the last count's."""
    engine = make_engine(parts)
    seconds = {1: 0.0, 2: 0.0}
    monkeypatch.setattr(engine_module._StepClock, "seconds", lambda self: seconds[torch.get_num_threads()])
    rule = engine.step_cost.step_s(1, 0, 0, 0)
    seconds |= {1: 4 * rule, 2: 2 * rule}  # both slower than the rule; one thread twice two's time
    params = SamplingParams(max_tokens=200, temperature=0.0)
    engine.add(prompt_ids(engine, PROMPTS[0]), params, Recorder())
    try:
        torch.set_num_threads(2)
        for _ in range(60):
            engine.step()
        on_two = engine.step_check
        torch.set_num_threads(1)
        on_one = engine.step_check
        assert on_one is not on_two and on_one.correction == on_two.correction  # seeded from the last count's
        for _ in range(60):
            engine.step()
        torch.set_num_threads(2)
        assert engine.step_check is on_two
    finally:
        torch.set_num_threads(1)  # this module's tests compute on one thread (conftest)
    assert on_one.correction > 1.5 * on_two.correction > 1.5


def test_a_joiners_due_first_token_is_fed_beside_rows_past_their_target_and_tokens_stay_the_same(parts):
    # A decoding row whose 1 ms TPOT target no step can keep (a busy host, steps slower than the router priced):
    # its bound alone feeds a joiner one prompt token a step, so the joiner's first token would wait for the row to
    # end. A joiner whose TTFT target is already spent gets its prompt whole, at the cap a step, instead.
    cost = StepCost(decode_s_per_token=0.01, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e15)
    reference = make_engine(parts)
    long_prompt = prompt_ids(reference, PROMPTS[3]) * 3  # ~350 tokens: two steps at the cap of 256
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = alone(reference, long_prompt, params)
    prefilled = {}
    for name, due in (("no due", None), ("overdue", time.time() - 1.0)):
        engine = Engine(*parts, max_batch=4, prefill_chunk_tokens=256, step_cost=cost)
        engine.eos_token_ids = frozenset()
        engine.add(prompt_ids(engine, PROMPTS[0]), SamplingParams(max_tokens=200, temperature=0.0), Recorder(),
                   tpot_target_s=0.001)
        engine.step()
        joined = Recorder()
        joiner = engine.add(long_prompt, params, joined, first_token_due=due)
        engine.step()
        engine.step()
        prefilled[name] = joiner.num_prefilled
        if due is not None:
            while joiner.num_out < params.max_tokens:
                engine.step()
            assert joined.tokens == expected  # the chunks change when tokens are computed, not which
    assert prefilled == {"no due": 2, "overdue": len(long_prompt)}


def test_a_long_prompt_alone_is_chunked_by_its_target_so_a_joiner_answers_first_and_a_cold_step_runs_it_whole(
        parts, monkeypatch):
    # The rule prices a step at 10 ms of decode plus 1 ms per prompt token, and the clock agrees with it exactly
    # (the correction stays 1): with a 20 ms TPOT target, a step while nobody decodes may take twice that, 40 ms,
    # which is the weights' 10 ms and 30 prompt tokens more, 31 in all.
    cost = StepCost(decode_s_per_token=0.01, batch_row_cost=0.0, prefill_tokens_per_s=1000.0,
                    kv_read_bytes_per_s=1e15)
    reference = make_engine(parts)
    long_prompt = prompt_ids(reference, PROMPTS[3]) * 3  # ~350 tokens
    short_prompt = prompt_ids(reference, PROMPTS[0])
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected_long, expected_short = alone(reference, long_prompt, params), alone(reference, short_prompt, params)
    engine = Engine(*parts, max_batch=4, prefill_chunk_tokens=256, step_cost=cost)
    engine.eos_token_ids = frozenset()
    predicted: list[float] = []
    real_predict = engine._predict
    monkeypatch.setattr(engine, "_predict", lambda *a: predicted.append(real_predict(*a)) or predicted[-1])
    monkeypatch.setattr(engine_module._StepClock, "seconds", lambda self: predicted[-1])
    order: list[str] = []  # whose token came, in the order the engine delivered them
    long_rec, short_rec = Recorder(), Recorder()

    def tagged(name, recorder):
        return lambda event: (order.append(name) if isinstance(event, TokenEvent) else None, recorder(event))

    long_row = engine.add(long_prompt, params, tagged("long", long_rec), tpot_target_s=0.02)
    engine.step()
    assert 1 < long_row.num_prefilled <= 31  # one bounded chunk (the KV term, ~0, can take one off), not all
    engine.add(short_prompt, params, tagged("short", short_rec), tpot_target_s=0.02)  # joins at the boundary
    while engine.has_work:
        engine.step()
    assert max(predicted) <= 0.04 + 1e-9  # no step was planned past twice the target
    assert order.index("short") < order.index("long")  # the joiner was not held behind the long prompt
    assert (long_rec.tokens, short_rec.tokens) == (expected_long, expected_short)  # chunks change when, not what
    # A cold actor's step (its weights gated layer by layer) runs the prompt whole: layer i computes once resident.
    cold = engine.add(long_prompt, params, Recorder(), tpot_target_s=0.02)
    engine.step(wait_layer=lambda layer: None)
    assert cold.num_prefilled == len(long_prompt)
