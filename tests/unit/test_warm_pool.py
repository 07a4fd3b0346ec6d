"""Warm actors in the decision and the registry: the pool's plan, binding, lanes, eviction and idleness."""

from __future__ import annotations

from serve_app.decisions import Bind, Join, Spawn
from serve_app.policy import PolicyConfig, decide
from serve_app.registry import RegistryState, RowReservation, SlotSpec
from serve_app.snapshot import ActorView, ClusterSnapshot, RowView, SlotView
from serve_app.warm_pool import WarmFill, WarmSpec, models_without_a_ready_actor, plan_fills
from tests.helpers import actor, policy
from tests.helpers import features as _features
from tests.helpers import slot as _slot
from tests.helpers import snapshot as _snap

# One warm actor per lane; idle actors, and an idle model's warm actors, retire after 60 s.
POLICY = policy(num_warm_short_actors=1, num_warm_long_actors=1, max_idle_s=60.0)


def _warm(name, slot_id, lane="short", model="m", state="warm", fraction=0.5) -> ActorView:
    return ActorView(name, model, slot_id, state, lane, False, 1000, (), fraction)


def test_the_plan_fills_each_lane_to_its_size_first_fit_and_skips_idle_models():
    snap = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b"), _slot("c")], [_warm("w", "a")])
    fills = plan_fills(snap, [WarmSpec("m", 1000), WarmSpec("idle", 1000)], POLICY, active_models={"m"})
    assert fills == [WarmFill("m", "long", "b", 1000)]  # the short pool already has its one
    assert plan_fills(snap, [WarmSpec("m", 20_000)], POLICY, {"m"}) == []  # no slot holds it


def test_a_model_waits_for_a_warm_or_hot_actor_and_a_model_without_a_pool_waits_for_none():
    slots = [_slot("a"), _slot("b")]
    no_pool = policy(num_warm_short_actors=0)
    assert models_without_a_ready_actor(_snap(slots), {"m"}, POLICY) == {"m"}
    assert models_without_a_ready_actor(_snap(slots, [_warm("w", "a", state="warming")]), {"m"}, POLICY) == {"m"}
    assert models_without_a_ready_actor(_snap(slots, [_warm("w", "a", state="starting")]), {"m"}, POLICY) == {"m"}
    assert models_without_a_ready_actor(_snap(slots, [_warm("w", "a", model="other")]), {"m"}, POLICY) == {"m"}
    assert models_without_a_ready_actor(_snap(slots, [_warm("w", "a")]), {"m"}, POLICY) == set()
    assert models_without_a_ready_actor(_snap(slots, [actor("hot", "b", state="busy")]), {"m"}, POLICY) == set()
    assert models_without_a_ready_actor(_snap(slots, [actor("hot", "b")]), {"m"}, POLICY) == set()
    # A bound warm actor serving its one request takes no other: not ready.
    bound = actor("bound", "b", state="busy", is_hot=False)
    assert models_without_a_ready_actor(_snap(slots, [bound]), {"m"}, POLICY) == {"m"}
    assert models_without_a_ready_actor(_snap(slots), {"m"}, no_pool) == set()


def test_a_warm_actor_of_the_lane_is_bound_rather_than_a_process_started():
    snap = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b")], [_warm("w", "a")])
    d = decide(_features(), snap, POLICY)
    assert d == Bind("w", "a", "short", True, _features().dispatch_bytes)
    assert d.prediction.ttft_s < decide(_features(), _snap([_slot("b")]), POLICY).prediction.ttft_s


def test_at_max_hot_a_join_within_the_targets_is_taken_before_a_faster_warm_bind():
    # A busy hot actor (the lane's one hot actor) and a warm one. Binding the warm actor is predicted
    # faster (no batch to share), but the bound actor would exit after its request and its slot refill
    # with a process start: the join, within the targets, is taken. Below max_hot the bound actor stays
    # hot (a second batch, not a process per request), so the faster bind is taken.
    snap = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b", reserved=1000, num_actors=1)],
                 [_warm("w", "a", fraction=1.0), actor("hot", "b", state="busy", rows=3)])
    f = _features(ttft_target_s=10.0)
    one_hot = policy(num_warm_short_actors=1, max_hot_short_actors=1)
    d = decide(f, snap, one_hot)
    assert isinstance(d, Join) and d.actor_name == "hot"
    bind = decide(f, snap, policy(num_warm_short_actors=1, max_hot_short_actors=2))
    assert isinstance(bind, Bind) and bind.actor_name == "w" and bind.prediction.ttft_s < d.prediction.ttft_s
    # A join that would miss the target is not taken for it: the warm actor is bound.
    tight = _features(ttft_target_s=bind.prediction.ttft_s * 1.01)
    assert d.prediction.ttft_s > tight.ttft_target_s
    assert isinstance(decide(tight, snap, one_hot), Bind)


def test_the_other_lanes_warm_actor_is_bound_only_in_place_of_a_process_start_or_a_refusal():
    long = _features(input_tokens=500)
    other_lane = _snap([_slot("a", reserved=1000, num_actors=1)], [_warm("w", "a", lane="short")])
    assert isinstance(decide(long, other_lane, POLICY), Bind)  # else: refused, or evicted for a cold start
    with_hot = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b", reserved=1000, num_actors=1)],
                     [_warm("w", "a", lane="long"),
                      ActorView("hot", "m", "b", "idle", "short", True, 1000)])
    assert decide(_features(), with_hot, POLICY).actor_name == "hot"  # the long lane keeps its warm actor


def test_a_warming_actor_is_bound_in_place_of_a_fresh_one_and_never_evicted_for_its_own_model():
    snap = _snap([_slot("a", reserved=1000, num_actors=1)], [_warm("w", "a", state="warming", lane="long")])
    d = decide(_features(), snap, POLICY)  # a fresh deployment's first request: its pool is still starting
    assert isinstance(d, Bind) and d.actor_name == "w" and d.candidate.kind == "cold"  # scored as a start
    with_slot = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b")],
                      [_warm("w", "a", state="warming", lane="long")])
    assert decide(_features(), with_slot, POLICY).actor_name == "w"  # further along than a fresh spawn on b
    assert decide(_features(model="m2"), snap, POLICY).evict == ("w",)  # another model's: retired


def test_a_warming_actor_is_bound_only_once_its_filler_created_its_process():
    # Committed by fill_warm, its process not yet made: a request sent there would find no actor of that name
    # and count it as lost (CI saw the retry then refused). It holds its pool place and its slot meanwhile.
    reg = RegistryState()
    reg.register_slots([SlotSpec("a", "n", 10_000), SlotSpec("b", "n", 10_000)])
    warm_only = PolicyConfig(actor_overhead_bytes=0, num_warm_short_actors=1, max_hot_short_actors=0)
    [(name, fill)] = reg.fill_warm([WarmSpec("m", 1000)], warm_only, {"m": ["w1"]}, now=0.0)
    assert name == "w1" and not _view(reg, "w1").is_created
    d = reg.admit(_features(), warm_only, "fresh", "r1", now=0.1)
    assert isinstance(d, Spawn) and d.slot_id == "b"  # not bound to w1
    assert reg.fill_warm([WarmSpec("m", 1000)], warm_only, {"m": ["w2"]}, now=0.2) == []  # w1 fills the pool
    assert reg.warm_created("w1") and not reg.warm_created("w1")  # said once
    assert reg.admit(_features(), warm_only, "fresh2", "r2", now=0.3) == Bind(
        "w1", "a", "short", False, _features().dispatch_bytes)
    reg.check_invariants()


def test_eviction_retires_warm_actors_before_idle_hot_ones_and_never_a_running_one():
    other_model = _features(model="m2")
    snap = _snap([_slot("a", reserved=1000, num_actors=1), _slot("b", reserved=1000, num_actors=1),
                  _slot("c", reserved=1100, num_actors=1)],
                 [ActorView("hot", "m", "a", "idle", "short", True, 1000), _warm("w", "b"),
                  ActorView("busy", "m", "c", "busy", "short", True, 1000)])
    d = decide(other_model, snap, POLICY)
    assert isinstance(d, Spawn) and d.slot_id == "b" and d.evict == ("w",)


def test_a_bound_warm_actor_serves_then_goes_like_a_spawned_one_and_the_pool_refills():
    reg = RegistryState(max_idle_s=60.0)
    reg.register_slots([SlotSpec("a", "n", 10_000), SlotSpec("b", "n", 10_000)])
    short_only = PolicyConfig(short_max_input_tokens=100, short_max_output_tokens=50, max_hot_short_actors=0,
                              actor_overhead_bytes=0, num_warm_short_actors=1)
    [(name, fill)] = reg.fill_warm([WarmSpec("m", 1000)], short_only, {"m": ["w1", "w2"]}, now=0.0)
    assert (name, fill.slot_id) == ("w1", "a") and reg.warm_ready("w1", 0.4)
    d = reg.admit(_features(), short_only, "spawned", "r1", now=1.0)
    assert d == Bind("w1", "a", "short", False, _features().dispatch_bytes)
    reg.check_invariants()
    # No refill while w1 loads for its request: a process start would take the node's CPU from it.
    assert reg.fill_warm([WarmSpec("m", 1000)], short_only, {"m": ["w2"]}, now=1.2) == []
    assert reg.actor_started("w1")  # its first token: the rest of its weights are in
    [(refill, _)] = reg.fill_warm([WarmSpec("m", 1000)], short_only, {"m": ["w2"]}, now=1.5)
    assert refill == "w2" and _view(reg, "w2").slot_id == "b"  # on the free slot, while w1 decodes
    assert not reg.finish("w1", "r1", "complete", now=2.0)
    assert _view(reg, "w1") is None  # not kept hot: it exits, as a spawned actor does
    assert reg.fill_warm([WarmSpec("m", 1000)], short_only, {"m": ["w3"]}, now=2.5) == []  # full
    reg.check_invariants()
    assert reg.counters["bind"] == 1 and reg.counters["spawn_with_warm_available"] == 0


def test_no_refill_while_every_core_of_the_node_computes_and_one_once_a_core_is_free():
    reg = RegistryState(max_idle_s=60.0, max_batch=1)
    reg.register_slots([SlotSpec("a", "n", 10_000), SlotSpec("b", "n", 10_000), SlotSpec("c", "n", 10_000)])
    # Batches of one row: the second request cannot join the hot actor, and binds the warm one.
    short_only = PolicyConfig(short_max_input_tokens=100, short_max_output_tokens=50, max_hot_short_actors=1,
                              actor_overhead_bytes=0, num_warm_short_actors=1, max_batch=1)
    two_cores = WarmSpec("m", 1000, node_cpus=2)
    reg.admit(_features(), short_only, "hot", "r0", now=0.0)  # a hot actor computes on a
    reg.actor_started("hot")
    [(w1, _)] = reg.fill_warm([two_cores], short_only, {"m": ["w1"]}, now=0.5)  # one core free: filled
    reg.warm_ready(w1, 1.0)
    assert isinstance(reg.admit(_features(), short_only, "x", "r1", now=1.0), Bind)  # w1 bound: computes too
    reg.actor_started(w1)
    # Both cores compute: a process start now would take its CPU from both batches' steps.
    assert reg.fill_warm([two_cores], short_only, {"m": ["w2"]}, now=1.5) == []
    assert [n for n, _ in reg.fill_warm([WarmSpec("m", 1000)], short_only, {"m": ["w2"]}, now=1.5)] == ["w2"]
    reg.drop_warming("w2")  # (that pool had no limit; back to the two-core one)
    reg.finish(w1, "r1", "complete", now=2.0)  # w1 served and goes: a core is free again
    assert [n for n, _ in reg.fill_warm([two_cores], short_only, {"m": ["w3"]}, now=2.5)] == ["w3"]
    reg.check_invariants()


def test_a_hot_actor_holding_only_free_leased_rows_computes_nothing_and_one_plan_fills_no_core_twice():
    two_cores = WarmSpec("m", 1000, node_cpus=2)
    pool_of_two = policy(num_warm_short_actors=2, num_warm_long_actors=0)
    free_rows = ActorView("hot", "m", "a", "busy", "short", True, 1000, (RowView(20, 0, None, 0.0),))
    running = ActorView("hot", "m", "a", "busy", "short", True, 1000, (RowView(20, 30, None, 0.0),))
    slots = [_slot("a", reserved=1020, num_actors=1), _slot("b"), _slot("c")]
    # Leased rows, none in use: both cores are free, and the plan takes both (not a third start).
    assert [f.slot_id for f in plan_fills(_snap(slots, [free_rows]), [two_cores], pool_of_two, {"m"})] == ["b", "c"]
    # A request runs there: one core is left, and one fill takes it.
    assert [f.slot_id for f in plan_fills(_snap(slots, [running]), [two_cores], pool_of_two, {"m"})] == ["b"]


def test_a_models_warm_actors_retire_once_it_is_idle_and_are_not_refilled_until_it_is_asked_for():
    reg = RegistryState(max_idle_s=60.0)
    reg.register_slots([SlotSpec("a", "n", 10_000)])
    policy = PolicyConfig(actor_overhead_bytes=0, max_hot_short_actors=0, num_warm_short_actors=1, max_idle_s=60.0)
    reg.fill_warm([WarmSpec("m", 1000)], policy, {"m": ["w1"]}, now=0.0)
    reg.warm_ready("w1", 1.0)
    assert reg.reconcile({"w1"}, now=59.0).retired == ()
    assert reg.reconcile({"w1"}, now=61.0).retired == ("w1",)
    assert reg.fill_warm([WarmSpec("m", 1000)], policy, {"m": ["w2"]}, now=62.0) == []  # idle model: no refill
    reg.admit(_features(), policy, "s1", "r1", now=63.0)  # a request: the model is active again
    assert [n for n, _ in reg.fill_warm([WarmSpec("m", 1000)], policy, {"m": ["w3"]}, now=64.0)] == []  # slot taken
    reg.finish("s1", "r1", "complete", now=65.0)
    assert [n for n, _ in reg.fill_warm([WarmSpec("m", 1000)], policy, {"m": ["w4"]}, now=66.0)] == ["w4"]


def test_a_warm_actor_that_dies_before_it_is_bound_is_dropped_and_its_slot_refilled():
    reg = RegistryState(spawn_grace_s=5.0)
    reg.register_slots([SlotSpec("a", "n", 10_000)])
    policy = PolicyConfig(actor_overhead_bytes=0, num_warm_short_actors=1)
    reg.fill_warm([WarmSpec("m", 1000)], policy, {"m": ["w1"]}, now=0.0)
    reg.warm_ready("w1", 1.0)
    assert reg.reconcile(set(), now=10.0).ghosts == ("w1",)
    assert [n for n, _ in reg.fill_warm([WarmSpec("m", 1000)], policy, {"m": ["w2"]}, now=10.5)] == ["w2"]
    reg.check_invariants()


def _view(reg, name):
    return next((a for a in reg.snapshot().actors if a.name == name), None)


def test_rows_of_a_bound_actor_are_reserved_like_a_spawns(tmp_path):
    reg = RegistryState()
    reg.register_slots([SlotSpec("a", "n", 10_000)])
    policy = PolicyConfig(actor_overhead_bytes=0, num_warm_short_actors=1)
    reg.fill_warm([WarmSpec("m", 1000)], policy, {"m": ["w1"]}, now=0.0)
    reg.warm_ready("w1", 1.0)
    assert reg.try_bind(Bind("w1", "a", "short", True, 30), RowReservation("r", 20, None, 1.0, 99.0))
    assert _view(reg, "w1").reserved_bytes == 1030
    reg.check_invariants()


def test_a_warming_actor_that_fails_is_dropped_unless_a_request_was_bound_to_it():
    reg = RegistryState()
    reg.register_slots([SlotSpec("a", "n", 10_000), SlotSpec("b", "n", 10_000)])
    policy = PolicyConfig(actor_overhead_bytes=0, num_warm_short_actors=2)
    reg.fill_warm([WarmSpec("m", 1000)], policy, {"m": ["w1", "w2"]}, now=0.0)
    assert reg.try_bind(Bind("w1", "a", "short", False, 30), RowReservation("r", 20, None, 1.0, 99.0))
    assert not reg.drop_warming("w1")  # bound while warming: its request's end releases it
    assert reg.drop_warming("w2") and _view(reg, "w2") is None
    reg.check_invariants()


def test_spawns_and_fills_carry_their_slots_node_so_any_replica_can_place_them():
    snap = ClusterSnapshot((SlotView("a", "node-a", 10_000, 0, 0),), (), 1)
    assert decide(_features(), _snap([]), POLICY).reason == "no_capacity"
    assert decide(_features(model="m2"), snap, POLICY).node_id == "node-a"
    [fill] = plan_fills(snap, [WarmSpec("m", 1000)], PolicyConfig(actor_overhead_bytes=0, num_warm_short_actors=1),
                        {"m"})
    assert fill.node_id == "node-a"
