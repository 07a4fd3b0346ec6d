"""The generation API on a real (tiny, random-weight) checkpoint: seeds, stops, usage, cancel."""

from __future__ import annotations

import pytest

from actors.chat import ContextWindowError, GenerationRequest
from actors.checkpoint import load_hf_checkpoint
from actors.engine import Engine
from actors.events import FinishEvent, TokenEvent
from actors.sampling import SamplingParams
from actors.tokenizer import Message, Tokenizer
from weights_tool.synth import synthesize


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = synthesize("tiny", tmp_path_factory.mktemp("tiny"), dtype="float32", seed=3)
    model, config = load_hf_checkpoint(path)
    return Engine(model, Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids))


def _request(**sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=(Message("user", "Tell me about queues, please."),),
        system="You are terse.",
        sampling=SamplingParams(**sampling),
    )


def _run(engine: Engine, request: GenerationRequest, cancel=None) -> tuple[list[TokenEvent], FinishEvent]:
    events = list(engine.generate(engine.prepare(request), request.sampling, cancel=cancel))
    assert isinstance(events[-1], FinishEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def _text(tokens: list[TokenEvent]) -> str:
    return "".join(t.text for t in tokens)


def test_same_seed_same_output_and_other_seed_differs(engine):
    req = _request(max_tokens=24, temperature=1.0, seed=11)
    a, _ = _run(engine, req)
    b, _ = _run(engine, req)
    c, _ = _run(engine, _request(max_tokens=24, temperature=1.0, seed=12))
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert [t.token_id for t in a] != [t.token_id for t in c]


def test_max_tokens_and_usage(engine):
    req = _request(max_tokens=9, temperature=0.0)
    tokens, finish = _run(engine, req)
    assert finish.stop_reason == "max_tokens" and finish.stop_sequence is None
    assert finish.output_tokens == len(tokens) == 9
    assert finish.input_tokens == len(engine.prepare(req))
    assert [t.num_output_tokens for t in tokens] == list(range(1, 10))
    times = [t.time for t in tokens]
    assert times == sorted(times) and finish.first_token_time == times[0] and finish.last_token_time == times[-1]
    assert finish.compute_start <= finish.first_token_time


def test_stop_sequence_cuts_exactly(engine):
    full, _ = _run(engine, _request(max_tokens=40, temperature=0.0))
    text = _text(full)
    assert len(text) > 12, text
    stop = text[6:9]
    cut = text[: text.index(stop)]
    tokens, finish = _run(engine, _request(max_tokens=40, temperature=0.0, stop_sequences=("zzzz-never", stop)))
    assert _text(tokens) == cut
    assert finish.stop_reason == "stop_sequence" and finish.stop_sequence == stop
    assert finish.output_tokens == len(tokens) < 40


def test_end_turn_on_eos(engine):
    req = _request(max_tokens=20, temperature=0.0)
    first = _run(engine, req)[0][0].token_id
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({first})
    try:
        tokens, finish = _run(engine, req)
    finally:
        engine.eos_token_ids = saved
    assert finish.stop_reason == "end_turn" and finish.output_tokens == 1 == len(tokens)


def test_min_tokens_keeps_the_end_of_turn_out_and_ignore_eos_runs_to_max_tokens(engine):
    first = _run(engine, _request(max_tokens=1, temperature=0.0))[0][0].token_id
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({first})  # greedy decoding now ends the turn at once
    try:
        assert _run(engine, _request(max_tokens=8, temperature=0.0))[1].output_tokens == 1
        # min_tokens: the end of turn is masked out of the first 3 samples, then it may end the turn.
        tokens, finish = _run(engine, _request(max_tokens=8, temperature=0.0, min_tokens=3))
        assert first not in [t.token_id for t in tokens[:3]] and finish.output_tokens >= 3
        # ignore_eos: the end-of-turn token is sampled, and the row goes on to its limit.
        tokens, finish = _run(engine, _request(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert tokens[0].token_id == first
        assert (finish.stop_reason, finish.output_tokens) == ("max_tokens", 8)
    finally:
        engine.eos_token_ids = saved


def test_cancel_stops_between_steps(engine):
    seen = []
    req = _request(max_tokens=200, temperature=0.0)
    for event in engine.generate(engine.prepare(req), req.sampling, cancel=lambda: len(seen) >= 3):
        seen.append(event)
    finish = seen[-1]
    assert finish.stop_reason == "cancelled" and finish.output_tokens == 3


def test_prompt_beyond_context_window_is_refused_before_compute(engine, monkeypatch):
    def no_compute(*args, **kwargs):
        raise AssertionError("prefill ran for a request that must be refused")

    monkeypatch.setattr(engine.model, "prefill", no_compute)
    window = engine.max_context
    long_text = "queue " * window
    req = GenerationRequest((Message("user", long_text),), SamplingParams(max_tokens=1))
    with pytest.raises(ContextWindowError, match="context window"):
        engine.prepare(req)
    short = _request(max_tokens=window)
    with pytest.raises(ContextWindowError):
        engine.prepare(short)


def test_kv_cache_is_freed_after_each_request_even_one_abandoned(engine):
    _run(engine, _request(max_tokens=3, temperature=0.0))
    assert not engine.has_work and engine.kv_bytes() == 0
    req = _request(max_tokens=50, temperature=0.0)
    stream = engine.generate(engine.prepare(req), req.sampling)
    next(stream)
    assert engine.kv_bytes() > 0
    stream.close()  # the consumer went away mid-stream: its row must not stay in the batch
    assert not engine.has_work and engine.kv_bytes() == 0
