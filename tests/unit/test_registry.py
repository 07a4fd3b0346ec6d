"""The registry's compare-and-set operations, reconcile, and its books under random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from serve_app.policy import Dispatch, PolicyConfig, Reject, RequestFeatures, Spawn
from serve_app.registry import RegistryState, SlotSpec, is_request_actor_name

POLICY = PolicyConfig(short_max_input_tokens=100, short_max_output_tokens=50, max_hot_short_actors=1,
                      actor_overhead_bytes=0, max_actors_per_slot=1)


def _registry(*totals, **kw) -> RegistryState:
    reg = RegistryState(**kw)
    reg.register_slots(SlotSpec(f"s{i}", "node", total) for i, total in enumerate(totals))
    return reg


def _spawn(slot_id="s0", reserve=600, resident=None, keep_hot=True, lane="short") -> Spawn:
    return Spawn(slot_id, lane, keep_hot, reserve, min(500, reserve) if resident is None else resident)


def _slot(reg, slot_id="s0"):
    return next(s for s in reg.snapshot().slots if s.slot_id == slot_id)


def _actor(reg, name):
    return next((a for a in reg.snapshot().actors if a.name == name), None)


# ---------------------------------------------------------------- compare-and-set


def test_try_spawn_reserves_only_while_the_slot_has_room():
    reg = _registry(1000, 1000)
    assert reg.try_spawn(_spawn(reserve=600), "a", "m", now=0, busy_deadline=10)
    assert _slot(reg).reserved_bytes == 600 and _slot(reg).num_actors == 1
    assert _actor(reg, "a").state == "starting" and _actor(reg, "a").reserved_bytes == 600
    two = _registry(1000, max_actors_per_slot=2)
    assert two.try_spawn(_spawn(reserve=600), "a", "m", 0, 10)
    assert not two.try_spawn(_spawn(reserve=401), "b", "m", 0, 10)  # 400 left
    assert two.try_spawn(_spawn(reserve=400, resident=300), "b", "m", 0, 10)
    assert _slot(two).free_bytes == 0
    reg.check_invariants()
    two.check_invariants()


def test_try_spawn_respects_the_actor_limit_and_unknown_slots():
    reg = _registry(10_000)
    assert reg.try_spawn(_spawn(), "a", "m", 0, 10)
    assert not reg.try_spawn(_spawn(), "b", "m", 0, 10)  # one actor per slot
    assert not reg.try_spawn(_spawn(slot_id="nope"), "c", "m", 0, 10)
    with pytest.raises(ValueError, match="already registered"):
        reg.try_spawn(_spawn(), "a", "m", 0, 10)
    reg.check_invariants()


def test_finish_keeps_a_hot_actor_idle_with_its_weights_and_forgets_the_rest():
    reg = _registry(1000, 1000)
    reg.try_spawn(_spawn(reserve=600, resident=500), "hot", "m", 0, 10)
    reg.try_spawn(_spawn(slot_id="s1", reserve=600, resident=500, keep_hot=False), "cold", "m", 0, 10)
    assert reg.actor_started("hot") and not reg.actor_started("hot")
    assert reg.finish("hot", stays_hot=True, now=1)
    assert _actor(reg, "hot").state == "idle" and _slot(reg).reserved_bytes == 500
    assert reg.finish("cold", stays_hot=False, now=1)
    assert _actor(reg, "cold") is None and _slot(reg, "s1").reserved_bytes == 0 and _slot(reg, "s1").num_actors == 0
    # A request ends once: a second finish changes nothing.
    assert not reg.finish("hot", stays_hot=False, now=2) and _slot(reg).reserved_bytes == 500
    assert not reg.finish("cold", stays_hot=True, now=2)
    reg.check_invariants()


def test_try_dispatch_needs_an_idle_actor_on_that_slot_with_room():
    reg = _registry(1000)
    reg.try_spawn(_spawn(reserve=600, resident=500), "h", "m", 0, 10)
    assert not reg.try_dispatch(Dispatch("h", "s0", "short", True, 100), 1, 10)  # still starting
    reg.finish("h", stays_hot=True, now=1)
    assert not reg.try_dispatch(Dispatch("h", "s0", "short", True, 501), 1, 10)  # 500 free
    assert not reg.try_dispatch(Dispatch("h", "s1", "short", True, 100), 1, 10)
    assert not reg.try_dispatch(Dispatch("nobody", "s0", "short", True, 100), 1, 10)
    assert reg.try_dispatch(Dispatch("h", "s0", "short", False, 500), 1, 10)
    a = _actor(reg, "h")
    assert a.state == "busy" and not a.is_hot and a.reserved_bytes == 1000
    assert not reg.try_dispatch(Dispatch("h", "s0", "short", True, 0), 1, 10)  # busy now
    reg.check_invariants()


def test_admit_decides_and_commits_in_one_call():
    reg = _registry(1100, 1100)
    f = RequestFeatures("m", 10, 10, 1000, 1, 0)  # spawn 1020, dispatch 20
    first = reg.admit(f, POLICY, "a1", now=0)
    assert first == Spawn("s0", "short", True, 1020, 1000) and _actor(reg, "a1").state == "starting"
    second = reg.admit(f, POLICY, "a2", now=0)
    assert isinstance(second, Spawn) and second.slot_id == "s1" and not second.keep_hot
    assert reg.admit(f, POLICY, "a3", now=0).reason == "no_capacity"
    reg.finish("a1", stays_hot=True, now=1)
    assert reg.admit(f, POLICY, "unused", now=1) == Dispatch("a1", "s0", "short", True, 20)
    assert _actor(reg, "unused") is None
    reg.check_invariants()
    with pytest.raises(ValueError, match="max_actors_per_slot"):
        reg.admit(f, PolicyConfig(max_actors_per_slot=2), "x", now=1)


def test_register_slots_orders_by_id_and_never_shrinks_below_reservations():
    reg = _registry(1000, 1000)
    reg.register_slots([SlotSpec("a-first", "node", 500), SlotSpec("s0", "node2", 2000)])
    assert [s.slot_id for s in reg.snapshot().slots] == ["a-first", "s0", "s1"]
    assert _slot(reg).total_bytes == 2000 and _slot(reg).node_id == "node2"
    reg.try_spawn(_spawn(reserve=1500), "a", "m", 0, 10)
    with pytest.raises(ValueError, match="already reserved"):
        reg.register_slots([SlotSpec("s0", "node", 1499)])
    reg.check_invariants()


def test_snapshots_are_cached_until_something_changes():
    reg = _registry(1000)
    snap = reg.snapshot()
    assert reg.snapshot() is snap
    reg.update_slot_stats("s0", fragmentation=0.25, utilization=0.5)
    changed = reg.snapshot()
    assert changed.version > snap.version and changed.slots[0].fragmentation == 0.25
    assert not reg.try_spawn(_spawn(reserve=2000), "a", "m", 0, 10)
    assert reg.snapshot() is changed  # a failed commit changes nothing
    with pytest.raises(KeyError):
        reg.update_slot_stats("nope", 0, 0)


# ---------------------------------------------------------------- reconcile


def test_reconcile_forgets_ghosts_after_the_grace_and_keeps_young_ones():
    reg = _registry(1000, 1000, spawn_grace_s=5)
    reg.try_spawn(_spawn(), "old", "m", now=0, busy_deadline=100)
    reg.try_spawn(_spawn(slot_id="s1"), "young", "m", now=8, busy_deadline=100)
    report = reg.reconcile(alive=set(), now=10)
    assert report.ghosts == ("old",) and report.released_bytes == 600 and report.to_kill == ()
    assert _actor(reg, "old") is None and _slot(reg).reserved_bytes == 0
    assert _actor(reg, "young") is not None
    assert reg.reconcile(alive={"young"}, now=20).ghosts == ()
    reg.check_invariants()


def test_reconcile_reports_orphans_for_killing():
    reg = _registry(1000)
    reg.try_spawn(_spawn(), "known", "m", 0, 100)
    report = reg.reconcile(alive={"known", "stray-2", "stray-1"}, now=1)
    assert report.orphans == ("stray-1", "stray-2") and report.ghosts == ()
    assert set(report.to_kill) == {"stray-1", "stray-2"} and _actor(reg, "known") is not None


def test_reconcile_reclaims_expired_busy_reservations_and_kills_their_actors():
    reg = _registry(1000, 1000, 1000)
    reg.try_spawn(_spawn(), "stuck", "m", now=0, busy_deadline=50)
    reg.try_spawn(_spawn(slot_id="s1"), "fine", "m", now=0, busy_deadline=500)
    reg.try_spawn(_spawn(slot_id="s2"), "idle", "m", now=0, busy_deadline=50)
    reg.finish("idle", stays_hot=True, now=10)  # idle actors hold no deadline
    report = reg.reconcile(alive={"stuck", "fine", "idle"}, now=60)
    assert report.expired == ("stuck",) and report.to_kill == ("stuck",) and report.released_bytes == 600
    assert _actor(reg, "stuck") is None and _slot(reg).reserved_bytes == 0
    assert _actor(reg, "fine") is not None and _actor(reg, "idle") is not None
    reg.check_invariants()


def test_reconcile_retires_actors_idle_for_too_long():
    reg = _registry(1000, 1000, max_idle_s=30)
    for slot, name in (("s0", "stale"), ("s1", "recent")):
        reg.try_spawn(_spawn(slot_id=slot), name, "m", 0, 100)
    reg.finish("stale", stays_hot=True, now=10)
    reg.finish("recent", stays_hot=True, now=35)
    report = reg.reconcile(alive={"stale", "recent"}, now=45)
    assert report.retired == ("stale",) and report.to_kill == ("stale",) and report.released_bytes == 500
    assert _actor(reg, "recent").state == "idle"
    reg.check_invariants()


def test_request_actor_names_are_told_apart_from_other_zeroqueue_actors():
    assert is_request_actor_name("zq-tiny-0123456789ab")
    assert is_request_actor_name("zq-meta-llama/Llama-3-8B-0123456789ab")
    assert not is_request_actor_name("zq-telemetry-0123456789ab")
    assert not is_request_actor_name("zq-registry")
    assert not is_request_actor_name("zq-registry-test-0123456789ab")
    assert not is_request_actor_name("zq-tiny-0123")
    assert not is_request_actor_name("SERVE_CONTROLLER_ACTOR")


# ---------------------------------------------------------------- random interleavings


class RegistryMachine(RuleBasedStateMachine):
    """Random spawn / dispatch / finish / reconcile / remove / admit; the books must always balance."""

    @initialize(totals=st.lists(st.integers(0, 3000), min_size=1, max_size=4), max_actors=st.integers(1, 2))
    def setup(self, totals, max_actors):
        self.reg = RegistryState(max_actors_per_slot=max_actors, spawn_grace_s=5.0)
        self.reg.register_slots(SlotSpec(f"s{i}", "n", t) for i, t in enumerate(totals))
        self.policy = PolicyConfig(short_max_input_tokens=10, short_max_output_tokens=10, max_hot_short_actors=1,
                                   actor_overhead_bytes=0, max_actors_per_slot=max_actors)
        self.now = 0.0
        self.num_names = 0

    def _name(self) -> str:
        self.num_names += 1
        return f"a{self.num_names}"

    def _pick(self, i: int) -> str:
        names = [a.name for a in self.reg.snapshot().actors]
        return names[i % len(names)] if names and i >= 0 else "nobody"

    @rule(slot=st.integers(0, 4), reserve=st.integers(0, 2000), resident=st.integers(0, 2000), keep_hot=st.booleans(),
          ttl=st.floats(0, 50))
    def spawn(self, slot, reserve, resident, keep_hot, ttl):
        before = {s.slot_id: s for s in self.reg.snapshot().slots}
        target = before.get(f"s{slot}")
        fits = target is not None and target.free_bytes >= reserve and target.num_actors < self.reg.max_actors_per_slot
        decision = Spawn(f"s{slot}", "short", keep_hot, reserve, min(resident, reserve))
        assert self.reg.try_spawn(decision, self._name(), "m", self.now, self.now + ttl) == fits

    @rule(i=st.integers(-1, 20), reserve=st.integers(0, 1500), keep_hot=st.booleans(), ttl=st.floats(0, 50))
    def dispatch(self, i, reserve, keep_hot, ttl):
        name = self._pick(i)
        actor = next((a for a in self.reg.snapshot().actors if a.name == name), None)
        slot_id = actor.slot_id if actor else "s0"
        free = next(s.free_bytes for s in self.reg.snapshot().slots if s.slot_id == slot_id)
        expected = actor is not None and actor.state == "idle" and free >= reserve
        assert self.reg.try_dispatch(Dispatch(name, slot_id, "short", keep_hot, reserve), self.now,
                                     self.now + ttl) == expected

    @rule(input_tokens=st.integers(1, 20), max_tokens=st.integers(1, 20), weight=st.integers(0, 2000),
          kv=st.integers(0, 20))
    def admit(self, input_tokens, max_tokens, weight, kv):
        f = RequestFeatures("m", input_tokens, max_tokens, weight, kv, 0)
        free_before = sum(s.free_bytes for s in self.reg.snapshot().slots)
        d = self.reg.admit(f, self.policy, self._name(), self.now)
        free_after = sum(s.free_bytes for s in self.reg.snapshot().slots)
        if isinstance(d, Reject):
            assert free_after == free_before
        else:
            assert free_before - free_after == d.reserve_bytes

    @rule(i=st.integers(-1, 20))
    def started(self, i):
        self.reg.actor_started(self._pick(i))

    @rule(i=st.integers(-1, 20), stays_hot=st.booleans())
    def finish(self, i, stays_hot):
        self.reg.finish(self._pick(i), stays_hot, self.now)

    @rule(i=st.integers(-1, 20))
    def remove(self, i):
        self.reg.remove(self._pick(i))

    @rule(dt=st.floats(0, 20))
    def tick(self, dt):
        self.now += dt

    @precondition(lambda self: self.num_names > 0)
    @rule(alive_mask=st.integers(0, 2**12), orphans=st.integers(0, 2))
    def reconcile(self, alive_mask, orphans):
        known = {a.name: a for a in self.reg.snapshot().actors}
        alive = {n for k, n in enumerate(known) if alive_mask >> k & 1} | {f"ghost-of-{k}" for k in range(orphans)}
        reserved_before = sum(s.reserved_bytes for s in self.reg.snapshot().slots)
        report = self.reg.reconcile(alive, self.now)
        for name in report.ghosts:
            assert name not in alive and self.now - 5.0 >= 0 and name in known
        for name in known:
            if name not in alive and name not in report.ghosts:
                assert _actor(self.reg, name) is not None  # young: kept
        assert set(report.orphans) == {f"ghost-of-{k}" for k in range(orphans)}
        reserved_after = sum(s.reserved_bytes for s in self.reg.snapshot().slots)
        assert reserved_before - reserved_after == report.released_bytes

    @invariant()
    def books_balance(self):
        self.reg.check_invariants()


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
