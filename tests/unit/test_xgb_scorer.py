"""The XGBoost scorer: loading and validation, fallback on damaged, foreign or v1 files, and decide() with it."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import logging
import math
import pickle
import resource
import subprocess
import sys

import numpy as np
import pytest
import xgboost as xgb
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app import xgb_scorer
from serve_app.decisions import Dispatch, Join, Reject, Spawn
from serve_app.policy import decide
from serve_app.scorer import RULE_SCORER, Candidate
from serve_app.snapshot import ActorView, ClusterSnapshot, RequestFeatures, RowView, SlotView
from serve_app.xgb_scorer import (
    FEATURE_NAMES,
    LOG_S_BOUNDS,
    ScorerCard,
    XGBScorer,
    card_path,
    feature_matrix,
    load_scorer,
    save_model,
)
from tests.helpers import check_feasible, features, policy, scenarios, train_synthetic_scorer

# Short: input <= 1000 and max_tokens <= 500, so the 100-token requests below are short.
POLICY = policy(short_max_input_tokens=1000, short_max_output_tokens=500)
# The feature set before hot actors ran batches ("zq-scorer/1"), as the shipped v1 card names it.
V1_FEATURES = ("is_cold", "slot_fragmentation", "slot_utilization", "node_num_busy", "input_tokens", "max_tokens",
               "is_greedy", "top_k", "top_p", "weight_bytes", "kv_bytes_per_token")
# The shared request (tests.helpers.features), with 100 tokens in and out by default.
_features = functools.partial(features, input_tokens=100, max_tokens=100)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("scorer") / "scorer.ubj"
    save_model(train_synthetic_scorer(), path, ScorerCard(sha256=""))
    return path


@pytest.fixture(scope="module")
def scorer(model_path):
    s = load_scorer(model_path)
    assert isinstance(s, XGBScorer)
    return s


def _join(batch_rows=2, batch_tokens=500):
    return Candidate("join", "c", "j", 10_000, 1, 0.0, 0.0, 1, batch_rows, batch_tokens)


def _candidates(utilization=0.0):
    return [Candidate("hot", "a", "h", 10_000, 1, 0.0, utilization, 1), Candidate("cold", "b", None, 10_000, 0, 0.0, 0.0, 1)]


def _hot_snap(hot_utilization):
    """An idle hot actor on slot a, which is `hot_utilization` busy; slot b is free."""
    return ClusterSnapshot((SlotView("a", "n", 10_000, 1000, 1, 0.0, hot_utilization), SlotView("b", "n", 10_000, 0, 0)),
                           (ActorView("h", "m", "a", "idle", "short", True, 1000),), 1)


def _batch_snap(row_tpot_target=None):
    """A busy hot actor running 2 rows of 250 positions on slot a; slot b is free."""
    rows = tuple(RowView(250, 250, row_tpot_target, 0.0) for _ in range(2))
    return ClusterSnapshot((SlotView("a", "n", 10_000, 1500, 1), SlotView("b", "n", 10_000, 0, 0)),
                           (ActorView("j", "m", "a", "busy", "short", True, 1000, rows),), 1)


# ---------------------------------------------------------------- loading


def test_a_valid_model_loads_and_predicts_the_law_it_learnt(scorer):
    hot, join, cold = scorer.predict(_features(max_tokens=100), [_candidates()[0], _join(2, 500), _candidates()[1]])
    assert hot.ttft_s == pytest.approx(0.1, rel=0.1) and cold.ttft_s == pytest.approx(2.0, rel=0.1)
    assert hot.tpot_s == pytest.approx(0.01, rel=0.15) and cold.tpot_s == pytest.approx(0.01, rel=0.15)
    assert hot.total_s == pytest.approx(1.1, rel=0.15) and cold.total_s == pytest.approx(3.0, rel=0.15)
    step = 0.01 * 1.2 + (500 + 200) * 2e-5  # two rows, their 500 positions and the request's 200, 1 byte each
    assert join.tpot_s == pytest.approx(step, rel=0.15) and join.ttft_s == pytest.approx(0.1 + step, rel=0.15)
    assert join.total_s == pytest.approx(0.1 + 101 * step, rel=0.15)
    assert scorer.card.schema == "zq-scorer/3" and scorer.card.feature_names == FEATURE_NAMES
    assert scorer.card.targets == ("log_ttft_s", "log_total_s", "log_tpot_s")


def test_a_join_is_predicted_slower_the_more_kv_its_batch_reads_per_step(scorer):
    light, heavy = scorer.predict(_features(), [_join(2, 300), _join(2, 4000)])
    assert light.tpot_s < heavy.tpot_s and light.ttft_s < heavy.ttft_s
    # The same batch read at 4 bytes a position instead of 1: the memory-aware feature, not the token count.
    (narrow,), (wide,) = (scorer.predict(_features(kv_bytes_per_token=k), [_join(2, 1000)]) for k in (1, 4))
    assert wide.tpot_s > 2 * narrow.tpot_s


def test_only_the_public_xgboost_api_is_used():
    """No private names of XGBoost (its `_LIB`, `core._check_call`), no ctypes: nothing a release may move."""
    tree = ast.parse(inspect.getsource(xgb_scorer))
    private = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
               and not n.attr.startswith("__")}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    assert not private - {"_booster", "_raw"} and "ctypes" not in imported


def test_predictions_are_always_well_formed(scorer):
    extremes = [_features(max_tokens=1), _features(input_tokens=10**6, max_tokens=10**6, kv_bytes_per_token=10**6)]
    for f in extremes:
        for p in scorer.predict(f, _candidates(0.9) * 4 + [_join(0, 0), _join(10**4, 10**9)]):
            assert all(math.isfinite(v) for v in (p.ttft_s, p.total_s, p.tpot_s))
            assert 0 <= p.ttft_s <= p.total_s and p.tpot_s >= 0


def test_outputs_far_outside_any_time_are_clipped_not_overflowed(tmp_path):
    """A model whose log outputs would overflow exp(): predictions stay finite, within LOG_S_BOUNDS."""
    x = np.zeros((50, len(FEATURE_NAMES)), dtype=np.float32)
    y = np.tile([900.0, 800.0, -900.0], (50, 1))  # exp(900) overflows a float
    wild = xgb.train({"max_depth": 1, "base_score": 0.0, "nthread": 1},
                     xgb.DMatrix(x, y, feature_names=list(FEATURE_NAMES)), 20)
    save_model(wild, tmp_path / "wild.ubj", ScorerCard(sha256=""))
    (p,) = load_scorer(tmp_path / "wild.ubj").predict(_features(), [_candidates()[0]])
    low, high = (math.exp(b) for b in LOG_S_BOUNDS)
    assert p.ttft_s == pytest.approx(high) and p.total_s == pytest.approx(high) and p.tpot_s == pytest.approx(low)


def test_feature_rows_follow_the_declared_order():
    f = _features(input_tokens=7, max_tokens=9, kv_bytes_per_token=3, temperature=0.0, top_k=40, top_p=0.9)
    cold, join, warm = feature_matrix(f, [Candidate("cold", "s", None, 1, 0, 0.25, 0.5, 3),
                                          Candidate("join", "s", "a", 1, 1, 0.25, 0.5, 3, 4, 600),
                                          Candidate("warm", "s", "w", 1, 1, 0.25, 0.5, 3, 0, 0, 0.4)])
    common = {"input_tokens": 7, "max_tokens": 9, "is_greedy": 1, "top_k": 40, "top_p": 0.9, "weight_bytes": 1000,
              "kv_bytes_per_token": 3, "slot_fragmentation": 0.25, "slot_utilization": 0.5, "node_num_busy": 3}
    assert dict(zip(FEATURE_NAMES, cold.tolist(), strict=True)) == pytest.approx(common | {
        "is_cold": 1, "is_join": 0, "is_warm": 0, "resident_fraction": 0, "batch_rows": 0, "batch_tokens": 0,
        "batch_kv_read_bytes": (7 + 9) * 3})
    assert dict(zip(FEATURE_NAMES, join.tolist(), strict=True)) == pytest.approx(common | {
        "is_cold": 0, "is_join": 1, "is_warm": 0, "resident_fraction": 1, "batch_rows": 4, "batch_tokens": 600,
        "batch_kv_read_bytes": (600 + 16) * 3})
    assert dict(zip(FEATURE_NAMES, warm.tolist(), strict=True)) == pytest.approx(common | {
        "is_cold": 0, "is_join": 0, "is_warm": 1, "resident_fraction": 0.4, "batch_rows": 0, "batch_tokens": 0,
        "batch_kv_read_bytes": (7 + 9) * 3})
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
    # Some truncations make XGBoost allocate without bound (unlimited, the kernel's OOM killer ends it after
    # minutes, and perhaps others with it): 1.5 GiB of address space makes it a std::bad_alloc within seconds,
    # which XGBoost turns into an error in some places and into `terminate` in others.
    limit = 3 << 29
    out = subprocess.run([sys.executable, "-c", code, str(model_path), *map(str, cuts)], capture_output=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)), timeout=120)
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
    _expect_rule(_save_with_card(train_synthetic_scorer(names), tmp_path / "renamed.ubj"), caplog, "model features")
    fewer = FEATURE_NAMES[:-1]
    _expect_rule(_save_with_card(train_synthetic_scorer(fewer), tmp_path / "fewer.ubj"), caplog, "model features")


@pytest.mark.parametrize("num_targets", [1, 2])
def test_a_model_with_fewer_targets_falls_back(tmp_path, caplog, num_targets):
    _expect_rule(_save_with_card(train_synthetic_scorer(num_targets=num_targets), tmp_path / "few.ubj"), caplog, "predicts shape")


def test_a_v1_model_from_before_batching_is_refused_with_a_warning(tmp_path, caplog):
    """The shape of the shipped configs/scorer.ubj + .json: two targets, no batch features, schema 1."""
    path = tmp_path / "scorer.ubj"
    raw = bytes(train_synthetic_scorer(V1_FEATURES, num_targets=2).save_raw(raw_format="ubj"))
    path.write_bytes(raw)
    card_path(path).write_text(json.dumps({
        "sha256": hashlib.sha256(raw).hexdigest(), "schema": "zq-scorer/1", "feature_names": list(V1_FEATURES),
        "targets": ["log_ttft_s", "log_total_s"], "xgboost_version": xgb.__version__}))
    _expect_rule(path, caplog, "scorer card schema 'zq-scorer/1', expected 'zq-scorer/3'")
    assert "retrain" in caplog.records[-1].getMessage()
    # Its card relabelled as v2: the booster's own features still give it away.
    card_path(path).write_text(ScorerCard(hashlib.sha256(raw).hexdigest()).to_json())
    _expect_rule(path, caplog, "model features")


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
    func, (raw, card_json) = scorer.__reduce__()
    assert func(raw[:-10], card_json) is RULE_SCORER  # damaged on the way: the rule, not a crash


def test_only_ubj_files_are_written(tmp_path):
    with pytest.raises(ValueError, match="UBJSON"):
        save_model(train_synthetic_scorer(), tmp_path / "scorer.pkl", ScorerCard(sha256=""))


# ---------------------------------------------------------------- decide() with the scorer


def test_prefers_the_hot_actor_when_the_prediction_says_so(scorer):
    d = decide(_features(), _hot_snap(hot_utilization=0.0), POLICY, scorer)
    assert isinstance(d, Dispatch) and d.actor_name == "h"
    assert d.prediction.ttft_s < 0.5 and d.candidate.kind == "hot"


def test_spawns_when_the_hot_actor_would_miss_the_target(scorer):
    # The hot actor answers first but its slot is busy: 100 tokens take ~10 s there, ~3 s on a fresh actor.
    assert isinstance(decide(_features(max_tokens=100), _hot_snap(0.9), POLICY, scorer), Dispatch)  # fastest TTFT
    d = decide(_features(max_tokens=100, total_target_s=5.0), _hot_snap(0.9), POLICY, scorer)
    assert isinstance(d, Spawn) and d.slot_id == "b" and d.prediction.total_s <= 5.0


def test_refuses_at_once_when_every_candidate_would_miss_the_target(scorer):
    d = decide(_features(ttft_target_s=0.01), _hot_snap(0.0), POLICY, scorer)
    assert isinstance(d, Reject) and d.reason == "latency_target" and d.http_status == 503
    assert d.retry_after_s == POLICY.retry_after_s


def test_joins_a_busy_batch_when_the_prediction_says_so(scorer):
    d = decide(_features(), _batch_snap(), POLICY, scorer)
    assert isinstance(d, Join) and d.actor_name == "j" and d.candidate.batch_rows == 2
    assert d.candidate.batch_tokens == 500 and d.prediction.ttft_s < 0.5 and d.prediction.tpot_s < 0.1


def test_spawns_rather_than_slow_a_running_row_past_its_tpot_target(scorer):
    # Joining would make every step ~0.02 s; the running rows allow 0.015 s.
    d = decide(_features(), _batch_snap(row_tpot_target=0.015), POLICY, scorer)
    assert isinstance(d, Spawn) and d.slot_id == "b"
    # The request's own TPOT target: the join's predicted step is too slow for it, a fresh actor is not.
    d = decide(_features(tpot_target_s=0.015), _batch_snap(), POLICY, scorer)
    assert isinstance(d, Spawn) and d.prediction.tpot_s <= 0.015


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.floats(0.001, 5.0) | st.none(), st.floats(0.001, 20.0) | st.none(),
       st.floats(0.001, 0.5) | st.none())
def test_never_an_infeasible_candidate_whatever_the_model_says(scorer, scenario, ttft_target, total_target,
                                                                tpot_target):
    features, snap, policy = scenario
    features = RequestFeatures(features.model, features.input_tokens, features.max_tokens, features.weight_bytes,
                               features.kv_bytes_per_token, features.workspace_bytes,
                               ttft_target_s=ttft_target, total_target_s=total_target, tpot_target_s=tpot_target)
    d = decide(features, snap, policy, scorer)
    if isinstance(d, Reject) and d.reason == "latency_target":
        return  # refused for its targets: nothing placed (the feasible set is checked below otherwise)
    check_feasible(d, features, snap, policy)


def test_candidates_carry_the_load_of_their_node():
    slots = [SlotView(f"n{i // 2}/s{i}", f"n{i // 2}", 10_000, 0, 0) for i in range(4)]
    busy = [SlotView("n0/s0", "n0", 10_000, 1000, 1), SlotView("n1/s2", "n1", 10_000, 1000, 1)]
    slots[0], slots[2] = busy
    snap = ClusterSnapshot(tuple(slots), (ActorView("b", "m", "n0/s0", "busy", "short", True, 1000,
                                                    (RowView(100, 20, None, 0.0),)),
                                          ActorView("i", "m", "n1/s2", "idle", "short", True, 1000)), 1)
    seen = []

    class Spy:
        def predict(self, features, candidates):
            seen.extend((c.slot_id, c.node_num_busy) for c in candidates)
            return RULE_SCORER.predict(features, candidates)

    decide(_features(), snap, POLICY, Spy())
    # The idle actor does not load its node; the busy one loads its own slot (a join) and n0's free one.
    assert seen == [("n1/s2", 0), ("n0/s0", 1), ("n0/s1", 1), ("n1/s3", 0)]
