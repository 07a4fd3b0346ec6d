"""Training the scorer from traces: rows, the hindsight share, and the CLI end to end on synthetic traces."""

from __future__ import annotations

import json
import random

import pytest

from actors.messages import Completion, Timings
from serve_app import train_scorer
from serve_app.policy import Dispatch, Reject, RequestFeatures, Spawn
from serve_app.scorer import RULE_SCORER, Candidate, Prediction
from serve_app.traces import outcome_record, read_traces, trace_record
from serve_app.train_scorer import Sample, hindsight, samples
from serve_app.xgb_scorer import XGBScorer, card_path, load_scorer


def _law(kind: str, input_tokens: int, max_tokens: int, busy: int) -> tuple[float, float]:
    ttft = (3.0 if kind == "cold" else 0.05) + input_tokens * 0.001 * (1 + busy)
    return ttft, ttft + max_tokens * 0.04 * (1 + busy)


def _record(i: int, rng: random.Random, kind: str | None = None) -> dict:
    kind = kind or rng.choice(["hot", "cold"])
    input_tokens, max_tokens, busy = rng.randint(8, 1000), rng.randint(1, 200), rng.randint(0, 2)
    features = RequestFeatures("m", input_tokens, max_tokens, 200_000_000, 12_288, 1000,
                               temperature=rng.choice([0.0, 1.0]))
    candidate = Candidate(kind, "s0", "a" if kind == "hot" else None, 10**9, int(kind == "hot"), 0.0, 0.0, busy)
    decision = (Dispatch("a", "s0", "short", True, 100, candidate, Prediction(0.1, 1.0)) if kind == "hot"
                else Spawn("s0", "short", False, 500, 400, candidate, Prediction(3.0, 4.0)))
    ttft, total = (t * rng.uniform(0.95, 1.05) for t in _law(kind, input_tokens, max_tokens, busy))
    arrival = 1000.0 + i
    timings = Timings(arrival + 0.5, arrival + 0.6, None, None, arrival + 0.6, arrival + 0.6,
                      arrival + ttft, arrival + max(ttft, total))
    done = Completion(f"req_{i}", "max_tokens", None, input_tokens, max_tokens, kind == "cold", 1, timings)
    return trace_record(f"req_{i}", "m", arrival, features, decision,
                        outcome_record(arrival, arrival + 0.001, decision.reserve_bytes, done))


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("traces") / "synthetic.jsonl"
    lines = [json.dumps(_record(i, rng)) for i in range(400)]
    reject = trace_record("req_r", "m", 1.0, RequestFeatures("m", 5, 5, 1, 1, 1), Reject("no_capacity", 1.0, "x"), None)
    incomplete = _record(999, rng) | {"outcome": outcome_record(1.0, 1.1, 5, None, "incomplete")}
    lines += [json.dumps(reject), json.dumps(incomplete), '{"torn": ']
    path.write_text("\n".join(lines) + "\n")
    return path


def test_only_completed_admitted_requests_become_rows(trace_file):
    records = list(read_traces([trace_file]))
    assert len(records) == 402  # the torn line is skipped
    rows = samples(records)
    assert len(rows) == 400 and all(0 < s.ttft_s <= s.total_s for s in rows)
    assert {s.candidate.kind for s in rows} == {"hot", "cold"}


def test_the_split_is_seeded_and_disjoint(trace_file):
    rows = samples(read_traces([trace_file]))
    a, b = train_scorer.split(rows, 0.25, seed=3)
    again, _ = train_scorer.split(rows, 0.25, seed=3)
    assert a == again and len(b) == 100 and not set(map(id, a)) & set(map(id, b))


def _sample(kind: str, ttft: float, input_tokens=100, max_tokens=10) -> Sample:
    return Sample(RequestFeatures("m", input_tokens, max_tokens, 1, 1, 1),
                  Candidate(kind, "s", None, 1, 0, 0.0, 0.0, 0), ttft, ttft + 1)


class _Prefers:
    def __init__(self, kind):
        self.kind = kind

    def predict(self, features, candidates):
        return [Prediction(0.1 if c.kind == self.kind else 1.0, 2.0) for c in candidates]


def test_hindsight_compares_the_ranked_kind_with_the_kind_measured_faster_for_the_shape():
    # Shape (64..255 tokens, 4..15 max_tokens): cold measured faster. Shape with 1000 tokens: hot only.
    measured = [_sample("cold", 0.5), _sample("cold", 0.7), _sample("hot", 2.0), _sample("hot", 0.1, input_tokens=1000)]
    held_out = [_sample("hot", 2.0), _sample("cold", 0.6), _sample("hot", 0.1, input_tokens=1000)]
    assert hindsight(_Prefers("cold"), held_out, measured) == (1.0, 2, 1)
    assert hindsight(_Prefers("hot"), held_out, measured) == (0.0, 2, 1)
    share, compared, left_out = hindsight(_Prefers("hot"), held_out[2:], measured)
    assert compared == 0 and left_out == 1 and share != share  # nothing to compare: NaN


def test_training_writes_a_model_that_loads_and_a_report(trace_file, tmp_path):
    out, report = tmp_path / "scorer.ubj", tmp_path / "eval.md"
    assert train_scorer.main([str(trace_file), "-o", str(out), "--report", str(report), "--seed", "1"]) == 0
    scorer = load_scorer(out)
    assert isinstance(scorer, XGBScorer)
    card = json.loads(card_path(out).read_text())
    held = card["held_out"]
    assert held["num_rows"] == 100 and card["training"]["num_rows"] == 300
    assert held["ttft_s"]["r2"] > 0.9 and held["total_s"]["r2"] > 0.9
    assert held["hindsight_share"] == 1.0  # hot is faster in every shape of this law
    text = report.read_text()
    assert "| ttft_s |" in text and "| total_s |" in text and "Hindsight share" in text
    assert "python -m serve_app.train_scorer" in text
    # Better than the rule on data the rule's constants do not describe.
    rows = samples(read_traces([trace_file]))
    _, held_out = train_scorer.split(rows, 0.25, seed=1)
    rule = train_scorer.evaluate(RULE_SCORER, held_out, rows)["accuracy"]
    assert held["total_s"]["mae"] < rule["total_s"]["mae"]


def test_too_few_rows_is_an_error_not_a_model(tmp_path, trace_file):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(trace_file.read_text().splitlines(keepends=True)[:10]))
    assert train_scorer.main([str(small), "-o", str(tmp_path / "s.ubj")]) == 1
    assert not (tmp_path / "s.ubj").exists()
