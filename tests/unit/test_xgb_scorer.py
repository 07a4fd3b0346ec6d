"""The XGBoost scorer: loading and validation, fallback on damaged or foreign files, and decide() with it."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
import subprocess
import sys

import numpy as np
import pytest
import xgboost as xgb
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.policy import (
    ActorView,
    ClusterSnapshot,
    Dispatch,
    PolicyConfig,
    Reject,
    RequestFeatures,
    SlotView,
    Spawn,
    decide,
)
from serve_app.scorer import RULE_SCORER, Candidate
from serve_app.xgb_scorer import (
    FEATURE_NAMES,
    MAX_ROWS,
    ScorerCard,
    XGBScorer,
    card_path,
    feature_matrix,
    load_scorer,
    save_model,
)
from tests.unit.test_policy import _check_feasible, _scenarios

POLICY = PolicyConfig(short_max_input_tokens=1000, short_max_output_tokens=500, max_hot_short_actors=1,
                      actor_overhead_bytes=0)


def _law(is_cold, utilization, max_tokens):
    """Synthetic truth: a hot actor starts at once but decodes slowly on a busy slot; a cold one takes 2 s."""
    ttft = np.where(is_cold == 1, 2.0, 0.1)
    per_token = np.where(is_cold == 1, 0.01, 0.01 * (1 + 10 * utilization))
    return ttft, ttft + max_tokens * per_token


def _train(names=FEATURE_NAMES, num_targets=2, seed=0):
    rng = np.random.default_rng(seed)
    n = 2000
    x = np.zeros((n, len(names)), dtype=np.float32)
    x[:, 0] = rng.integers(0, 2, n)  # is_cold
    x[:, 2] = rng.choice([0.0, 0.9], n)  # slot_utilization
    x[:, 4] = rng.integers(1, 1000, n)  # input_tokens
    x[:, 5] = rng.integers(1, 200, n)  # max_tokens
    ttft, total = _law(x[:, 0], x[:, 2], x[:, 5])
    y = np.log(np.stack([ttft, total], 1))[:, :num_targets]
    params = {"max_depth": 4, "eta": 0.3, "tree_method": "hist", "nthread": 1}
    return xgb.train(params, xgb.DMatrix(x, y, feature_names=list(names)), 60)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("scorer") / "scorer.ubj"
    save_model(_train(), path, ScorerCard(sha256=""))
    return path


@pytest.fixture(scope="module")
def scorer(model_path):
    s = load_scorer(model_path)
    assert isinstance(s, XGBScorer)
    return s


def _features(input_tokens=100, max_tokens=100, **kw) -> RequestFeatures:
    return RequestFeatures("m", input_tokens, max_tokens, 1000, 1, 0, **kw)


def _candidates(utilization=0.0):
    return [Candidate("hot", "a", "h", 10_000, 1, 0.0, utilization, 1), Candidate("cold", "b", None, 10_000, 0, 0.0, 0.0, 1)]


def _snap(hot_utilization):
    return ClusterSnapshot((SlotView("a", "n", 10_000, 1000, 1, 0.0, hot_utilization), SlotView("b", "n", 10_000, 0, 0)),
                           (ActorView("h", "m", "a", "idle", "short", True, 1000),), 1)


# ---------------------------------------------------------------- loading


def test_a_valid_model_loads_and_predicts_the_law_it_learnt(scorer):
    hot, cold = scorer.predict(_features(max_tokens=100), _candidates(utilization=0.0))
    assert hot.ttft_s == pytest.approx(0.1, rel=0.1) and cold.ttft_s == pytest.approx(2.0, rel=0.1)
    assert hot.total_s == pytest.approx(1.1, rel=0.15) and cold.total_s == pytest.approx(3.0, rel=0.15)
    assert scorer.card.feature_names == FEATURE_NAMES and scorer.uses_fast_path


def test_the_fast_path_predicts_what_inplace_predict_does(model_path, scorer):
    plain = XGBScorer.from_file(model_path, use_fast_path=False)
    rng = np.random.default_rng(1)
    for num_rows in [1, 2, 16, MAX_ROWS] + [int(n) for n in rng.integers(1, 20, 40)]:
        f = _features(int(rng.integers(1, 3000)), int(rng.integers(1, 500)), temperature=0.0)
        cands = [Candidate(str(rng.choice(["hot", "cold"])), f"s{i}", None, 1, 0, float(rng.random()),
                           float(rng.random()), int(rng.integers(0, 8))) for i in range(num_rows)]
        assert scorer.predict(f, cands) == plain.predict(f, cands)
    big = [_candidates()[1]] * (MAX_ROWS + 1)  # more rows than the fast path's buffer
    assert scorer.predict(_features(), big) == plain.predict(_features(), big)


def test_predictions_are_always_well_formed(scorer):
    for p in scorer.predict(_features(max_tokens=1), _candidates(0.9) * 4):
        assert math.isfinite(p.ttft_s) and 0 <= p.ttft_s <= p.total_s


def test_feature_rows_follow_the_declared_order():
    f = _features(input_tokens=7, max_tokens=9, temperature=0.0, top_k=40, top_p=0.9)
    row = feature_matrix(f, [Candidate("cold", "s", None, 1, 0, 0.25, 0.5, 3)])[0]
    assert dict(zip(FEATURE_NAMES, row.tolist(), strict=True)) == pytest.approx({
        "is_cold": 1, "slot_fragmentation": 0.25, "slot_utilization": 0.5, "node_num_busy": 3, "input_tokens": 7,
        "max_tokens": 9, "is_greedy": 1, "top_k": 40, "top_p": 0.9, "weight_bytes": 1000, "kv_bytes_per_token": 1})
    assert feature_matrix(f, []).shape == (0, len(FEATURE_NAMES))


def _expect_rule(path, caplog, match):
    with caplog.at_level(logging.WARNING, logger="serve_app.xgb_scorer"):
        assert load_scorer(path) is RULE_SCORER
    assert any(match in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def _copy(model_path, tmp_path, name="scorer.ubj"):
    out = tmp_path / name
    out.write_bytes(model_path.read_bytes())
    card_path(out).write_text(card_path(model_path).read_text())
    return out


def test_a_missing_model_or_card_falls_back_to_the_rule(model_path, tmp_path, caplog):
    assert load_scorer(None) is RULE_SCORER
    _expect_rule(tmp_path / "nope.ubj", caplog, "not usable")
    lone = tmp_path / "lone.ubj"
    lone.write_bytes(model_path.read_bytes())
    _expect_rule(lone, caplog, "not usable")  # no card: the file cannot be verified


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_a_damaged_model_file_falls_back_without_reaching_xgboost(model_path, tmp_path, caplog, damage):
    path = _copy(model_path, tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":
        raw[len(raw) // 3] ^= 0xFF
    elif damage == "empty":
        raw = bytearray()
    else:
        raw = bytearray(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    path.write_bytes(bytes(raw))
    _expect_rule(path, caplog, "does not match its card")


def test_truncated_files_would_abort_the_process_in_xgboost_itself(model_path, tmp_path):
    """Why the hash is checked first: XGBoost's parser terminates the process on some truncations."""
    raw = model_path.read_bytes()
    cuts = [len(raw) * k // 40 for k in range(1, 40)]
    code = ("import sys, xgboost as xgb\nraw = open(sys.argv[1], 'rb').read()\n"
            "for cut in map(int, sys.argv[2:]):\n"
            "    try:\n        xgb.Booster().load_model(bytearray(raw[:cut]))\n"
            "    except xgb.core.XGBoostError:\n        pass\n")
    out = subprocess.run([sys.executable, "-c", code, str(model_path), *map(str, cuts)], capture_output=True)
    if out.returncode == 0:
        pytest.skip("this XGBoost rejects every truncation cleanly")
    path = _copy(model_path, tmp_path)
    for cut in cuts:  # the same files, through load_scorer, in this very process
        path.write_bytes(raw[:cut])
        assert load_scorer(path) is RULE_SCORER


def _save_with_card(booster, path):
    """A foreign model with a card whose hash matches, so only the content checks can refuse it."""
    raw = bytes(booster.save_raw(raw_format="ubj"))
    path.write_bytes(raw)
    card_path(path).write_text(ScorerCard(hashlib.sha256(raw).hexdigest()).to_json())
    return path


def test_a_model_with_other_features_falls_back(tmp_path, caplog):
    names = tuple(f"f{i}" for i in range(len(FEATURE_NAMES)))
    _expect_rule(_save_with_card(_train(names), tmp_path / "renamed.ubj"), caplog, "model features")
    fewer = FEATURE_NAMES[:-1]
    _expect_rule(_save_with_card(_train(fewer), tmp_path / "fewer.ubj"), caplog, "model features")


def test_a_model_with_one_target_falls_back(tmp_path, caplog):
    _expect_rule(_save_with_card(_train(num_targets=1), tmp_path / "one.ubj"), caplog, "predicts shape")


def test_a_card_for_another_schema_falls_back(model_path, tmp_path, caplog):
    path = _copy(model_path, tmp_path)
    card = json.loads(card_path(path).read_text())
    card_path(path).write_text(json.dumps(card | {"feature_names": list(FEATURE_NAMES[::-1])}))
    _expect_rule(path, caplog, "scorer card features")
    card_path(path).write_text("{not json")
    _expect_rule(path, caplog, "unreadable scorer card")


def test_the_scorer_crosses_processes_as_its_bytes_and_is_checked_again(scorer):
    clone = pickle.loads(pickle.dumps(scorer))
    assert isinstance(clone, XGBScorer)
    assert clone.predict(_features(), _candidates()) == scorer.predict(_features(), _candidates())
    func, (raw, card_json, fast) = scorer.__reduce__()
    assert func(raw[:-10], card_json, fast) is RULE_SCORER  # damaged on the way: the rule, not a crash


def test_only_ubj_files_are_written(tmp_path):
    with pytest.raises(ValueError, match="UBJSON"):
        save_model(_train(), tmp_path / "scorer.pkl", ScorerCard(sha256=""))


# ---------------------------------------------------------------- decide() with the scorer


def test_prefers_the_hot_actor_when_the_prediction_says_so(scorer):
    d = decide(_features(), _snap(hot_utilization=0.0), POLICY, scorer)
    assert isinstance(d, Dispatch) and d.actor_name == "h"
    assert d.prediction.ttft_s < 0.5 and d.candidate.kind == "hot"


def test_spawns_when_the_hot_actor_would_miss_the_target(scorer):
    # The hot actor answers first but its slot is busy: 100 tokens take ~10 s there, ~3 s on a fresh actor.
    assert isinstance(decide(_features(max_tokens=100), _snap(0.9), POLICY, scorer), Dispatch)  # fastest TTFT
    d = decide(_features(max_tokens=100, total_target_s=5.0), _snap(0.9), POLICY, scorer)
    assert isinstance(d, Spawn) and d.slot_id == "b" and d.prediction.total_s <= 5.0


def test_refuses_at_once_when_every_candidate_would_miss_the_target(scorer):
    d = decide(_features(ttft_target_s=0.01), _snap(0.0), POLICY, scorer)
    assert isinstance(d, Reject) and d.reason == "latency_target" and d.http_status == 503
    assert d.retry_after_s == POLICY.retry_after_s


@settings(max_examples=200, deadline=None)
@given(_scenarios(), st.floats(0.001, 5.0) | st.none(), st.floats(0.001, 20.0) | st.none())
def test_never_an_infeasible_candidate_whatever_the_model_says(scorer, scenario, ttft_target, total_target):
    features, snap, policy = scenario
    features = RequestFeatures(features.model, features.input_tokens, features.max_tokens, features.weight_bytes,
                               features.kv_bytes_per_token, features.workspace_bytes,
                               ttft_target_s=ttft_target, total_target_s=total_target)
    d = decide(features, snap, policy, scorer)
    if isinstance(d, Reject) and d.reason == "latency_target":
        return  # refused for its targets: nothing placed (the feasible set is checked below otherwise)
    _check_feasible(d, features, snap, policy)


def test_candidates_carry_the_load_of_their_node():
    slots = [SlotView(f"n{i // 2}/s{i}", f"n{i // 2}", 10_000, 0, 0) for i in range(4)]
    busy = [SlotView("n0/s0", "n0", 10_000, 1000, 1), SlotView("n1/s2", "n1", 10_000, 1000, 1)]
    slots[0], slots[2] = busy
    snap = ClusterSnapshot(tuple(slots), (ActorView("b", "m", "n0/s0", "busy", "short", True, 1000),
                                          ActorView("i", "m", "n1/s2", "idle", "short", True, 1000)), 1)
    seen = []

    class Spy:
        def predict(self, features, candidates):
            seen.extend((c.slot_id, c.node_num_busy) for c in candidates)
            return RULE_SCORER.predict(features, candidates)

    decide(_features(), snap, POLICY, Spy())
    # The idle actor does not load its node; the busy one loads n0's free slot.
    assert seen == [("n1/s2", 0), ("n0/s1", 1), ("n1/s3", 0)]
