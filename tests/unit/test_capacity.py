"""The capacity planner as pure functions: slots from demand, hysteresis, and the registry's side of it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.capacity import (
    CapacityConfig,
    CapacityPlan,
    LaneDemand,
    bundles,
    nodes_pending,
    plan_slots,
    ready_in_s,
    slots_needed,
)
from serve_app.config import AppArgs, ingress_config
from serve_app.decisions import Reject
from serve_app.demand import MIN_RATE_SPAN_S, DemandCounter, DemandMeter, LaneCount, refused_hold_s
from serve_app.lease import LeaseReport
from serve_app.policy import PolicyConfig
from serve_app.ray_cluster.registry_actor import RegistryActor
from serve_app.registry import RegistryConfig, RegistryState, SlotSpec
from serve_app.scorer import RuleScorer
from serve_app.snapshot import RequestFeatures

CONFIG = CapacityConfig(is_enabled=True, min_slots=1, max_slots=12, scale_down_delay_s=30.0, node_start_s=20.0)

lane_demands = st.builds(
    LaneDemand,
    model=st.sampled_from(["a", "b"]),
    lane=st.sampled_from(["short", "long"]),
    num_busy_slots=st.integers(0, 6),
    max_rows_per_actor=st.integers(0, 8),
    refused_per_s=st.floats(0, 20),
    hold_s=st.floats(0.01, 30),
    num_warm_slots=st.integers(0, 2),
)
demand_lists = st.lists(lane_demands, max_size=4)


def _more(d: LaneDemand, busy: int, refused: float, warm: int) -> LaneDemand:
    return LaneDemand(d.model, d.lane, d.num_busy_slots + busy, d.max_rows_per_actor, d.refused_per_s + refused,
                      d.hold_s, d.num_warm_slots + warm)


# ---- the planner's properties -----------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(demand_lists, st.integers(0, 12), st.floats(0, 100), st.data())
def test_the_plan_is_monotone_in_demand(demands, wanted, now, data):
    """More busy slots, more refusals or a larger warm pool never asks for fewer slots, whatever came before."""
    previous = CapacityPlan(wanted, wanted, data.draw(st.sampled_from([None, now - 5.0, now - 50.0])),
                            data.draw(st.integers(0, 12)))
    more = [_more(d, data.draw(st.integers(0, 3)), data.draw(st.floats(0, 5)), data.draw(st.integers(0, 1)))
            for d in demands]
    assert plan_slots(demands, previous, now, CONFIG).num_wanted <= plan_slots(more, previous, now, CONFIG).num_wanted


@settings(max_examples=300, deadline=None)
@given(st.lists(demand_lists, min_size=1, max_size=30), st.floats(0.1, 20))
def test_the_plan_stays_within_its_bounds_and_rises_at_once(steps, dt):
    plan, now = None, 0.0
    for demands in steps:
        plan = plan_slots(demands, plan, now, CONFIG)
        need = sum(slots_needed(d, CONFIG) for d in demands)
        assert CONFIG.min_slots <= plan.num_wanted <= CONFIG.max_slots
        assert plan.num_wanted >= min(CONFIG.max_slots, need)  # never below what the demand needs now
        now += dt


@settings(max_examples=300, deadline=None)
@given(st.lists(demand_lists, min_size=2, max_size=30), st.floats(0.1, 20))
def test_the_plan_falls_only_after_the_need_stayed_lower_for_the_delay(steps, dt):
    """Hysteresis: a fall comes only when every need of the last `scale_down_delay_s` was at most the new plan."""
    plan, now, history = None, 0.0, []
    for demands in steps:
        previous = plan
        plan = plan_slots(demands, plan, now, CONFIG)
        history.append((now, plan.num_needed))
        if previous is not None and plan.num_wanted < previous.num_wanted:
            window = [need for t, need in history if now - t <= CONFIG.scale_down_delay_s]
            earlier = [t for t, need in history if need >= previous.num_wanted]
            assert max(window) <= plan.num_wanted
            assert not earlier or now - max(earlier) >= CONFIG.scale_down_delay_s
        now += dt


def test_the_plan_never_goes_below_min_slots_and_returns_to_it_when_demand_ends():
    busy = [LaneDemand("a", "short", 5, 4, 2.0, 3.0)]
    plan = plan_slots(busy, None, 0.0, CONFIG)
    assert plan.num_wanted == 5 + 2  # 2 req/s x 3 s = 6 rows at 4 a slot
    for t in (1.0, 10.0, 29.0):
        plan = plan_slots([], plan, t, CONFIG)
        assert plan.num_wanted == 7, t  # within the delay of the first lower need
    plan = plan_slots([], plan, 31.5, CONFIG)
    assert plan.num_wanted == CONFIG.min_slots == 1


def test_slots_needed_follows_littles_law_at_the_lanes_density():
    assert slots_needed(LaneDemand("a", "short", 2, 0, 0.0, 1.0), CONFIG) == 2
    # 3 refusals/s of 2 s each: 6 rows of concurrency missing; at 4 rows an actor, 2 slots.
    assert slots_needed(LaneDemand("a", "short", 2, 4, 3.0, 2.0), CONFIG) == 4
    # Never run: one row a slot is assumed.
    assert slots_needed(LaneDemand("a", "long", 0, 0, 0.5, 4.0), CONFIG) == 2
    assert slots_needed(LaneDemand("a", "long", 0, 0, 0.0, 4.0, num_warm_slots=1), CONFIG) == 1


def test_ready_in_counts_the_node_start_left_and_an_actor_start():
    assert ready_in_s(None, 10.0, CONFIG, 2.0) is None
    assert ready_in_s(5.0, 10.0, CONFIG, 2.0) == pytest.approx(15.0 + 2.0)
    assert ready_in_s(-100.0, 10.0, CONFIG, 2.0) == 2.0  # a late node is due now
    assert nodes_pending(5, 2, 2) == 2 and nodes_pending(2, 5, 2) == 0 and nodes_pending(3, 0, 0) == 3


def test_bundles_are_one_per_slot_and_the_config_is_checked():
    config = CapacityConfig(is_enabled=True, max_slots=3, slot_bundle=(("zq_slot", 1.0),))
    assert bundles(2, config) == ({"zq_slot": 1.0}, {"zq_slot": 1.0})
    with pytest.raises(ValueError, match="min_slots"):
        CapacityConfig(min_slots=3, max_slots=2)
    with pytest.raises(ValueError, match="max_slots >= 1"):
        CapacityConfig(is_enabled=True)


# ---- demand: the replica's counts and the registry's meter --------------------------------


def test_the_counter_hands_its_counts_over_once_and_takes_back_what_was_not_delivered():
    counter = DemandCounter()
    counter.refused("a", "short", 1.0)
    counter.refused("a", "short", 2.0)
    counts = counter.take()
    assert counts == (LaneCount("a", "short", 2, 3.0),)
    assert counter.take() == ()
    counter.put_back(counts)
    counter.refused("a", "short", 0.5)
    assert counter.take() == (LaneCount("a", "short", 3, 3.5),)


def test_a_refused_requests_hold_is_the_rules_prediction_on_a_hot_actor():
    rule = RuleScorer(decode_s_per_token=0.1, prefill_tokens_per_s=100.0, overhead_s=0.0)
    features = RequestFeatures(model="m", input_tokens=101, max_tokens=20, weight_bytes=1,
                               kv_bytes_per_token=0, workspace_bytes=0)
    # Its prompt (one pass, then 100 tokens at 100/s) and 20 steps of one row.
    assert refused_hold_s(features, rule) == pytest.approx(0.1 + 1.0 + 20 * 0.1, rel=0.01)


def test_the_meter_turns_counts_in_its_window_into_rates_and_mean_holds():
    meter = DemandMeter(window_s=10.0)
    state = RegistryState()
    meter.record((LaneCount("a", "short", 20, 40.0), LaneCount("b", "long", 5, 5.0)), now=100.0)
    # Refusals that began 5 s ago are a rate over those 5 s, not over the whole 10 s window.
    (a, b) = meter.lane_demands(state.snapshot(), 105.0, {"a": 1, "b": 0})
    assert (a.model, a.refused_per_s, a.hold_s, a.num_warm_slots) == ("a", 4.0, 2.0, 1)
    assert (b.model, b.refused_per_s, b.hold_s) == ("b", 1.0, 1.0)
    # ... and never over less than MIN_RATE_SPAN_S: one refusal a moment ago is not a rate of one a second.
    meter.record((LaneCount("c", "short", 1, 1.0),), now=110.5)
    assert meter.lane_demands(state.snapshot(), 110.5, {})[0].refused_per_s == pytest.approx(1 / MIN_RATE_SPAN_S)
    assert a.num_busy_slots == b.num_busy_slots == 0
    assert [d.model for d in meter.lane_demands(state.snapshot(), 111.0, {"a": 1})] == ["c"]  # a, b: out of it


# ---- the registry: demand in, retry-after while a slot is coming --------------------------

FEATURES = RequestFeatures(model="m", input_tokens=10, max_tokens=4, weight_bytes=2_000_000_000,
                           kv_bytes_per_token=1024, workspace_bytes=1 << 20)


def _state(slots: int, config: CapacityConfig, max_batch: int = 32) -> RegistryState:
    state = RegistryState(max_batch=max_batch)
    state.register_slots(SlotSpec(f"n/zq_slot{i}", "n", 1 << 30) for i in range(slots))  # too small for the model
    state.capacity.configure(config)
    return state


def test_a_refusal_with_a_slot_on_its_way_quotes_the_nodes_start_not_the_default():
    config = CapacityConfig(is_enabled=True, max_slots=4, node_start_s=40.0, interval_s=2.0, demand_window_s=10.0)
    policy = PolicyConfig()
    state = _state(0, config)
    first = state.admit(FEATURES, policy, "zq-m-1", "r1", now=1000.0)
    assert isinstance(first, Reject) and first.reason == "no_capacity"
    # Asked within the next planning step: its node's start, then a fresh actor's start and load (the rule's).
    assert first.retry_after_s == pytest.approx(2.0 + 40.0 + 3.0 + 1.0, abs=0.01)
    state.exchange_leases(LeaseReport("r", 10.0, demand=(LaneCount("m", "short", 1, 5.0),)), 1000.5)
    plan = state.capacity.step(1001.0, {"m": 0})  # 0.1 refusals/s x a 5 s hold: half a row, one slot
    assert plan.num_wanted == 1 and state.capacity.short_since == 1001.0
    later = state.admit(FEATURES, policy, "zq-m-2", "r2", now=1021.0)
    assert later.retry_after_s == pytest.approx(20.0 + 4.0, abs=0.01)
    status = state.capacity.status()
    assert (status.num_wanted, status.num_present, status.num_nodes_pending, status.num_refused_for_capacity) == (
        1, 0, 1, 2)
    assert state.summary().num_slots_wanted == 1


def test_planning_off_or_at_max_slots_quotes_no_node():
    policy = PolicyConfig()
    off = _state(0, CapacityConfig())
    assert off.admit(FEATURES, policy, "zq-m-1", "r1", now=10.0).retry_after_s == policy.retry_after_s
    assert off.summary().num_slots_wanted is None
    full = _state(0, CapacityConfig(is_enabled=True, max_slots=1))
    full.register_slots([SlotSpec("n/zq_slot0", "n", 4 << 30)])
    assert not isinstance(full.admit(FEATURES, policy, "zq-m-1", "r1", now=10.0), Reject)
    refused = full.admit(FEATURES, policy, "zq-m-2", "r2", now=10.0)
    # The one slot's running request is what frees a place: no node will come past max_slots.
    assert refused.reason == "no_capacity" and refused.retry_after_s < 30.0
    assert full.capacity.status().num_refused_for_capacity == 0
    # Below max_slots, before the plan rose, the running request's end is quoted (no node is coming yet)...
    coming = _state(0, CapacityConfig(is_enabled=True, max_slots=2, node_start_s=40.0))
    coming.register_slots([SlotSpec("n/zq_slot0", "n", 4 << 30)])
    assert not isinstance(coming.admit(FEATURES, policy, "zq-m-1", "r1", now=10.0), Reject)
    assert coming.admit(FEATURES, policy, "zq-m-2", "r2", now=10.0).retry_after_s < 30.0
    # ... and once the plan asks for a node, that node, not the running request's end: a place that frees
    # goes to the next arrival while the demand is over the capacity.
    coming.exchange_leases(LeaseReport("r", 10.0, demand=(LaneCount("m", "short", 1, 5.0),)), 10.5)
    assert coming.capacity.step(11.0, {"m": 0}).num_wanted == 2
    assert coming.admit(FEATURES, policy, "zq-m-3", "r3", now=12.0).retry_after_s > 40.0
    # A node overdue by a whole node start (the autoscaler cannot add it) is no longer quoted.
    assert coming.admit(FEATURES, policy, "zq-m-4", "r4", now=11.0 + 81.0).retry_after_s < 30.0


def test_busy_slots_count_as_demand_for_the_window_after_they_ran():
    state = _state(3, CapacityConfig(is_enabled=True, max_slots=4, scale_down_delay_s=0.0))
    big = SlotSpec("n/big", "n", 8 << 30)
    state.register_slots([big])
    features = RequestFeatures(model="m", input_tokens=10, max_tokens=4, weight_bytes=1 << 20,
                               kv_bytes_per_token=1024, workspace_bytes=1 << 20)
    decision = state.admit(features, PolicyConfig(), "zq-m-1", "r1", now=10.0)
    assert not isinstance(decision, Reject)
    assert state.capacity.step(11.0, {"m": 0}).num_wanted == 1
    state.finish("zq-m-1", "r1", "complete", 12.0)
    # The busy slot is demand for the window after it ran (a refusal then found it busy), then not.
    assert state.capacity.step(13.0, {"m": 0}).num_wanted == 1
    assert state.capacity.step(11.0 + 20.5, {"m": 0}).num_wanted == 0


def test_planning_off_keeps_no_demand_and_a_grown_cluster_is_not_asked_for_twice():
    off = _state(0, CapacityConfig())
    for t in range(100):
        off.exchange_leases(LeaseReport("r", 10.0, demand=(LaneCount("m", "short", 3, 3.0),)), float(t))
    assert len(off.capacity.meter._counts) == 0
    # Demand for 2 slots on 1: the plan asks for 2; when the second joins (its refusals now served there,
    # busy), the refusals that asked for it are not counted again on top.
    state = _state(0, CapacityConfig(is_enabled=True, max_slots=8, demand_window_s=10.0, scale_down_delay_s=0.0),
                   max_batch=1)
    state.register_slots([SlotSpec("n/zq_slot0", "n", 4 << 30)])
    features = RequestFeatures(model="m", input_tokens=10, max_tokens=4, weight_bytes=1 << 20,
                               kv_bytes_per_token=1024, workspace_bytes=1 << 20)
    state.admit(features, PolicyConfig(max_batch=1), "zq-m-1", "r1", now=100.0)
    state.exchange_leases(LeaseReport("r", 10.0, demand=(LaneCount("m", "short", 1, 1.0),)), 100.0)
    assert state.capacity.step(101.0, {"m": 0}).num_wanted == 2
    state.register_slots([SlotSpec("n2/zq_slot0", "n2", 4 << 30)])
    state.admit(features, PolicyConfig(max_batch=1), "zq-m-2", "r2", now=102.0)
    assert state.capacity.step(102.5, {"m": 0}).num_wanted == 2


def test_a_draining_nodes_slots_leave_admission_and_its_running_rows_stay_booked():
    state = _state(0, CapacityConfig(is_enabled=True, max_slots=4), max_batch=1)
    features = RequestFeatures(model="m", input_tokens=10, max_tokens=4, weight_bytes=1 << 20,
                               kv_bytes_per_token=1024, workspace_bytes=1 << 20)
    policy = PolicyConfig(max_batch=1, max_hot_short_actors=2)
    # Node b runs a request; node c has an idle hot actor; node a is empty. Slots registered one at a
    # time, so each request lands where the test says.
    state.register_slots([SlotSpec("b/zq_slot0", "b", 4 << 30)])
    assert state.admit(features, policy, "zq-m-1", "r1", now=1.0).slot_id == "b/zq_slot0"
    state.register_slots([SlotSpec("c/zq_slot0", "c", 4 << 30)])
    assert state.admit(features, policy, "zq-m-2", "r2", now=1.0).slot_id == "c/zq_slot0"
    state.actor_started("zq-m-2")
    state.finish("zq-m-2", "r2", "complete", 2.0)
    state.register_slots([SlotSpec("a/zq_slot0", "a", 4 << 30)])
    alive = {"zq-m-1", "zq-m-2"}
    # b and c drain. Two passes: on the second the running actor is neither a ghost nor an orphan.
    first = state.reconcile(alive, 3.0, {"a", "b", "c"}, {"b", "c"})
    second = state.reconcile(alive - set(first.to_kill), 4.0, {"a", "b", "c"}, {"b", "c"})
    state.check_invariants()
    assert first.retired == ("zq-m-2",) and not second.to_kill  # the idle actor retires, the running one stays
    assert state.books.actors["zq-m-1"].rows and [s.slot_id for s in state.snapshot().slots] == ["a/zq_slot0"]
    assert state.capacity.num_present == 1
    # Nothing new is placed on a draining node: the next request spawns on a.
    assert state.admit(features, policy, "zq-m-3", "r3", now=5.0).slot_id == "a/zq_slot0"
    # b goes: its slot and its actor leave the books; c stops draining and is admissible again.
    state.reconcile({"zq-m-3"}, 6.0, {"a", "c"}, set())
    state.check_invariants()
    assert list(state.books.slots) == ["a/zq_slot0", "c/zq_slot0"] and state.books.draining == frozenset()
    assert [s.slot_id for s in state.snapshot().slots] == ["a/zq_slot0", "c/zq_slot0"]


# ---- the app's args -----------------------------------------------------------------------


def test_capacity_needs_slots_that_nodes_bring_and_its_bundle_follows_the_slots_kind():
    model = {"id": "m", "demo_preset": "tiny"}
    with pytest.raises(ValueError, match="slots.kind gpu or resource"):
        AppArgs(models=[model], capacity={"is_enabled": True, "max_slots": 2})
    with pytest.raises(ValueError, match="derived from slots.kind"):
        AppArgs(models=[model], capacity={"slot_bundle": [["GPU", 1]]})
    args = AppArgs(models=[model], slots={"kind": "resource", "resource": "zq_slot"},
                   capacity={"is_enabled": True, "max_slots": 2})
    assert ingress_config(args).capacity.slot_bundle == (("zq_slot", 1.0),)
    gpu = AppArgs(models=[model], slots={"kind": "gpu"}, actor={"num_gpus": 1},
                  capacity={"is_enabled": True, "max_slots": 2})
    assert ingress_config(gpu).capacity.slot_bundle == (("GPU", 1.0),)
    # Two actors to a GPU: each slot asks for half of one, so max_slots 4 is 2 GPUs, not 4.
    half = AppArgs(models=[model], slots={"kind": "gpu"}, actor={"num_gpus": 0.5},
                   capacity={"is_enabled": True, "max_slots": 4})
    assert ingress_config(half).capacity.slot_bundle == (("GPU", 0.5),)
    with pytest.raises(ValueError, match="num_gpus > 0"):
        AppArgs(models=[model], slots={"kind": "gpu"}, capacity={"is_enabled": True, "max_slots": 2})



# ---- the registry actor states the plan (its class, without Ray: the loop is not started) -----------


class _Planner(RegistryActor):
    """The registry actor's planning step, with Ray's autoscaler call recorded (or failing on cue)."""

    def _loop(self) -> None:  # no reconcile thread: the test drives `_plan_capacity` itself
        return

    def request_resources(self, wanted):
        if self.is_failing:
            raise ConnectionError("the GCS did not answer")
        self.stated.append(wanted)


def test_the_plan_is_stated_once_again_after_a_failure_and_cleared_when_planning_stops():
    registry = _Planner(RegistryConfig(), PolicyConfig())
    registry.stated, registry.is_failing = [], False
    registry._plan_capacity(0.0)
    assert registry.stated == []  # planning off from the start: nothing is ever stated
    config = CapacityConfig(is_enabled=True, max_slots=2, interval_s=1.0, slot_bundle=(("zq_slot", 1.0),))
    registry.configure(PolicyConfig(), None, config)
    registry._plan_capacity(10.0)
    assert registry.stated == [[]]  # a new registry replaces whatever request an earlier one left standing
    registry.exchange_leases(LeaseReport("r", 10.0, demand=(LaneCount("m", "short", 1, 1.0),)))
    registry.is_failing = True
    with pytest.raises(ConnectionError):
        registry._plan_capacity(20.0)
    registry.is_failing = False
    registry._plan_capacity(30.0)  # not marked stated when Ray did not take it: sent again
    registry._plan_capacity(40.0)  # unchanged: not sent again
    assert registry.stated == [[], [{"zq_slot": 1.0}]]
    registry.configure(PolicyConfig(), None, dataclasses.replace(config, is_enabled=False))
    registry._plan_capacity(50.0)
    registry._plan_capacity(60.0)
    assert registry.stated == [[], [{"zq_slot": 1.0}], []]  # planning turned off: the request is cleared, once
