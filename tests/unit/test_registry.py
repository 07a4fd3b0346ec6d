"""The registry's compare-and-set operations, rows and batches, reconcile, and its books under random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from serve_app.decisions import Bind, Dispatch, Join, Reject, Spawn
from serve_app.demand import refused_hold_s
from serve_app.policy import PolicyConfig
from serve_app.registry import RegistryState, RowReservation, SlotSpec, is_request_actor_name
from serve_app.scorer import RuleScorer
from serve_app.snapshot import RequestFeatures
from serve_app.warm_pool import WarmFill, WarmSpec
from tests.helpers import policy

POLICY = policy(max_batch=32)  # the registry's default cap


def _registry(*totals, **kw) -> RegistryState:
    reg = RegistryState(**kw)
    reg.register_slots(SlotSpec(f"s{i}", "node", total) for i, total in enumerate(totals))
    return reg


def _spawn(slot_id="s0", reserve=600, resident=None, keep_hot=True, lane="short") -> Spawn:
    return Spawn(slot_id, lane, keep_hot, reserve, min(500, reserve) if resident is None else resident)


def _row(request_id="r", deadline=10.0, end=0.0, tokens=0, tpot=None) -> RowReservation:
    """A row; its bytes are set by the commit from the decision."""
    return RowReservation(request_id, tokens, tpot, end, deadline)


def _slot(reg, slot_id="s0"):
    return next(s for s in reg.snapshot().slots if s.slot_id == slot_id)


def _actor(reg, name):
    return next((a for a in reg.snapshot().actors if a.name == name), None)


# ---------------------------------------------------------------- compare-and-set


def test_try_spawn_reserves_only_while_the_slot_has_room():
    reg = _registry(1000, 1000)
    assert reg.try_spawn(_spawn(reserve=600), "a", "m", _row(), now=0)
    assert _slot(reg).reserved_bytes == 600 and _slot(reg).num_actors == 1
    a = _actor(reg, "a")
    assert a.state == "starting" and a.reserved_bytes == 600 and a.resident_bytes == 500
    assert a.num_rows == 1 and a.rows[0].request_bytes == 100
    two = _registry(1000, max_actors_per_slot=2)
    assert two.try_spawn(_spawn(reserve=600), "a", "m", _row(), 0)
    assert not two.try_spawn(_spawn(reserve=401), "b", "m", _row(), 0)  # 400 left
    assert two.try_spawn(_spawn(reserve=400, resident=300), "b", "m", _row(), 0)
    assert _slot(two).free_bytes == 0
    reg.check_invariants()
    two.check_invariants()


def test_try_spawn_respects_the_actor_limit_and_unknown_slots():
    reg = _registry(10_000)
    assert reg.try_spawn(_spawn(), "a", "m", _row(), 0)
    assert not reg.try_spawn(_spawn(), "b", "m", _row(), 0)  # one actor per slot
    assert not reg.try_spawn(_spawn(slot_id="nope"), "c", "m", _row(), 0)
    with pytest.raises(ValueError, match="already registered"):
        reg.try_spawn(_spawn(), "a", "m", _row(), 0)
    reg.check_invariants()


def test_finish_keeps_a_hot_actor_idle_with_its_weights_and_forgets_the_rest():
    reg = _registry(1000, 1000)
    reg.try_spawn(_spawn(reserve=600, resident=500), "hot", "m", _row("r1"), 0)
    reg.try_spawn(_spawn(slot_id="s1", reserve=600, resident=500, keep_hot=False), "cold", "m", _row("r2"), 0)
    assert reg.actor_started("hot") and not reg.actor_started("hot")
    assert not reg.finish("hot", "r1", "complete", now=1)  # nothing to kill
    assert _actor(reg, "hot").state == "idle" and _slot(reg).reserved_bytes == 500
    assert not reg.finish("cold", "r2", "complete", now=1)
    assert _actor(reg, "cold") is None and _slot(reg, "s1").reserved_bytes == 0 and _slot(reg, "s1").num_actors == 0
    # A request ends once: a second finish (or an unknown row) changes nothing.
    assert not reg.finish("hot", "r1", "failed", now=2) and _slot(reg).reserved_bytes == 500
    assert not reg.finish("hot", "other", "failed", now=2) and _actor(reg, "hot") is not None
    reg.check_invariants()


def test_a_failed_row_or_a_cancelled_load_retires_the_actor_a_cancelled_row_only_its_row():
    reg = _registry(2000, 2000)
    reg.try_spawn(_spawn(reserve=600, resident=500), "loading", "m", _row("r1"), 0)
    assert reg.finish("loading", "r1", "cancelled", now=1)  # nobody waits for this load: kill it
    assert _actor(reg, "loading") is None and _slot(reg).reserved_bytes == 0
    reg.try_spawn(_spawn(reserve=600, resident=500), "hot", "m", _row("a"), 0)
    reg.actor_started("hot")
    assert reg.try_join(Join("hot", "s0", "short", 100), _row("b"))
    assert not reg.finish("hot", "a", "cancelled", now=1)  # one row given up: the batch goes on
    assert _actor(reg, "hot").state == "busy" and _slot(reg).reserved_bytes == 600
    assert reg.finish("hot", "b", "failed", now=2)  # a failed actor is not trusted again
    assert _actor(reg, "hot") is None and _slot(reg).reserved_bytes == 0
    reg.check_invariants()


def test_try_dispatch_needs_an_idle_actor_on_that_slot_with_room():
    reg = _registry(1000)
    reg.try_spawn(_spawn(reserve=600, resident=500), "h", "m", _row("r0"), 0)
    assert not reg.try_dispatch(Dispatch("h", "s0", "short", True, 100), _row())  # still starting
    reg.finish("h", "r0", "complete", now=1)
    assert not reg.try_dispatch(Dispatch("h", "s0", "short", True, 501), _row())  # 500 free
    assert not reg.try_dispatch(Dispatch("h", "s1", "short", True, 100), _row())
    assert not reg.try_dispatch(Dispatch("nobody", "s0", "short", True, 100), _row())
    assert reg.try_dispatch(Dispatch("h", "s0", "short", False, 500), _row())
    a = _actor(reg, "h")
    assert a.state == "busy" and not a.is_hot and a.reserved_bytes == 1000
    assert not reg.try_dispatch(Dispatch("h", "s0", "short", True, 0), _row("r2"))  # busy now
    reg.check_invariants()


def test_try_join_needs_a_busy_hot_batch_with_a_free_row_and_room():
    reg = _registry(1000, max_batch=3)
    reg.try_spawn(_spawn(reserve=600, resident=500), "h", "m", _row("r0"), 0)
    assert not reg.try_join(Join("h", "s0", "short", 100), _row("r1"))  # still loading: no batching
    reg.actor_started("h")
    assert not reg.try_join(Join("h", "s0", "short", 401), _row("r1"))  # 400 free
    assert not reg.try_join(Join("nobody", "s0", "short", 10), _row("r1"))
    assert reg.try_join(Join("h", "s0", "short", 150), _row("r1"))
    assert reg.try_join(Join("h", "s0", "short", 150), _row("r2"))
    assert not reg.try_join(Join("h", "s0", "short", 1), _row("r3"))  # max_batch rows
    a = _actor(reg, "h")
    # Exact books: resident + every row's KV and workspace.
    assert a.num_rows == 3 and a.reserved_bytes == 500 + 100 + 150 + 150 == _slot(reg).reserved_bytes
    for rid in ("r1", "r0", "r2"):  # rows leave in any order
        reg.finish("h", rid, "complete", now=1)
        reg.check_invariants()
    assert _actor(reg, "h").state == "idle" and _slot(reg).reserved_bytes == 500  # back to the weights
    assert not reg.try_join(Join("h", "s0", "short", 1), _row("r4"))  # idle: a dispatch, not a join
    reg.try_dispatch(Dispatch("h", "s0", "short", False, 10), _row("r5"))
    assert not reg.try_join(Join("h", "s0", "short", 1), _row("r6"))  # it will not stay hot: no batch
    reg.check_invariants()


def test_admit_decides_and_commits_in_one_call():
    reg = _registry(1100, 1100)
    f = RequestFeatures("m", 10, 10, 1000, 1, 0)  # spawn 1020, dispatch 20
    first = reg.admit(f, POLICY, "a1", "q1", now=0)
    assert first == Spawn("s0", "short", True, 1020, 1000) and _actor(reg, "a1").state == "starting"
    second = reg.admit(f, POLICY, "a2", "q2", now=0)
    assert isinstance(second, Spawn) and second.slot_id == "s1" and not second.keep_hot
    assert reg.admit(f, POLICY, "a3", "q3", now=0).reason == "no_capacity"  # a1 still loading
    reg.actor_started("a1")
    assert reg.admit(f, POLICY, "unused", "q4", now=1) == Join("a1", "s0", "short", 20)
    reg.finish("a1", "q1", "complete", now=1)
    reg.finish("a1", "q4", "complete", now=1)
    assert reg.admit(f, POLICY, "unused", "q5", now=1) == Dispatch("a1", "s0", "short", True, 20)
    assert _actor(reg, "unused") is None
    reg.check_invariants()
    with pytest.raises(ValueError, match="max_actors_per_slot"):
        reg.admit(f, PolicyConfig(max_actors_per_slot=2), "x", "q6", now=1)


def test_a_join_that_does_not_fit_rows_or_bytes_is_refused_at_once():
    policy = PolicyConfig(actor_overhead_bytes=0, max_batch=2, max_hot_short_actors=1)
    f = RequestFeatures("m", 10, 10, 1000, 1, 0)  # spawn 1020, a row 20
    reg = _registry(1050, max_batch=2)
    assert isinstance(reg.admit(f, policy, "a", "q1", now=0), Spawn)
    reg.actor_started("a")
    assert isinstance(reg.admit(f, policy, "b", "q2", now=0), Join)  # 1040 reserved
    full = reg.admit(f, policy, "c", "q3", now=0)  # two rows: the batch is full
    assert isinstance(full, Reject) and full.reason == "no_capacity" and full.retry_after_s is not None
    reg.finish("a", "q2", "complete", now=0)
    big = RequestFeatures("m", 20, 20, 1000, 1, 0)  # a row of 40 bytes; 30 are free
    assert reg.admit(big, policy, "d", "q4", now=0).reason == "no_capacity"
    reg.check_invariants()


def test_a_refusal_says_when_the_running_row_that_makes_room_is_predicted_to_end():
    scorer = RuleScorer(decode_s_per_token=0.1, prefill_tokens_per_s=1000.0, kv_read_bytes_per_s=1e12)
    policy = PolicyConfig(actor_overhead_bytes=0, max_batch=1, max_hot_short_actors=1)
    f = RequestFeatures("m", 10, 30, 1000, 1, 0)
    reg = _registry(1100, max_batch=1)
    spawn = reg.admit(f, policy, "a", "q1", now=100.0, scorer=scorer)
    assert isinstance(spawn, Spawn)
    reg.actor_started("a")
    # Predicted: load and start, then the 10-token prompt (a pass over the weights and 9 tokens more), then
    # 30 tokens at 0.1 s.
    t = spawn.prediction.total_s
    assert t == pytest.approx(scorer.actor_start_s + 1000 / scorer.load_bytes_per_s + 0.1 + 0.009 + 3.0)
    refused = reg.admit(f, policy, "b", "q2", now=101.0, scorer=scorer)
    assert isinstance(refused, Reject) and refused.retry_after_s == pytest.approx(100.0 + t - 101.0)
    # Past its predicted end the row counts as ending now: come back at the earliest.
    late = reg.admit(f, policy, "b", "q2", now=100.0 + t + 5, scorer=scorer)
    assert late.retry_after_s == policy.min_retry_after_s
    reg.finish("a", "q1", "complete", now=100.0 + t)
    assert isinstance(reg.admit(f, policy, "b", "q3", now=100.0 + t, scorer=scorer), Dispatch)


def test_a_refusal_for_a_tpot_target_says_when_enough_rows_end_for_a_join_to_fit():
    # A step of n rows takes 0.1 * (1 + 0.5 (n - 1)) s. Three rows run within their 0.21 s TPOT target; a
    # request of 0.16 s fits only a batch of at most one row before it (a 2-row step, 0.15 s), so it is
    # refused by prediction although max_batch (32) leaves room for 29 more, and it can come back only once
    # two of the three rows have ended. A retry-after counted by max_batch would say "after the first",
    # and the client would only be refused again.
    scorer = RuleScorer(decode_s_per_token=0.1, batch_row_cost=0.5, prefill_tokens_per_s=1e6, kv_read_bytes_per_s=1e15)
    policy = PolicyConfig(actor_overhead_bytes=0, max_batch=32, max_hot_short_actors=1)
    f = RequestFeatures("m", 10, 100, 1000, 1, 0, tpot_target_s=0.21)
    tight = RequestFeatures("m", 10, 100, 1000, 1, 0, tpot_target_s=0.16)
    reg = _registry(100_000, max_batch=32)
    ends = {}
    # The joins come once the first row's actor has started and computed its first token (3.1 s predicted).
    for i, (kind, now) in enumerate(((Spawn, 0.0), (Join, 10.0), (Join, 11.0))):
        d = reg.admit(f, policy, "a", f"q{i}", now=now, scorer=scorer)
        assert isinstance(d, kind), d
        ends[f"q{i}"] = now + d.prediction.total_s
        if i == 0:
            reg.actor_started("a")
    first, second, _ = sorted(ends, key=ends.get)
    refused = reg.admit(tight, policy, "b", "t1", now=12.0, scorer=scorer)
    assert isinstance(refused, Reject) and refused.reason == "latency_target"
    assert refused.retry_after_s == pytest.approx(ends[second] - 12.0)
    reg.finish("a", first, "complete", now=ends[first])
    assert isinstance(reg.admit(tight, policy, "b", "t2", now=ends[first], scorer=scorer), Reject)
    reg.finish("a", second, "complete", now=ends[second])
    assert isinstance(reg.admit(tight, policy, "b", "t3", now=ends[second], scorer=scorer), Join)
    reg.check_invariants()


def test_refused_clients_are_told_successive_places_not_all_the_same_one():
    # One actor, a batch of one row (max_batch 1), three rows' worth of clients refused in turn: the first is
    # told when the running row ends, the next when the row after that is predicted to end (the place after
    # the one already promised), and so on; once a promised instant has passed it no longer counts.
    scorer = RuleScorer(decode_s_per_token=0.1, prefill_tokens_per_s=1000.0, kv_read_bytes_per_s=1e12)
    policy = PolicyConfig(actor_overhead_bytes=0, max_batch=2, max_hot_short_actors=1)
    reg = _registry(100_000, max_batch=2)
    ends = []
    for i, (kind, max_tokens) in enumerate(((Spawn, 100), (Join, 60))):
        now = 0.0 if i == 0 else 10.0
        d = reg.admit(RequestFeatures("m", 10, max_tokens, 1000, 1, 0), policy, "a", f"q{i}", now=now, scorer=scorer)
        assert isinstance(d, kind), d
        ends.append(now + d.prediction.total_s)
        if i == 0:
            reg.actor_started("a")
    f = RequestFeatures("m", 10, 30, 1000, 1, 0)
    gap = refused_hold_s(f, scorer) / 2  # two rows make room: a place every half of the request's hold
    assert max(ends) - min(ends) > gap  # the two known places are further apart than the gap
    told = [reg.admit(f, policy, "b", f"r{i}", now=11.0, scorer=scorer).retry_after_s for i in range(4)]
    assert told[:2] == pytest.approx([min(ends) - 11.0, max(ends) - 11.0])
    # Past the last known place: one more place each gap after it, not that place again.
    assert told[2:] == pytest.approx([max(ends) - 11.0 + gap, max(ends) - 11.0 + 2 * gap])
    # Once the promises have passed, the next refusal is told the earliest place again.
    later = reg.admit(f, policy, "b", "r4", now=max(ends) + 3 * gap, scorer=scorer)
    assert later.retry_after_s == policy.min_retry_after_s  # both rows are past their predicted ends


def test_rows_past_their_predicted_ends_free_places_a_gap_apart_not_all_now():
    # A slowed CPU: both rows have overrun their predictions, so both "end now". Refused clients are still
    # told successive places, each the request's hold over the two rows after the last.
    scorer = RuleScorer(decode_s_per_token=0.1, prefill_tokens_per_s=1000.0, kv_read_bytes_per_s=1e12)
    policy = PolicyConfig(actor_overhead_bytes=0, max_batch=2, max_hot_short_actors=1)
    reg = _registry(100_000, max_batch=2)
    for i, kind in enumerate((Spawn, Join)):
        assert isinstance(reg.admit(RequestFeatures("m", 10, 30, 1000, 1, 0), policy, "a", f"q{i}", now=0.0,
                                    scorer=scorer), kind)
        reg.actor_started("a")
    f = RequestFeatures("m", 10, 30, 1000, 1, 0)
    gap = refused_hold_s(f, scorer) / 2
    told = [reg.admit(f, policy, "b", f"r{i}", now=1000.0, scorer=scorer).retry_after_s for i in range(3)]
    assert told == pytest.approx([policy.min_retry_after_s, gap, 2 * gap])


def test_register_slots_orders_by_id_and_never_shrinks_below_reservations():
    reg = _registry(1000, 1000)
    reg.register_slots([SlotSpec("a-first", "node", 500), SlotSpec("s0", "node2", 2000)])
    assert [s.slot_id for s in reg.snapshot().slots] == ["a-first", "s0", "s1"]
    assert _slot(reg).total_bytes == 2000 and _slot(reg).node_id == "node2"
    reg.try_spawn(_spawn(reserve=1500), "a", "m", _row(), 0)
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
    assert not reg.try_spawn(_spawn(reserve=2000), "a", "m", _row(), 0)
    assert reg.snapshot() is changed  # a failed commit changes nothing
    with pytest.raises(KeyError):
        reg.update_slot_stats("nope", 0, 0)


# ---------------------------------------------------------------- reconcile


def test_reconcile_forgets_ghosts_after_the_grace_and_keeps_young_ones():
    reg = _registry(1000, 1000, spawn_grace_s=5)
    reg.try_spawn(_spawn(), "old", "m", _row(deadline=100), now=0)
    reg.try_spawn(_spawn(slot_id="s1"), "young", "m", _row(deadline=100), now=8)
    report = reg.reconcile(alive=set(), now=10)
    assert report.ghosts == ("old",) and report.released_bytes == 600 and report.to_kill == ()
    assert _actor(reg, "old") is None and _slot(reg).reserved_bytes == 0
    assert _actor(reg, "young") is not None
    assert reg.reconcile(alive={"young"}, now=20).ghosts == ()
    reg.check_invariants()


def test_reconcile_reports_orphans_for_killing():
    reg = _registry(1000)
    reg.try_spawn(_spawn(), "known", "m", _row(deadline=100), 0)
    report = reg.reconcile(alive={"known", "stray-2", "stray-1"}, now=1)
    assert report.orphans == ("stray-1", "stray-2") and report.ghosts == ()
    assert set(report.to_kill) == {"stray-1", "stray-2"} and _actor(reg, "known") is not None


def test_reconcile_reclaims_expired_busy_reservations_and_kills_their_actors():
    reg = _registry(1000, 1000, 1000)
    reg.try_spawn(_spawn(), "stuck", "m", _row(deadline=50), now=0)
    reg.try_spawn(_spawn(slot_id="s1"), "fine", "m", _row(deadline=500), now=0)
    reg.try_spawn(_spawn(slot_id="s2"), "idle", "m", _row(deadline=50), now=0)
    reg.finish("idle", "r", "complete", now=10)  # idle actors hold no deadline
    report = reg.reconcile(alive={"stuck", "fine", "idle"}, now=60)
    assert report.expired == ("stuck",) and report.to_kill == ("stuck",) and report.released_bytes == 600
    assert _actor(reg, "stuck") is None and _slot(reg).reserved_bytes == 0
    assert _actor(reg, "fine") is not None and _actor(reg, "idle") is not None
    reg.check_invariants()


def test_reconcile_retires_actors_idle_for_too_long():
    reg = _registry(1000, 1000, max_idle_s=30)
    for slot, name in (("s0", "stale"), ("s1", "recent")):
        reg.try_spawn(_spawn(slot_id=slot), name, "m", _row(deadline=100), 0)
    reg.finish("stale", "r", "complete", now=10)
    reg.finish("recent", "r", "complete", now=35)
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
    """Random spawn / dispatch / join / warm fill / bind / finish / reconcile / remove / admit; the books
    must always balance, and no warm pool may exceed its size."""

    @initialize(totals=st.lists(st.integers(0, 3000), min_size=1, max_size=4), max_actors=st.integers(1, 2),
                max_batch=st.integers(1, 4), num_warm=st.tuples(st.integers(0, 2), st.integers(0, 2)),
                max_idle_s=st.one_of(st.none(), st.floats(1, 30)))
    def setup(self, totals, max_actors, max_batch, num_warm, max_idle_s):
        self.reg = RegistryState(max_actors_per_slot=max_actors, spawn_grace_s=5.0, max_batch=max_batch,
                                 max_idle_s=max_idle_s)
        self.reg.register_slots(SlotSpec(f"s{i}", "n", t) for i, t in enumerate(totals))
        self.policy = PolicyConfig(short_max_input_tokens=10, short_max_output_tokens=10, max_hot_short_actors=1,
                                   actor_overhead_bytes=0, max_actors_per_slot=max_actors, max_batch=max_batch,
                                   num_warm_short_actors=num_warm[0], num_warm_long_actors=num_warm[1],
                                   max_idle_s=max_idle_s)
        self.now = 0.0
        self.num_names = 0

    def _name(self) -> str:
        self.num_names += 1
        return f"a{self.num_names}"

    def _pick(self, i: int) -> str:
        names = [a.name for a in self.reg.snapshot().actors]
        return names[i % len(names)] if names and i >= 0 else "nobody"

    def _view(self, name: str):
        return next((a for a in self.reg.snapshot().actors if a.name == name), None)

    def _free(self, slot_id: str) -> int:
        return next(s.free_bytes for s in self.reg.snapshot().slots if s.slot_id == slot_id)

    @rule(slot=st.integers(0, 4), reserve=st.integers(0, 2000), resident=st.integers(0, 2000), keep_hot=st.booleans(),
          ttl=st.floats(0, 50))
    def spawn(self, slot, reserve, resident, keep_hot, ttl):
        before = {s.slot_id: s for s in self.reg.snapshot().slots}
        target = before.get(f"s{slot}")
        fits = target is not None and target.free_bytes >= reserve and target.num_actors < self.reg.max_actors_per_slot
        decision = Spawn(f"s{slot}", "short", keep_hot, reserve, min(resident, reserve))
        name = self._name()
        assert self.reg.try_spawn(decision, name, "m", _row(name, self.now + ttl), self.now) == fits

    @rule(i=st.integers(-1, 20), reserve=st.integers(0, 1500), keep_hot=st.booleans(), ttl=st.floats(0, 50))
    def dispatch(self, i, reserve, keep_hot, ttl):
        name = self._pick(i)
        actor = self._view(name)
        slot_id = actor.slot_id if actor else "s0"
        expected = actor is not None and actor.state == "idle" and self._free(slot_id) >= reserve
        row = _row(self._name(), self.now + ttl)
        assert self.reg.try_dispatch(Dispatch(name, slot_id, "short", keep_hot, reserve), row) == expected

    @rule(i=st.integers(-1, 20), reserve=st.integers(0, 1500), ttl=st.floats(0, 50))
    def join(self, i, reserve, ttl):
        name = self._pick(i)
        actor = self._view(name)
        slot_id = actor.slot_id if actor else "s0"
        expected = (actor is not None and actor.state == "busy" and actor.is_hot
                    and actor.num_rows < self.reg.max_batch and self._free(slot_id) >= reserve)
        row = _row(self._name(), self.now + ttl)
        assert self.reg.try_join(Join(name, slot_id, "short", reserve), row) == expected

    @rule(input_tokens=st.integers(1, 20), max_tokens=st.integers(1, 20), weight=st.integers(0, 2000),
          kv=st.integers(0, 20))
    def admit(self, input_tokens, max_tokens, weight, kv):
        f = RequestFeatures("m", input_tokens, max_tokens, weight, kv, 0)
        free_before = sum(s.free_bytes for s in self.reg.snapshot().slots)
        held = {a.name: a.reserved_bytes for a in self.reg.snapshot().actors}
        d = self.reg.admit(f, self.policy, self._name(), self._name(), self.now)
        free_after = sum(s.free_bytes for s in self.reg.snapshot().slots)
        if isinstance(d, Reject):
            assert free_after == free_before
            assert d.retry_after_s is None or (
                self.policy.min_retry_after_s <= d.retry_after_s <= self.policy.max_retry_after_s)
        else:
            evicted = getattr(d, "evict", ())
            assert all(self._view(n) is None for n in evicted)
            assert free_before - free_after == d.reserve_bytes - sum(held[n] for n in evicted)
            if isinstance(d, Bind):
                assert self._view(d.actor_name).state == "starting"

    @rule(resident=st.integers(0, 1500), model=st.sampled_from(["m", "m2"]))
    def fill_warm(self, resident, model):
        free_before = sum(s.free_bytes for s in self.reg.snapshot().slots)
        names = {model: [self._name() for _ in range(4)]}
        fills = self.reg.fill_warm([WarmSpec(model, resident)], self.policy, names, self.now)
        for name, fill in fills:
            view = self._view(name)
            assert view.state == "warming" and not view.is_hot and view.reserved_bytes == resident
            assert fill == WarmFill(model, view.lane, view.slot_id, resident)
        assert free_before - sum(s.free_bytes for s in self.reg.snapshot().slots) == resident * len(fills)

    @rule(i=st.integers(-1, 20))
    def drop_warming(self, i):
        name = self._pick(i)
        view = self._view(name)
        assert self.reg.drop_warming(name) == (view is not None and view.state == "warming")

    @rule(i=st.integers(-1, 20), fraction=st.floats(0, 1))
    def warm_ready(self, i, fraction):
        name = self._pick(i)
        view = self._view(name)
        assert self.reg.warm_ready(name, fraction) == (view is not None and view.state == "warming")

    @rule(i=st.integers(-1, 20), reserve=st.integers(0, 1500), keep_hot=st.booleans(), ttl=st.floats(0, 50))
    def bind(self, i, reserve, keep_hot, ttl):
        name = self._pick(i)
        actor = self._view(name)
        slot_id = actor.slot_id if actor else "s0"
        expected = actor is not None and actor.state in ("warm", "warming") and self._free(slot_id) >= reserve
        row = _row(self._name(), self.now + ttl)
        assert self.reg.try_bind(Bind(name, slot_id, "long", keep_hot, reserve), row) == expected
        if expected:
            view = self._view(name)
            assert view.state == "starting" and view.lane == "long" and view.is_hot == keep_hot

    @rule(i=st.integers(-1, 20))
    def started(self, i):
        self.reg.actor_started(self._pick(i))

    @rule(i=st.integers(-1, 20), k=st.integers(0, 8), outcome=st.sampled_from(["complete", "cancelled", "failed"]))
    def finish(self, i, k, outcome):
        name = self._pick(i)
        view = self._view(name)
        rows = list(self.reg.books.actors[name].rows.values()) if view else []
        row = rows[k % len(rows)] if rows else None
        reserved_before = sum(s.reserved_bytes for s in self.reg.snapshot().slots)
        must_kill = self.reg.finish(name, row.request_id if row else "none", outcome, self.now)
        released = reserved_before - sum(s.reserved_bytes for s in self.reg.snapshot().slots)
        if must_kill:  # everything the actor held goes with it
            assert outcome != "complete" and self._view(name) is None and released == view.reserved_bytes
        elif row is not None:  # the row's bytes, and the actor's own if it exits after its last row
            is_gone = self._view(name) is None
            assert released == row.request_bytes + (view.resident_bytes if is_gone else 0)
            assert not is_gone or (len(rows) == 1 and not view.is_hot)
        else:
            assert released == 0

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

    @invariant()
    def no_pool_exceeds_its_size(self):
        snap = self.reg.snapshot()
        for model in ("m", "m2"):
            for lane in ("short", "long"):
                assert snap.warm_count(model, lane) <= self.policy.num_warm(model, lane)


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_reconcile_removes_a_dead_nodes_slots_and_forgets_their_actors_at_once():
    reg = RegistryState(spawn_grace_s=10.0)
    reg.register_slots([SlotSpec("a", "n1", 1000), SlotSpec("b", "n2", 1000)])
    assert reg.try_spawn(_spawn("b", reserve=600), "on-b", "m", _row(), now=0)
    assert reg.try_spawn(_spawn("a", reserve=600), "on-a", "m", _row("r2"), now=0)
    # on-b is young (within the spawn grace), but its node is gone: nothing will ever run there.
    report = reg.reconcile({"on-a", "on-b"}, now=0.5, alive_nodes={"n1"})
    assert report.ghosts == ("on-b",) and report.lost_slots == ("b",) and report.released_bytes == 600
    assert [s.slot_id for s in reg.snapshot().slots] == ["a"]
    assert [a.name for a in reg.snapshot().actors] == ["on-a"]
    # The next pass sees on-b still listed (Ray has not marked it dead yet): an orphan, killed.
    assert reg.reconcile({"on-a", "on-b"}, now=1.0, alive_nodes={"n1"}).orphans == ("on-b",)
    reg.check_invariants()


def test_abandon_undoes_whatever_an_admission_committed_for_the_request():
    reg = _registry(1000, 1000)
    f = RequestFeatures("m", 10, 10, 500, 1, 0)  # spawn 520 bytes, a row 20
    spawn = reg.admit(f, POLICY, "cold", "r1", now=0.0)
    assert isinstance(spawn, Spawn)
    assert reg.abandon("r1", now=0.1) == ("cold", True)  # never started for anyone: forgotten, killed
    assert _actor(reg, "cold") is None and _slot(reg, "s0").reserved_bytes == 0
    reg.admit(f, POLICY, "hot", "r2", now=0.2)
    reg.actor_started("hot")
    join = reg.admit(f, POLICY, "unused", "r3", now=0.3)
    assert isinstance(join, Join)
    assert reg.abandon("r3", now=0.4) == ("hot", False)  # only the joined row goes
    assert _actor(reg, "hot").num_rows == 1  # r2 runs on
    assert reg.abandon("nobody", now=0.5) is None
    reg.check_invariants()
