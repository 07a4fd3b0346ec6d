"""Leases: rows of hot actors held for one replica at a time — the registry's side, a replica's lease book,
and both under random interleavings of requests, heartbeats, lost answers, silence and failures (start
leases among them; their own cases are tests/unit/test_start_leases.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from serve_app.decisions import Bind, Dispatch, Join, Spawn
from serve_app.lease import LeaseConfig, LeasedRow, LeaseReport, LeaseWant, RowUse, SlowPathLease
from serve_app.lease_book import LeaseBook
from serve_app.policy import PolicyConfig, decide
from serve_app.registry import SUMMARY_MAX_AGE_S, RegistryState, RowReservation, SlotSpec, is_leased_row
from serve_app.scorer import RULE_SCORER
from serve_app.snapshot import RequestFeatures
from serve_app.warm_pool import WarmFill

POLICY = PolicyConfig(short_max_input_tokens=64, short_max_output_tokens=64, max_hot_short_actors=4,
                      actor_overhead_bytes=0, max_actors_per_slot=1, max_batch=4)
RESIDENT, KV_PER_TOKEN = 1000, 10


def _features(tokens: int = 10) -> RequestFeatures:
    return RequestFeatures("m", tokens, tokens, RESIDENT, KV_PER_TOKEN, 0)


def _registry(num_hot: int = 1, slot_bytes: int = 10_000) -> RegistryState:
    """`num_hot` idle hot actors of model m, one a slot."""
    reg = RegistryState(max_actors_per_slot=1, max_batch=POLICY.max_batch)
    reg.register_slots(SlotSpec(f"s{i}", "n", slot_bytes) for i in range(num_hot))
    for i in range(num_hot):
        spawn = Spawn(f"s{i}", "short", True, RESIDENT + 200, RESIDENT)
        assert reg.try_spawn(spawn, f"hot{i}", "m", RowReservation(f"boot{i}", 20, None, 0.0, 10.0), 0.0)
        assert reg.actor_started(f"hot{i}") and not reg.finish(f"hot{i}", f"boot{i}", "complete", 0.0)
    assert all(a.state == "idle" and a.is_hot for a in reg.snapshot().actors)
    return reg


def _want(rows: int, row_bytes: int = 200) -> tuple[LeaseWant, ...]:
    return (LeaseWant("m", "short", rows, row_bytes),)


def _report(replica: str, wanted=(), returned=(), in_use=None, known=()) -> LeaseReport:
    return LeaseReport(replica, 5.0, tuple(returned), dict(in_use or {}), tuple(wanted), frozenset(known))


def _lease_rows(reg: RegistryState, replica: str | None = None):
    return [(a, r) for a in reg.books.actors.values() for r in a.rows.values()
            if r.is_lease and (replica is None or r.replica_id == replica)]


def _slow_path(reg: RegistryState, book: LeaseBook, request_id: str, now: float) -> Join | Dispatch:
    """A request the book's leases could not place, admitted by the registry on a hot actor: the row is
    leased to the book's replica from the start."""
    d = reg.admit(_features(), POLICY, "unused", request_id, now, replica_id=book.replica_id,
                  lease=SlowPathLease(book.ttl_s))
    assert is_leased_row(d), d
    book.add(LeasedRow(request_id, d.actor_name, "m", d.slot_id, "short", d.reserve_bytes, RESIDENT), _features(),
             predicted_end=now + 2, now=now)
    return d


# ---------------------------------------------------------------- the registry's side


def test_rows_are_granted_up_to_the_want_spread_over_batches_and_held_like_any_row():
    reg = _registry(num_hot=2)
    grant = reg.exchange_leases(_report("A", _want(3)), now=1.0)
    assert len(grant.granted) == 3 and grant.held == {r.row_id for r in grant.granted}
    assert sorted(sum(1 for r in grant.granted if r.actor_name == n) for n in ("hot0", "hot1")) == [1, 2]
    assert all(r.row_bytes == 200 and r.resident_bytes == RESIDENT for r in grant.granted)
    # Held like rows: the slot's bytes and the batch's places; the actor is busy, never evicted idle.
    assert sum(s.reserved_bytes for s in reg.snapshot().slots) == 2 * RESIDENT + 3 * 200
    assert all(a.state == "busy" for a in reg.snapshot().actors)
    reg.check_invariants()
    # Nothing runs in them: the counts a dashboard shows say so.
    assert grant.summary.num_rows == 0 and grant.summary.actors["idle"] == 2
    # Asking again for what it holds grants nothing more.
    again = reg.exchange_leases(_report("A", _want(3), known=grant.held), now=2.0)
    assert again.granted == () and again.held == grant.held


def test_the_gauges_counts_are_one_snapshot_a_second_whatever_the_number_of_replicas():
    reg = _registry(num_hot=2)
    first = reg.exchange_leases(_report("A"), now=10.0)
    _slow_path(reg, LeaseBook(LeaseConfig(), "B", POLICY.max_batch, 1.0), "r1", now=10.2)  # a row now runs
    # Other replicas' heartbeats within the second share the counts (no snapshot of the cluster each).
    assert reg.exchange_leases(_report("B"), now=10.5).summary is first.summary
    later = reg.exchange_leases(_report("C"), now=10.0 + SUMMARY_MAX_AGE_S)
    assert later.summary is not first.summary and later.summary.num_rows == 1


def test_a_batch_is_never_leased_past_max_batch_nor_a_slot_past_its_bytes():
    reg = _registry(num_hot=1, slot_bytes=RESIDENT + 450)
    grant = reg.exchange_leases(_report("A", _want(10, row_bytes=100)), now=1.0)
    assert len(grant.granted) == POLICY.max_batch  # 4 rows of 100 fit in 450
    other = reg.exchange_leases(_report("B", _want(2, row_bytes=40)), now=1.0)
    assert other.granted == ()  # the batch is full: B's requests take the slow path
    reg.check_invariants()


def test_returned_rows_go_back_and_an_actor_left_with_none_is_idle_again():
    reg = _registry()
    grant = reg.exchange_leases(_report("A", _want(2)), now=1.0)
    first, second = sorted(grant.held)
    after = reg.exchange_leases(_report("A", returned=[first], known={second}), now=2.0)
    assert after.held == {second}
    reg.exchange_leases(_report("A", returned=[second]), now=3.0)
    assert _lease_rows(reg) == [] and reg.snapshot().actors[0].state == "idle"
    # Another replica cannot give back a row that is not its own.
    grant = reg.exchange_leases(_report("A", _want(1)), now=4.0)
    reg.exchange_leases(_report("B", returned=list(grant.held)), now=4.0)
    assert {r.request_id for _, r in _lease_rows(reg, "A")} == grant.held


def test_uses_are_recorded_and_what_others_run_comes_back_for_predictions():
    reg = _registry()
    a = reg.exchange_leases(_report("A", _want(2)), now=1.0)
    b = reg.exchange_leases(_report("B", _want(1)), now=1.0)
    row_a = sorted(a.held)[0]
    reg.exchange_leases(_report("A", in_use={row_a: RowUse(77, 0.05, 9.0)}, known=a.held, wanted=_want(2)), now=2.0)
    view = next(v for v in reg.snapshot().actors[0].rows if v.num_tokens == 77)
    assert view.tpot_target_s == 0.05 and view.predicted_end == 9.0
    seen_by_b = reg.exchange_leases(_report("B", known=b.held, wanted=_want(1)), now=2.0)
    (batch,) = seen_by_b.batches
    assert [r.num_tokens for r in batch.other_rows] == [77]  # A's free row is not a request


def test_a_free_row_the_replica_never_heard_of_is_taken_back_but_a_row_an_admission_placed_is_kept():
    reg = _registry()
    lost = reg.exchange_leases(_report("A", _want(1)), now=1.0)  # the answer never reaches A
    d = reg.admit(_features(), POLICY, "unused", "req-1", 1.5, replica_id="A", lease=SlowPathLease(5.0))
    assert isinstance(d, (Join, Dispatch)) and is_leased_row(d)  # A has not seen this answer yet either
    grant = reg.exchange_leases(_report("A", _want(2)), now=2.0)
    assert not (lost.held & grant.held) and "req-1" in grant.held
    reg.check_invariants()


def test_a_lease_not_renewed_expires_without_killing_its_actor_and_a_silent_replicas_rows_return():
    reg = _registry(num_hot=2)
    reg.exchange_leases(_report("A", _want(1)), now=1.0)
    reg.exchange_leases(_report("B", _want(2)), now=5.0)
    report = reg.reconcile({"hot0", "hot1"}, now=6.5)  # A's lease (ttl 5 s) ran out at 6.0
    assert report.to_kill == () and {r.replica_id for _, r in _lease_rows(reg)} == {"B"}
    assert reg.release_rows_of({"B"}, now=7.0) == []  # hot actors stay, idle
    assert _lease_rows(reg) == [] and {a.state for a in reg.snapshot().actors} == {"idle"}
    reg.check_invariants()


def test_the_slow_path_leases_a_hot_row_to_its_replica_and_abandoning_it_gives_it_back():
    reg = _registry()
    d = reg.admit(_features(), POLICY, "unused", "req-1", 1.0, replica_id="A", lease=SlowPathLease(5.0))
    assert isinstance(d, Dispatch) and d.keep_hot
    ((actor, row),) = _lease_rows(reg, "A")
    assert row.request_id == "req-1" and row.num_tokens == 20 and row.busy_deadline == 6.0
    assert reg.abandon("req-1", now=1.1) == ("hot0", False)
    assert _lease_rows(reg) == [] and reg.snapshot().actors[0].state == "idle"
    # Without a ttl the row is an ordinary one, ended by `finish`.
    reg.admit(_features(), POLICY, "unused", "req-2", 2.0, replica_id="A")
    assert _lease_rows(reg) == []


def test_a_new_registry_re_adopts_leases_as_rows():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, book, "req-0", 0.0)
    _exchanged(reg, book, now=1.0)
    assert book.num_rows == 2  # the row in use, and one spare
    held = {r.request_id for r in book.handed_over()}
    fresh = RegistryState(max_actors_per_slot=1, max_batch=POLICY.max_batch)
    fresh.register_slots([SlotSpec("s0", "n", 10_000)])
    assert set(fresh.adopt(book.handed_over(), now=2.0)) == held
    assert {r.request_id for _, r in _lease_rows(fresh, "A")} == held
    assert sum(1 for _, r in _lease_rows(fresh) if r.num_tokens) == 1
    fresh.check_invariants()


def test_a_slow_path_that_finds_no_room_recalls_a_row_another_replica_left_free():
    reg = _registry()  # one hot actor of 4 rows
    a = LeaseBook(LeaseConfig(headroom_rows=2), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, a, "A-0", 0.0)
    _exchanged(reg, a, now=0.5)
    assert a.num_rows == 3 and a.num_free == 2  # A's peak of 1, and two spare
    assert is_leased_row(reg.admit(_features(), POLICY, "unused", "B-0", 1.0, replica_id="B",
                                   lease=SlowPathLease(5.0)))  # the batch's last unleased row
    # The batch is full with two of A's rows free: B's next requests take them back instead of a refusal.
    for i in (1, 2):
        d = reg.admit(_features(), POLICY, "unused", f"B-{i}", 1.0, replica_id="B", lease=SlowPathLease(5.0))
        assert isinstance(d, Join) and reg.counters["recalled"] == i
    assert len(reg.leases.recalled["A"]) == 2
    # A row in use is never recalled: now the batch is full.
    assert reg.admit(_features(), POLICY, "unused", "B-3", 1.0, replica_id="B",
                     lease=SlowPathLease(5.0)).reason == "no_capacity"
    _exchanged(reg, a, now=1.5)  # A is told
    assert {r.request_id for r in a.handed_over()} == {"A-0"}
    _exchanged(reg, a, now=2.5)  # and its next report shows it forgot them
    assert "A" not in reg.leases.recalled
    reg.check_invariants()


def test_while_a_model_is_contended_its_holders_keep_no_spare_and_give_each_row_back_as_it_frees():
    reg = _registry()  # one hot actor of 4 rows
    a = LeaseBook(LeaseConfig(headroom_rows=1), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, a, "A-0", 0.0)
    _slow_path(reg, a, "A-1", 0.0)
    assert _exchanged(reg, a, now=0.5).contended == frozenset() and a.num_rows == 3  # two in use, one spare
    for i in (0, 1):  # B takes the spare back, then the batch is full
        reg.admit(_features(), POLICY, "unused", f"B-{i}", 1.0, replica_id="B", lease=SlowPathLease(5.0))
    assert reg.admit(_features(), POLICY, "unused", "B-2", 1.0, replica_id="B",
                     lease=SlowPathLease(5.0)).reason == "no_capacity"
    assert _exchanged(reg, a, now=1.5).contended == {"m"}
    assert a.release("A-0") is True and a.num_rows == 1  # forgotten here: the caller gives it back now
    reg.leases.give_back("A", "A-0", now=1.6)
    assert is_leased_row(reg.admit(_features(), POLICY, "unused", "B-3", 1.7, replica_id="B",
                                   lease=SlowPathLease(5.0)))
    _exchanged(reg, a, now=10.0)  # no refusal for a ttl: not contended any more, a row stays when it frees
    assert a.release("A-1") is False and a.num_rows == 1
    reg.check_invariants()


# ---------------------------------------------------------------- a replica's lease book


def _place(book: LeaseBook, features: RequestFeatures | None = None, now: float = 0.5):
    view = book.view(features or _features(), now)
    assert view is not None
    d = decide(features or _features(), view, POLICY)
    assert isinstance(d, (Join, Dispatch)), d
    return d


def _exchanged(reg: RegistryState, book: LeaseBook, now: float):
    report = book.report(now)
    grant = reg.exchange_leases(report, now)
    book.apply(report, grant, sent_at=now)
    return grant


def test_a_book_asks_for_its_peak_plus_headroom_and_gives_back_the_rest_after_the_window():
    reg = _registry(num_hot=2)
    book = LeaseBook(LeaseConfig(headroom_rows=1, demand_window_s=5.0), "A", POLICY.max_batch, heartbeat_s=1.0)
    assert book.view(_features(), now=0.0) is None  # nothing held yet: the slow path
    # Two requests through the slow path become two leased rows in use; their peak asks for one more.
    for i in range(2):
        _slow_path(reg, book, f"req-{i}", 0.0)
    assert _exchanged(reg, book, now=1.0).granted and book.num_rows == 3 and book.num_free == 1
    book.release("req-0")
    book.release("req-1")
    assert _exchanged(reg, book, now=2.0).granted == () and book.num_rows == 3  # the peak is still in the window
    # A request fits a free row: decided here, no registry call.
    d = _place(book, now=2.5)
    row = book.take(d, _features(), predicted_end=3.0, now=2.5)
    assert row.actor_name == d.actor_name and book.num_free == 2
    book.release(row.row_id)
    _exchanged(reg, book, now=7.0)  # the window holds only the last take: one in use, plus one
    assert book.num_rows == 2
    _exchanged(reg, book, now=20.0)
    assert book.num_rows == 0 and _lease_rows(reg) == []


def test_a_request_larger_than_every_free_row_or_leases_past_their_time_take_the_slow_path():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, book, "req-0", 0.0)
    _exchanged(reg, book, now=0.0)
    assert book.view(_features(tokens=10), now=0.5) is not None
    assert book.view(_features(tokens=30), now=0.5) is None  # its KV does not fit a 200-byte row
    assert book.view(_features(), now=4.0) is not None
    assert book.view(_features(), now=4.1) is None  # ttl 5 heartbeats, less one: unrenewed, unused


def test_a_failed_actor_takes_every_lease_on_it_with_it():
    reg = _registry(num_hot=2)
    a = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    b = LeaseBook(LeaseConfig(), "B", POLICY.max_batch, heartbeat_s=1.0)
    for book in (a, b):
        _slow_path(reg, book, f"{book.replica_id}-0", 0.0)
        _exchanged(reg, book, now=0.0)
    row = next(iter(a.handed_over()))
    assert reg.finish(row.actor_name, row.request_id, "failed", now=1.0)  # killed
    a.drop_actor(row.actor_name)
    _exchanged(reg, b, now=1.0)
    assert all(r.actor_name != row.actor_name for r in b.handed_over())
    reg.check_invariants()


# ---------------------------------------------------------------- random interleavings


class LeaseMachine(RuleBasedStateMachine):
    """Two replicas' lease books and one registry: requests placed on leases (start leases included) or by the
    slow path, warm actors readied, first tokens, rows released, heartbeats (some answers lost), silence,
    expiry and failed actors, in any order. A row a replica may use is always held for it alone, an unused
    start lease is what its holder thinks it is, and the books always balance."""

    @initialize(num_hot=st.integers(1, 3), num_spare=st.integers(0, 2), headroom=st.integers(0, 2))
    def setup(self, num_hot, num_spare, headroom):
        self.reg = _registry(num_hot=num_hot, slot_bytes=RESIDENT + 4 * 300)
        self.reg.register_slots(SlotSpec(f"spare{i}", "n", RESIDENT + 4 * 300) for i in range(num_spare))
        self.books = {r: LeaseBook(LeaseConfig(headroom_rows=headroom), r, POLICY.max_batch, heartbeat_s=1.0)
                      for r in ("A", "B")}
        self.now = 1.0
        self.num_requests = 0
        self.num_warm = 0

    @rule()
    def warm_actor_ready(self):
        """A warm actor fills an empty slot (the pool's), ready to bind."""
        empty = [s for s in self.reg.books.slots.values() if s.num_actors == 0]
        if empty:
            self.num_warm += 1
            name = f"warm{self.num_warm}"
            assert self.reg.warm.try_warm(WarmFill("m", "short", empty[0].slot_id, RESIDENT), name, self.now)
            self.reg.warm_ready(name, 0.5)

    @rule(replica=st.sampled_from("AB"), tokens=st.integers(1, 14))
    def request(self, replica, tokens):
        book, f = self.books[replica], _features(tokens)
        self.num_requests += 1
        if book.place(f, POLICY, RULE_SCORER, self.now, now=self.now) is not None:
            return  # a row of a hot batch, or a start lease's bind or spawn: no registry call
        request_id = f"{replica}-req-{self.num_requests}"
        d = self.reg.admit(f, POLICY, f"spawn-{self.num_requests}", request_id, self.now, replica_id=replica,
                           lease=SlowPathLease(book.ttl_s, book.give_back_free("m")))
        if is_leased_row(d):
            book.add(LeasedRow(request_id, d.actor_name, "m", d.slot_id, d.lane, d.reserve_bytes, RESIDENT), f,
                     self.now + 1, now=self.now)
        elif not hasattr(d, "reason"):  # a spawn or bind: an ordinary row, ended by finish
            if isinstance(d, (Bind, Spawn)):
                book.note_start("m", d.lane, f.dispatch_bytes, RESIDENT, POLICY.max_hot("m", d.lane), 0, self.now)
            self.reg.actor_started(d.actor_name) if hasattr(d, "actor_name") else None
            self.reg.finish(getattr(d, "actor_name", f"spawn-{self.num_requests}"), request_id, "complete", self.now)

    @rule(replica=st.sampled_from("AB"), k=st.integers(0, 8))
    def release(self, replica, k):
        used = sorted(self.books[replica]._used)
        if used and self.books[replica].release(used[k % len(used)]):  # contended: given back at once
            self.reg.leases.give_back(replica, used[k % len(used)], self.now)

    @rule(replica=st.sampled_from("AB"), n=st.integers(2, 6))
    def burst(self, replica, n):
        """Requests one after another with none ending: the leased rows run out, and start leases are used."""
        for _ in range(n):
            self.request(replica, 10)

    @rule(replica=st.sampled_from("AB"), k=st.integers(0, 8))
    def first_token(self, replica, k):
        """A start lease's actor, bound or spawned, sends its first token."""
        book = self.books[replica]
        used = sorted(r for r in book._used if r in book._rows and book._rows[r].start)
        if used:
            book.started(used[k % len(used)])

    @rule(replica=st.sampled_from("AB"), is_answer_lost=st.booleans())
    def heartbeat(self, replica, is_answer_lost):
        book = self.books[replica]
        report = book.report(self.now)
        grant = self.reg.exchange_leases(report, self.now)
        if not is_answer_lost:
            book.apply(report, grant, sent_at=self.now)
            for row_id in book.give_back_contended():
                self.reg.leases.give_back(replica, row_id, self.now)

    @rule(dt=st.floats(0.1, 4.0))
    def tick(self, dt):
        self.now += dt
        self.reg.reconcile({a.name for a in self.reg.snapshot().actors}, self.now)

    @precondition(lambda self: any(b.num_rows for b in self.books.values()))
    @rule(replica=st.sampled_from("AB"))
    def actor_fails(self, replica):
        rows = self.books[replica].handed_over()
        if rows:
            self.reg.finish(rows[0].actor_name, rows[0].request_id, "failed", self.now)
            self.books[replica].drop_actor(rows[0].actor_name)

    @invariant()
    def a_usable_row_is_held_for_its_replica_alone(self):
        if not hasattr(self, "reg"):
            return
        held = {r.request_id: r.replica_id for _, r in _lease_rows(self.reg)}
        for replica, book in self.books.items():
            if not book.is_valid(self.now):
                continue
            recalled = self.reg.leases.recalled.get(replica, set())
            for row in book.handed_over():
                if row.actor_name in self.reg.books.actors and row.request_id not in recalled:
                    # (a failed actor's rows fail with it; a recalled row's holder is told at its next exchange)
                    assert held.get(row.request_id) == replica, (row, held)
            for row in book._rows.values():  # an unused start lease is, in the registry, what its holder thinks
                actor = self.reg.books.actors.get(row.actor_name)
                if row.start and row.row_id not in book._used and row.row_id not in book._start_uses and actor:
                    assert (actor.state, actor.start_lease) == ("starting", row.start), (row, actor)
        self.reg.check_invariants()


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_leased_rows_prompt_counts_as_pending_for_joiners_until_its_first_token():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, book, "req-0", 0.0)  # a 10-token prompt, running in a leased row
    _exchanged(reg, book, now=0.0)
    [actor] = book.view(_features(), now=0.5).actors
    assert actor.pending_prompt_tokens == 10  # a joiner's prompt would share the steps with it
    book.prompt_done("req-0")
    [actor] = book.view(_features(), now=0.5).actors
    assert actor.pending_prompt_tokens == 0 and actor.num_rows == 1


def test_a_leased_actors_view_carries_the_step_correction_its_engine_last_reported():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, book, "req-0", 0.0)
    _exchanged(reg, book, now=0.0)
    [actor] = book.view(_features(), now=0.5).actors
    assert actor.step_correction == 1.0  # nothing heard yet: the rule's own
    book.note_step_correction(actor.name, 1.8, now=0.5)  # a Started: its steps run 1.8x the rule's
    book.note_step_correction("not-ours", 3.0, now=0.5)  # an actor this replica holds no row of: not kept
    [actor] = book.view(_features(), now=0.5).actors
    assert actor.step_correction == 1.8
    assert "not-ours" not in book._step_corrections
    # Unheard since, it fades back to the rule's own: an actor left alone is tried again.
    _exchanged(reg, book, now=10.0)
    [actor] = book.view(_features(), now=10.5).actors
    assert actor.step_correction == pytest.approx(1.0 + 0.8 * 0.5)


def test_a_prompt_overdue_on_an_actor_prices_the_next_join_there_by_how_late_it_is():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    d = reg.admit(_features(), POLICY, "unused", "req-0", 0.0, replica_id="A", lease=SlowPathLease(book.ttl_s))
    d = dataclasses.replace(d, candidate=dataclasses.replace(d.candidate, step_correction=2.0),
                            prediction=dataclasses.replace(d.prediction, ttft_s=0.5))  # priced at 2x the rule
    book.add(LeasedRow("req-0", d.actor_name, "m", d.slot_id, "short", d.reserve_bytes, RESIDENT), _features(),
             predicted_end=2.0, now=0.0, decision=d)
    book.note_step_correction(d.actor_name, 2.0, 2.0, now=0.0)
    _exchanged(reg, book, now=0.0)
    [actor] = book.view(_features(), now=0.4).actors
    assert actor.step_correction == 2.0  # its first token is not due yet
    [actor] = book.view(_features(), now=2.0).actors
    assert actor.step_correction == pytest.approx(2.0 * 2.0 / 0.5)  # 2 s for what was priced at 0.5 s: 4x as slow
    report = book.report(now=2.0)
    assert report.step_corrections[d.actor_name] == pytest.approx(8.0)  # the registry's slow path hears it too
    book.prompt_done("req-0")  # its first token came: the actor's own figure again
    [actor] = book.view(_features(), now=2.0).actors
    assert actor.step_correction == 2.0


def test_a_row_placed_by_the_slow_path_seeds_the_books_figure_for_an_actor_it_had_forgotten():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    d = reg.admit(_features(), POLICY, "unused", "req-0", 0.0, replica_id="A", lease=SlowPathLease(book.ttl_s))
    d = dataclasses.replace(d, candidate=dataclasses.replace(d.candidate, step_correction=3.9),  # the registry's
                            prediction=dataclasses.replace(d.prediction, ttft_s=0.5))
    book.add(LeasedRow("req-0", d.actor_name, "m", d.slot_id, "short", d.reserve_bytes, RESIDENT), _features(),
             predicted_end=2.0, now=0.0, decision=d)
    _exchanged(reg, book, now=0.0)
    [actor] = book.view(_features(), now=0.1).actors
    assert actor.step_correction == 3.9  # before its Started: the figure the registry priced it with, not 1
    book.note_step_correction(d.actor_name, 4.2, 3.8, now=0.2)  # its Started, when it comes, takes over
    [actor] = book.view(_features(), now=0.2).actors
    assert actor.step_correction == 4.2


def test_rows_granted_on_an_actor_come_with_its_long_run_figure_as_the_registry_heard_it():
    reg = _registry()
    reg.books.actors["hot0"].step_baseline = 3.6  # fp32 on an AVX2 host, as an earlier holder reported it
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    report = dataclasses.replace(book.report(0.0), wanted=_want(2))  # it asks for two rows
    book.apply(report, reg.exchange_leases(report, now=0.0), sent_at=0.0)
    [actor] = book.view(_features(), now=0.1).actors
    assert actor.step_correction == 3.6  # no Started heard here yet: the registry's figure, not the rule's 1


def test_a_slow_path_admission_carries_the_replicas_corrections_as_they_stand_now():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    d = _slow_path(reg, book, "req-0", 0.0)
    assert reg.books.actors[d.actor_name].step_correction == 1.0
    # Between two exchanges the replica's leases refused a join there on a figure of 8 (an overdue prompt): the
    # registry decides the fallback on that figure, not on the one of the last heartbeat.
    lease = SlowPathLease(book.ttl_s, step_corrections={d.actor_name: 8.0, "an-actor-not-ours": 5.0})
    reg.admit(_features(), POLICY, "unused", "req-1", 0.2, replica_id="A", lease=lease)
    assert reg.books.actors[d.actor_name].step_correction == 8.0
    assert book.step_corrections(now=0.2) == {d.actor_name: 1.0}  # what a replica sends: its actors' figures
    reg.check_invariants()


def test_the_registry_counts_a_rows_prompt_until_its_holder_reports_its_first_token_and_hears_its_correction():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    d = _slow_path(reg, book, "req-0", 0.0)
    [actor] = reg.snapshot().actors
    assert actor.pending_prompt_tokens == 10 and actor.step_correction == 1.0  # from its admission on
    _exchanged(reg, book, now=0.5)
    [actor] = reg.snapshot().actors
    assert actor.pending_prompt_tokens == 10  # still computing its prompt, as its holder reports
    book.note_step_correction(d.actor_name, 1.6, now=1.0)  # its Started: the actor's steps run 1.6x the rule's
    book.prompt_done("req-0")
    _exchanged(reg, book, now=1.0)
    [actor] = reg.snapshot().actors
    assert actor.pending_prompt_tokens == 0 and actor.step_correction == 1.6
    reg.check_invariants()


def test_an_actor_left_idle_is_priced_by_its_long_run_steps_again_not_by_its_last_batchs():
    reg = _registry()
    d = reg.admit(_features(), POLICY, "unused", "req-0", 0.0)  # no lease: it ends through the registry
    reg.books.actors[d.actor_name].step_correction = 2.5  # as a replica last reported its batch's steps
    assert not reg.finish(d.actor_name, "req-0", "complete", 1.0)
    [actor] = reg.snapshot().actors
    assert actor.state == "idle" and actor.step_correction == 1.0  # no long-run figure heard: the rule's own
    d = reg.admit(_features(), POLICY, "unused", "req-1", 2.0)
    record = reg.books.actors[d.actor_name]
    record.step_correction, record.step_baseline = 5.0, 3.6  # a burst's steps, on a machine 3.6x the constants'
    assert not reg.finish(d.actor_name, "req-1", "complete", 3.0)
    [actor] = reg.snapshot().actors
    assert actor.state == "idle" and actor.step_correction == 3.6
    reg.check_invariants()


def test_a_correction_unheard_fades_to_the_actors_long_run_figure_which_the_registry_hears_too():
    reg = _registry()
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, book, "req-0", 0.0)
    _exchanged(reg, book, now=0.0)
    [actor] = book.view(_features(), now=0.5).actors
    # fp32 steps where the rule's constants are bf16's: 3.6x as a rule, 5x in the burst that just ran
    book.note_step_correction(actor.name, 5.0, 3.6, now=0.5)
    _exchanged(reg, book, now=0.5)
    record = reg.books.actors[actor.name]
    assert (record.step_correction, record.step_baseline) == (5.0, 3.6)
    _exchanged(reg, book, now=100.0)  # unheard for 10 half-lives: back to its long-run figure, not the rule's 1
    [actor] = book.view(_features(), now=100.5).actors
    assert actor.step_correction == pytest.approx(3.6, abs=0.01)


def test_a_slow_path_decision_sees_the_prompts_the_replica_placed_on_its_leases_since_its_last_report():
    reg = _registry()
    book = LeaseBook(LeaseConfig(headroom_rows=1), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, book, "req-0", 0.0)
    book.prompt_done("req-0")
    _exchanged(reg, book, now=0.5)  # req-0 decoding; one more row leased, free
    assert book.num_free == 1
    row = book.take(_place(book, now=0.6), _features(), predicted_end=3.0, now=0.6)  # no registry call
    [actor] = reg.snapshot().actors
    assert actor.pending_prompt_tokens == 0  # the registry has not heard of it yet
    # The next request takes the slow path: its admission carries the replica's rows in use.
    reg.admit(_features(), POLICY, "unused", "req-2", 0.7, replica_id="A",
              lease=SlowPathLease(book.ttl_s, (), book.in_use("m")))
    held = reg.books.leased_to("A")
    assert held[row.row_id][1].pending_prompt_tokens == 10 and held[row.row_id][1].num_tokens == 20
    reg.check_invariants()


def test_a_long_request_the_policy_would_refuse_recalls_a_short_lane_actor_that_runs_nothing():
    # An idle `make serve` holds its hot short-lane actors' rows in its replica's leases: busy for the registry's
    # books. A long request (an OpenAI one with no max_tokens) had only a fresh actor, predicted past its TTFT
    # target, and was refused on an idle server.
    reg = _registry(num_hot=1, slot_bytes=3_000)  # room for no second actor: the long lane has nothing
    a = LeaseBook(LeaseConfig(headroom_rows=2), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, a, "A-0", 0.0)
    _exchanged(reg, a, now=0.5)
    a.release("A-0")
    _exchanged(reg, a, now=1.0)
    assert a.num_rows >= 1 and a.num_free == a.num_rows  # leased, all free: the actor runs nothing
    long = dataclasses.replace(_features(100), ttft_target_s=1.0)
    d = reg.admit(long, POLICY, "unused", "L-0", 1.5, replica_id="A", lease=SlowPathLease(5.0))
    assert isinstance(d, Dispatch) and d.actor_name == "hot0" and d.lane == "long", d
    assert reg.counters["recalled_actor"] == 1 and reg.leases.recalled["A"]
    reg.check_invariants()
    # An actor running a request is never recalled: a second long request is refused.
    assert reg.admit(long, POLICY, "unused", "L-1", 1.6, replica_id="A",
                     lease=SlowPathLease(5.0)).reason in ("no_capacity", "latency_target")
    assert reg.counters["recalled_actor"] == 1


def test_a_long_request_takes_the_leased_idle_short_lane_actor_before_the_pools_warm_one():
    # The pool's warm actor would refill with a process start, and a warming one is seconds from a token: a
    # short-lane actor that runs nothing is the better place, its leased rows taken back for it.
    reg = _registry(num_hot=1, slot_bytes=3_000)
    reg.register_slots([SlotSpec("w0", "n", 3_000)])
    assert reg.warm.try_warm(WarmFill("m", "short", "w0", RESIDENT), "warm0", 0.0)
    reg.warm_ready("warm0", 1.0)
    a = LeaseBook(LeaseConfig(headroom_rows=2), "A", POLICY.max_batch, heartbeat_s=1.0)
    _slow_path(reg, a, "A-0", 0.0)
    a.release("A-0")
    _exchanged(reg, a, now=1.0)
    long = dataclasses.replace(_features(100), ttft_target_s=1.0)
    assert isinstance(decide(long, reg.snapshot(), POLICY), Bind)  # what the books alone would choose
    d = reg.admit(long, POLICY, "unused", "L-0", 1.5, replica_id="A", lease=SlowPathLease(5.0))
    assert isinstance(d, Dispatch) and d.actor_name == "hot0", d
    assert next(x for x in reg.snapshot().actors if x.name == "warm0").state == "warm"  # the pool keeps it
    reg.check_invariants()
