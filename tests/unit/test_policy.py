"""The pure decision: dispatch, first-fit spawn, reject; lanes and hot counts; scorer garbage."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.memory import ModelNumbers, request_features, workspace_bytes
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
from serve_app.scorer import RULE_SCORER, Candidate, Prediction, RuleScorer

# Short: input <= 100 and max_tokens <= 50.
POLICY = PolicyConfig(short_max_input_tokens=100, short_max_output_tokens=50, max_hot_short_actors=2,
                      max_hot_long_actors=0, actor_overhead_bytes=0, max_actors_per_slot=1)


def _features(input_tokens=10, max_tokens=10, weight_bytes=1000, kv_bytes_per_token=1, workspace_bytes=0,
              model="m", **kw) -> RequestFeatures:
    return RequestFeatures(model, input_tokens, max_tokens, weight_bytes, kv_bytes_per_token, workspace_bytes, **kw)


def _slot(slot_id, total=10_000, reserved=0, num_actors=0) -> SlotView:
    return SlotView(slot_id, "node", total, reserved, num_actors)


def _actor(name, slot_id, state="idle", lane="short", model="m", is_hot=True, reserved=1000) -> ActorView:
    return ActorView(name, model, slot_id, state, lane, is_hot, reserved)


def _snap(slots, actors=()) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(slots), tuple(actors), 1)


# ---------------------------------------------------------------- features and memory


def test_features_derive_the_byte_counts():
    f = _features(input_tokens=10, max_tokens=6, weight_bytes=1000, kv_bytes_per_token=3, workspace_bytes=7,
                  actor_overhead_bytes=100)
    assert f.kv_bytes == 3 * 16
    assert f.dispatch_bytes == 48 + 7
    assert f.resident_bytes == 1100
    assert f.spawn_bytes == 1100 + 55


def test_memory_need_matches_the_model_config_and_the_actor_kv_cache():
    from actors.kv_cache import kv_cache_bytes
    from weights_tool.architecture import ModelConfig

    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "torch_dtype": "bfloat16",
    })
    numbers = ModelNumbers.from_config(cfg)
    assert numbers.dtype_bytes == 2 and numbers.weight_bytes == cfg.weight_bytes()
    f = request_features("tiny", numbers, input_tokens=40, max_tokens=24, policy=POLICY)
    # The KV the actor allocates: setup_cache(len(prompt) + max_tokens).
    assert f.kv_bytes == kv_cache_bytes(cfg, 40 + 24, "bfloat16")
    # The MLP phase binds here: 2 bytes * 40 tokens * (4 * 64 + 3 * 176), plus mask, RoPE, logits.
    expected = 2 * 40 * (4 * 64 + 3 * 176) + 40 * 40 + 40 * 16 * (2 * 2 + 8) + 300 * (2 + 32)
    assert f.workspace_bytes == workspace_bytes(numbers, 40) == expected
    assert workspace_bytes(numbers, 80) > workspace_bytes(numbers, 40)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_workspace_bytes_bounds_the_measured_prefill_peak_on_cpu(dtype_name):
    """The derived figure is an upper bound on what a real prefill allocates, and not a loose one."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from actors.model import Transformer
    from weights_tool.architecture import ModelConfig

    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500,
        "torch_dtype": dtype_name, "max_position_embeddings": 1024,
    })
    dtype = getattr(torch, dtype_name)
    model = Transformer(cfg, dtype=dtype)
    seq_len = 512
    model.setup_cache(seq_len + 8)  # allocated before: the KV cache is accounted separately
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_len))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = model.prefill(tokens)
        torch.sort(torch.softmax(logits, dim=-1), descending=True)
    # Allocations are positive events, frees negative: the running sum's peak is the transient peak.
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    need = workspace_bytes(ModelNumbers.from_config(cfg), seq_len)
    assert peak <= need <= 2 * peak, (peak, need)


def test_bad_features_fail_before_any_decision():
    with pytest.raises(ValueError, match="input_tokens"):
        decide(_features(input_tokens=0), _snap([_slot("a")]), POLICY)
    with pytest.raises(ValueError, match="byte counts"):
        decide(_features(weight_bytes=-1), _snap([_slot("a")]), POLICY)
    with pytest.raises(ValueError, match="max_actors_per_slot"):
        PolicyConfig(max_actors_per_slot=0)


# ---------------------------------------------------------------- dispatch and spawn


def test_dispatches_to_an_idle_hot_actor_that_fits():
    snap = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b")], [_actor("hot-1", "a")])
    d = decide(_features(), snap, POLICY)
    assert d == Dispatch("hot-1", "a", "short", True, _features().dispatch_bytes)


def test_an_actor_whose_slot_lacks_kv_room_is_not_chosen():
    f = _features(kv_bytes_per_token=10)  # dispatch needs 200 bytes
    snap = _snap([_slot("a", total=1150, reserved=1000, num_actors=1), _slot("b", total=1500, reserved=1000,
                  num_actors=1), _slot("c")],
                 [_actor("cramped", "a"), _actor("roomy", "b")])
    assert decide(f, snap, POLICY) == Dispatch("roomy", "b", "short", True, 200)
    snap = _snap([_slot("a", total=1150, reserved=1000, num_actors=1), _slot("c")], [_actor("cramped", "a")])
    assert decide(f, snap, POLICY) == Spawn("c", "short", True, f.spawn_bytes, f.resident_bytes)


def test_actors_of_another_model_or_not_idle_are_not_dispatched_to():
    snap = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b", reserved=1000, num_actors=1), _slot("c")],
                 [_actor("other", "a", model="m2"), _actor("busy", "b", state="busy")])
    assert isinstance(decide(_features(), snap, POLICY), Spawn)


def test_spawn_takes_the_first_slot_that_fits_not_the_best_fit():
    f = _features()  # spawn needs 1020 bytes
    slots = [_slot("too-small", total=1019), _slot("full", total=5000, reserved=4000), _slot("big", total=10_000),
             _slot("snug", total=1020)]
    d = decide(f, _snap(slots), POLICY)
    assert isinstance(d, Spawn) and d.slot_id == "big"
    # Order is the snapshot's: put the snug slot first and it wins.
    d = decide(f, _snap([slots[3], slots[2]]), POLICY)
    assert d.slot_id == "snug" and d.reserve_bytes == 1020 and d.resident_bytes == 1000


def test_spawn_skips_slots_at_their_actor_limit():
    slots = [_slot("a", num_actors=1), _slot("b", num_actors=1), _slot("c")]
    assert decide(_features(), _snap(slots), POLICY).slot_id == "c"
    two_per_slot = PolicyConfig(**{**POLICY.__dict__, "max_actors_per_slot": 2})
    assert decide(_features(), _snap(slots), two_per_slot).slot_id == "a"


def test_reject_no_capacity_when_everything_is_busy_or_full():
    f = _features()
    snap = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b", total=2000, reserved=1500, num_actors=1)],
                 [_actor("busy", "a", state="busy")])
    r = decide(f, snap, POLICY)
    assert isinstance(r, Reject) and r.reason == "no_capacity"
    assert r.retry_after_s == POLICY.retry_after_s and r.http_status == 503
    assert decide(f, _snap([]), POLICY).reason == "no_capacity"  # no slots registered yet


def test_reject_too_large_when_no_slot_could_ever_hold_it():
    f = _features(max_tokens=5000)  # 1000 + 5010 bytes
    r = decide(f, _snap([_slot("a", total=6000), _slot("b", total=3000)]), POLICY)
    assert isinstance(r, Reject) and r.reason == "too_large"
    assert r.retry_after_s is None and r.http_status == 400 and "6010" in r.message
    # Fits a slot's total, but not what is free now: that is overload, not a bad request.
    assert decide(f, _snap([_slot("a", total=6010, reserved=1)]), POLICY).reason == "no_capacity"


# ---------------------------------------------------------------- lanes and hot counts


def test_long_requests_never_take_a_short_lane_hot_actor_and_are_not_kept_hot():
    long = _features(input_tokens=500)
    snap = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b")], [_actor("short-hot", "a")])
    d = decide(long, snap, POLICY)
    assert d == Spawn("b", "long", False, long.spawn_bytes, long.resident_bytes)
    # Nowhere to spawn: refused rather than placed on the short lane's actor.
    snap = _snap([_slot("a", reserved=1000, num_actors=1)], [_actor("short-hot", "a")])
    assert decide(long, snap, POLICY).reason == "no_capacity"
    assert decide(_features(max_tokens=51), snap, POLICY).reason == "no_capacity"


def test_short_requests_prefer_short_lane_actors_then_take_an_idle_long_lane_one():
    slots = [_slot("a", reserved=1000, num_actors=1), _slot("b", reserved=1000, num_actors=1)]
    both = _snap(slots, [_actor("long-idle", "a", lane="long"), _actor("short-idle", "b")])
    assert decide(_features(), both, POLICY).actor_name == "short-idle"
    only_long = _snap(slots, [_actor("long-idle", "a", lane="long")])
    d = decide(_features(), only_long, POLICY)
    # The long-lane quota is 0, so that actor is no longer kept after this request.
    assert d == Dispatch("long-idle", "a", "short", False, _features().dispatch_bytes)


def test_short_requests_keep_up_to_max_hot_actors_hot():
    slots = [_slot(f"s{i}") for i in range(4)]
    hot = [_actor("h0", "s0", state="busy"), _actor("h1", "s1", state="starting")]
    assert decide(_features(), _snap(slots, hot[:1]), POLICY).keep_hot is True
    d = decide(_features(), _snap(slots, hot), POLICY)
    assert isinstance(d, Spawn) and d.keep_hot is False  # 2 hot already: this one exits after its request
    not_hot = [_actor("h0", "s0", state="busy"), _actor("x", "s1", state="busy", is_hot=False)]
    assert decide(_features(), _snap(slots, not_hot), POLICY).keep_hot is True
    overridden = PolicyConfig(**{**POLICY.__dict__, "hot_overrides": (("m", 3, 1),)})
    assert decide(_features(), _snap(slots, hot), overridden).keep_hot is True
    assert decide(_features(input_tokens=500), _snap(slots, hot), overridden).keep_hot is True
    assert decide(_features(model="m2"), _snap(slots, hot), overridden).keep_hot is True  # m2's count is 0


def test_a_dispatch_over_the_hot_quota_lets_the_actor_go():
    snap = _snap([_slot(f"s{i}", reserved=1000, num_actors=1) for i in range(3)],
                 [_actor("h0", "s0"), _actor("h1", "s1", state="busy"), _actor("h2", "s2", state="busy")])
    assert decide(_features(), snap, POLICY) == Dispatch("h0", "s0", "short", False, _features().dispatch_bytes)


# ---------------------------------------------------------------- the scorer


class _FixedScorer:
    def __init__(self, predictions):
        self.predictions = predictions
        self.seen = None

    def predict(self, features, candidates):
        self.seen = list(candidates)
        return self.predictions(candidates) if callable(self.predictions) else self.predictions


def test_the_rule_scorer_predicts_by_its_documented_formula():
    f = _features(input_tokens=40, max_tokens=10, weight_bytes=2_000_000_000)
    rule = RuleScorer(prefill_tokens_per_s=1000, decode_s_per_token=0.1, load_bytes_per_s=1e9, actor_start_s=2)
    hot, cold = Candidate("hot", "a", "x", 1, 1, 0, 0), Candidate("cold", "b", None, 1, 0, 0, 0)
    assert rule.predict(f, [hot, cold]) == [Prediction(0.04, 1.04), Prediction(4.04, 5.04)]


def test_the_scorer_ranks_only_feasible_candidates_and_its_choice_is_followed():
    f = _features(kv_bytes_per_token=10)
    snap = _snap([_slot("a", total=1150, reserved=1000, num_actors=1), _slot("b"), _slot("c", total=100),
                  _slot("d")], [_actor("cramped", "a")])
    scorer = _FixedScorer(lambda cs: [Prediction(10.0 - i, 20.0) for i in range(len(cs))])  # prefers the last
    d = decide(f, snap, POLICY, scorer)
    assert [(c.kind, c.slot_id) for c in scorer.seen] == [("cold", "b"), ("cold", "d")]
    assert d.slot_id == "d"


def test_a_latency_target_nothing_meets_is_refused():
    f = _features(ttft_target_s=1.0)
    snap = _snap([_slot("a")])
    r = decide(f, snap, POLICY, _FixedScorer([Prediction(2.0, 3.0)]))
    assert isinstance(r, Reject) and r.reason == "latency_target" and r.http_status == 503
    assert isinstance(decide(f, snap, POLICY, _FixedScorer([Prediction(0.5, 3.0)])), Spawn)


@pytest.mark.parametrize("garbage", [
    [Prediction(math.nan, 1.0), Prediction(0.1, 0.2)],
    [Prediction(-1.0, 1.0), Prediction(0.1, 0.2)],
    [Prediction(0.5, 0.1), Prediction(0.1, 0.2)],  # ttft after the last token
    [Prediction(0.1, 0.2)],  # one short
    [Prediction(0.1, 0.2)] * 3,
    ["fast", None],
])
def test_malformed_predictions_fall_back_to_the_rule(garbage):
    snap = _snap([_slot("a"), _slot("b")])
    assert decide(_features(), snap, POLICY, _FixedScorer(garbage)).slot_id == "a"


def test_a_scorer_that_raises_falls_back_to_the_rule():
    class Broken:
        def predict(self, features, candidates):
            raise RuntimeError("model file missing")

    assert decide(_features(), _snap([_slot("a"), _slot("b")]), POLICY, Broken()).slot_id == "a"


# ---------------------------------------------------------------- properties over random snapshots

_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.just(math.nan), st.just(-1.0), st.just(1e308),
    st.floats(0, 100),
)


@st.composite
def _scenarios(draw):
    num_slots = draw(st.integers(0, 6))
    slots = []
    for i in range(num_slots):
        total = draw(st.integers(0, 4000))
        slots.append(SlotView(f"s{i}", "n", total, draw(st.integers(0, total)), draw(st.integers(0, 2))))
    actors = []
    for i in range(draw(st.integers(0, 6)) if slots else 0):
        state = draw(st.sampled_from(["starting", "busy", "idle"]))
        actors.append(ActorView(f"a{i}", draw(st.sampled_from(["m", "m2"])), draw(st.sampled_from(slots)).slot_id,
                                state, draw(st.sampled_from(["short", "long"])),
                                state == "idle" or draw(st.booleans()), 100))
    features = _features(input_tokens=draw(st.integers(1, 20)), max_tokens=draw(st.integers(1, 20)),
                         weight_bytes=draw(st.integers(0, 3000)), kv_bytes_per_token=draw(st.integers(0, 30)),
                         workspace_bytes=draw(st.integers(0, 300)))
    policy = PolicyConfig(short_max_input_tokens=10, short_max_output_tokens=10,
                          max_hot_short_actors=draw(st.integers(0, 2)), max_hot_long_actors=draw(st.integers(0, 2)),
                          actor_overhead_bytes=0, max_actors_per_slot=draw(st.integers(1, 2)),
                          max_candidates=draw(st.integers(1, 3)))
    return features, ClusterSnapshot(tuple(slots), tuple(actors), 0), policy


def _feasible(features, snap, policy):
    """Every feasible placement, found without `decide`'s code: (hot actors in order, cold slots in order)."""
    is_short = features.input_tokens <= 10 and features.max_tokens <= 10
    free = {s.slot_id: s.total_bytes - s.reserved_bytes for s in snap.slots}
    hot = [a.name for lane in (("short", "long") if is_short else ("long",)) for a in snap.actors
           if a.lane == lane and a.model == features.model and a.state == "idle"
           and free[a.slot_id] >= features.dispatch_bytes]
    cold = [s.slot_id for s in snap.slots
            if free[s.slot_id] >= features.spawn_bytes and s.num_actors < policy.max_actors_per_slot]
    return hot, cold


def _check_feasible(d, features, snap, policy):
    hot, cold = _feasible(features, snap, policy)
    if isinstance(d, Dispatch):
        actor = next(a for a in snap.actors if a.name == d.actor_name)
        assert d.actor_name in hot and d.slot_id == actor.slot_id and d.reserve_bytes == features.dispatch_bytes
    elif isinstance(d, Spawn):
        assert d.slot_id in cold and d.reserve_bytes == features.spawn_bytes
    else:
        assert not hot and not cold, f"rejected ({d.reason}) with feasible {hot} {cold}"
        is_too_large = bool(snap.slots) and features.spawn_bytes > max(s.total_bytes for s in snap.slots)
        assert d.reason == ("too_large" if is_too_large else "no_capacity")
    return hot, cold


@settings(max_examples=300, deadline=None)
@given(_scenarios(), st.data())
def test_whatever_the_scorer_says_the_decision_is_feasible(scenario, data):
    features, snap, policy = scenario

    def garbage(candidates):
        n = max(0, len(candidates) + data.draw(st.integers(-1, 1)))
        return [Prediction(data.draw(_values), data.draw(_values)) for _ in range(n)]

    _check_feasible(decide(features, snap, policy, _FixedScorer(garbage)), features, snap, policy)


@settings(max_examples=300, deadline=None)
@given(_scenarios())
def test_with_the_rule_scorer_the_decision_is_the_first_hot_actor_else_first_fit(scenario):
    features, snap, policy = scenario
    d = decide(features, snap, policy, RULE_SCORER)
    hot, cold = _check_feasible(d, features, snap, policy)
    if hot:
        assert isinstance(d, Dispatch) and d.actor_name == hot[0]
    elif cold:
        assert isinstance(d, Spawn) and d.slot_id == cold[0]


# ---------------------------------------------------------------- purity


def test_the_policy_modules_import_neither_ray_nor_torch():
    code = ("import sys, serve_app.policy, serve_app.memory, serve_app.scorer, serve_app.registry; "
            "print(sorted(m for m in ('ray', 'torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_snapshot_pickles_without_its_cached_indexes():
    snap = _snap([_slot("a", reserved=1000, num_actors=1)], [_actor("h", "a")])
    assert snap.idle_actors("m", "short") and snap.max_total_bytes == 10_000  # builds the caches
    clone = pickle.loads(pickle.dumps(snap))
    assert clone == snap and "_idle" not in clone.__dict__
    assert decide(_features(), clone, POLICY) == decide(_features(), snap, POLICY)
