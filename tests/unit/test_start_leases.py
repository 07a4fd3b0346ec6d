"""Start leases: a warm actor to bind, or slot bytes to spawn into, held for one replica — granted on its
recent binds and spawns, used with no registry call, followed by the registry from the next report, and
returned whole (a warm actor warm again, an unstarted actor forgotten) when unused."""

from __future__ import annotations

from serve_app.decisions import Bind, Spawn
from serve_app.lease import LeaseConfig, SlowPathLease
from serve_app.lease_book import LeaseBook
from serve_app.registry import RegistryState, RowReservation, SlotSpec
from serve_app.scorer import RULE_SCORER
from serve_app.warm_pool import WarmFill
from tests.unit.test_leases import POLICY, RESIDENT, _features, _registry

ROW = 200  # a request's KV and workspace at _features(): 20 tokens x 10 bytes


def _with_warm(reg: RegistryState, slot_id: str = "s1", name: str = "warm0") -> RegistryState:
    """A warm actor of model m, filled for the short lane, ready to bind on `slot_id`."""
    reg.register_slots([SlotSpec(slot_id, "n", 10_000)])
    assert reg.warm.try_warm(WarmFill("m", "short", slot_id, RESIDENT), name, 0.0)
    assert reg.warm_ready(name, 0.5)
    return reg


def _full(reg: RegistryState) -> RegistryState:
    """hot0's batch full, with rows another replica's requests run: a request now needs a new actor."""
    for i in range(POLICY.max_batch):
        assert reg.admit(_features(), POLICY, f"x{i}", f"other-{i}", 0.0, replica_id="C").actor_name == "hot0"
    return reg


def _book(replica: str = "A", **config) -> LeaseBook:
    return LeaseBook(LeaseConfig(**config), replica, POLICY.max_batch, heartbeat_s=1.0)


def _exchange(reg: RegistryState, book: LeaseBook, now: float):
    report = book.report(now)
    grant = reg.exchange_leases(report, now)
    book.apply(report, grant, sent_at=now)
    return grant


def _start_wanted(book: LeaseBook, now: float = 0.0) -> None:
    """The replica just bound or spawned for model m's short lane (as admission notes it)."""
    book.note_start("m", "short", ROW, RESIDENT, POLICY.max_hot("m", "short"), 0, now)


def _warm_leased() -> tuple[RegistryState, LeaseBook]:
    """hot0 full, warm0 ready, and replica A holding it on a start lease (it had just started an actor)."""
    reg, book = _with_warm(_full(_registry(num_hot=1))), _book()
    _start_wanted(book)
    _exchange(reg, book, now=0.0)
    return reg, book


def _spawn_leased():
    """hot0 full, slot s1 (node n1) empty, and replica A holding a spawn lease on it; (registry, book, lease)."""
    reg, book = _full(_registry(num_hot=1)), _book()
    reg.register_slots([SlotSpec("s1", "n1", 10_000)])
    _start_wanted(book)
    (lease,) = _exchange(reg, book, now=0.0).granted
    return reg, book, lease


def _start_leases(book: LeaseBook):
    return [r for r in book._rows.values() if r.start]


def test_a_replica_that_bound_gets_a_warm_lease_binds_it_locally_and_the_registry_follows():
    reg = _with_warm(_full(_registry(num_hot=1)))
    book = _book()
    assert all(w.num_starts == 0 for w in book.report(0.0).wanted)  # no bind yet: no start lease wanted
    _start_wanted(book)
    grant = _exchange(reg, book, now=0.5)
    (lease,) = grant.granted
    assert (lease.start, lease.actor_name, lease.keep_hot, lease.node_id) == ("warm", "warm0", True, "n")
    warm = reg.books.actors["warm0"]
    assert (warm.state, warm.start_lease, len(warm.rows)) == ("starting", "warm", 1)  # nobody else binds it
    reg.check_invariants()
    # The replica's next request binds it: decided on its leases alone, no registry call.
    placed = book.place(_features(), POLICY, RULE_SCORER, at=1.0, now=1.0)
    assert placed is not None
    decision, row = placed
    assert isinstance(decision, Bind) and decision.actor_name == "warm0" and decision.keep_hot
    assert row.row_id == lease.row_id
    assert reg.books.actors["warm0"].start_lease == "warm"  # the registry has not heard yet
    _exchange(reg, book, now=1.5)
    assert (warm.state, warm.start_lease) == ("starting", "")  # bound: an unused lease's return no longer applies
    book.started(row.row_id)  # its first token: every weight in, it may batch
    _exchange(reg, book, now=2.0)
    assert warm.state == "busy" and warm.is_hot
    book.release(row.row_id)  # it stays hot: the row is an ordinary leased row of its batch now
    assert not _start_leases(book) and book.num_free >= 1
    _exchange(reg, book, now=2.5)
    assert all(not a.start_lease for a in reg.books.actors.values())
    reg.check_invariants()


def test_with_no_warm_actor_a_spawn_lease_holds_a_slot_for_a_named_actor_and_is_no_ghost():
    reg, book, lease = _spawn_leased()
    assert lease.start == "spawn" and lease.slot_id == "s1" and lease.node_id == "n1"
    actor = reg.books.actors[lease.actor_name]
    assert (actor.state, actor.start_lease, actor.reserved_bytes) == ("starting", "spawn", RESIDENT + ROW)
    # Not created until its holder uses it: reconcile past the spawn grace does not take it for a ghost.
    reg.books.spawn_grace_s = 1.0
    report = reg.reconcile({"hot0"}, now=3.0)
    assert lease.actor_name not in report.ghosts and lease.actor_name in reg.books.actors
    placed = book.place(_features(), POLICY, RULE_SCORER, at=1.0, now=1.0)
    assert placed is not None
    decision, row = placed
    assert isinstance(decision, Spawn) and decision.slot_id == "s1" and decision.node_id == "n1"
    assert decision.evict == () and row.actor_name == lease.actor_name
    reg.check_invariants()


def test_unused_start_leases_return_whole_the_warm_actor_warm_again_the_unstarted_actor_forgotten():
    reg = _with_warm(_full(_registry(num_hot=1)))
    reg.register_slots([SlotSpec("s2", "n", 10_000)])
    book = _book()
    _start_wanted(book)
    report = book.report(0.0)
    report = type(report)(**{**report.__dict__, "wanted": tuple(w.__class__(**{**w.__dict__, "num_starts": 2})
                                                                     for w in report.wanted)})
    grant = reg.exchange_leases(report, 0.0)  # two starts wanted: the warm actor, then a spawn
    assert sorted(r.start for r in grant.granted if r.start) == ["spawn", "warm"]
    free_before = {s.slot_id: s.free_bytes for s in reg.books.slots.values()}
    assert free_before["s1"] == 10_000 - RESIDENT - ROW and free_before["s2"] == 10_000 - RESIDENT - ROW
    reg.reconcile({"hot0", "warm0"}, now=book.ttl_s + 1.0)  # never renewed: both expire
    warm = reg.books.actors["warm0"]
    assert (warm.state, warm.is_hot, warm.start_lease, warm.rows) == ("warm", False, "", {})
    assert {a.name for a in reg.books.actors.values()} == {"hot0", "warm0"}
    assert reg.books.slots["s1"].free_bytes == 10_000 - RESIDENT and reg.books.slots["s2"].free_bytes == 10_000
    reg.check_invariants()


def test_no_start_lease_while_the_model_is_contended_or_after_the_window_and_a_free_one_goes_back():
    reg = _with_warm(_full(_registry(num_hot=1)))
    book = _book(demand_window_s=5.0)
    _start_wanted(book, now=0.0)
    reg.leases.refused("m", 0.0)  # the registry lacks capacity for m: nothing held idle for one replica
    assert not any(r.start for r in _exchange(reg, book, now=0.5).granted)
    # Past the contention, the lease comes; past the window with no further start, it goes back.
    assert [r.start for r in _exchange(reg, book, now=book.ttl_s + 1.0).granted] == []  # outside the window
    _start_wanted(book, now=10.0)
    assert [r.start for r in _exchange(reg, book, now=10.5).granted] == ["warm"]
    _exchange(reg, book, now=16.0)
    assert not _start_leases(book) and reg.books.actors["warm0"].state == "warm"
    reg.check_invariants()


def test_a_start_lease_whose_actor_does_not_stay_hot_goes_back_when_its_request_ends():
    reg = _with_warm(_full(_registry(num_hot=1)))
    book = _book()
    book.note_start("m", "short", ROW, RESIDENT, max_hot=1, num_warm=0, now=0.0)  # hot0 is the one hot actor allowed
    (lease,) = _exchange(reg, book, now=0.5).granted
    assert not lease.keep_hot and not reg.books.actors["warm0"].is_hot
    decision, row = book.place(_features(), POLICY, RULE_SCORER, at=1.0, now=1.0)
    assert isinstance(decision, Bind) and not decision.keep_hot
    book.started(row.row_id)
    book.release(row.row_id)  # it exits after its request: the row goes back with the next report
    assert book.num_rows == 0
    _exchange(reg, book, now=1.5)
    assert "warm0" not in reg.books.actors
    reg.check_invariants()


def test_another_replicas_slow_path_neither_binds_nor_evicts_a_leased_warm_actor():
    reg = _with_warm(_full(_registry(num_hot=1)))
    a = _book("A")
    _start_wanted(a)
    _exchange(reg, a, now=0.0)
    # Replica B's request arrives while hot0 is full: the warm actor is A's, so B is refused, not bound to it.
    d = reg.admit(_features(), POLICY, "b-spawn", "b-0", 0.2, replica_id="B", lease=SlowPathLease(5.0))
    assert getattr(d, "actor_name", None) != "warm0" and "warm0" not in getattr(d, "evict", ())
    assert reg.books.actors["warm0"].start_lease == "warm"
    reg.check_invariants()


def test_a_restarted_registry_adopts_an_unused_warm_lease_and_its_return_leaves_the_actor_warm():
    reg, book = _warm_leased()
    rows = book.handed_over()
    fresh = _with_warm(_full(_registry(num_hot=1)), name="other")  # a new incarnation: slot s1 known, warm0 not
    fresh.remove("other")
    taken = fresh.adopt(rows, now=1.0)
    warm = fresh.books.actors["warm0"]
    assert len(taken) == 1 and (warm.state, warm.start_lease) == ("starting", "warm")
    fresh.reconcile({"hot0", "warm0"}, now=1.0 + book.ttl_s + 1.0)  # its holder went silent: it returns
    assert fresh.books.actors["warm0"].state == "warm"
    fresh.check_invariants()


def test_no_spawn_lease_takes_a_slot_the_models_short_warm_pool_would_refill():
    reg = _full(_registry(num_hot=1))
    reg.register_slots([SlotSpec("s1", "n", 10_000)])
    book = _book()
    book.note_start("m", "short", ROW, RESIDENT, max_hot=4, num_warm=1, now=0.0)  # its pool: one warm actor
    assert not any(r.start for r in _exchange(reg, book, now=0.5).granted)  # the pool refills onto s1 first
    _with_warm(reg, slot_id="s1")
    assert [r.start for r in _exchange(reg, book, now=1.0).granted] == ["warm"]


def test_no_start_lease_while_a_hot_batch_has_a_place_and_a_free_one_goes_back_when_a_place_frees():
    reg = _registry(num_hot=1)
    reg.register_slots([SlotSpec("s1", "n", 10_000)])
    book = _book()
    _start_wanted(book)
    assert not any(r.start for r in _exchange(reg, book, now=0.0).granted)  # hot0 has places: join, not start
    _with_warm(_full(reg))
    _start_wanted(book, now=0.5)
    assert [r.start for r in _exchange(reg, book, now=0.5).granted] == ["warm"]
    assert reg.finish("hot0", "other-0", "complete", 0.6) is False  # a place frees on hot0
    assert _exchange(reg, book, now=1.0).recalled_starts  # asked back: the holder may have used it meanwhile
    _exchange(reg, book, now=1.5)  # unused: returned
    assert not _start_leases(book) and reg.books.actors["warm0"].state == "warm"
    reg.check_invariants()


def test_a_start_lease_the_registry_wants_back_is_recalled_not_ended_and_a_use_just_before_is_kept():
    """The registry never ends a start lease its holder still knows: the holder may have used it since it sent
    its report. It asks for it back; an unused one comes back with the next report, a used one is followed."""
    reg = _with_warm(_full(_registry(num_hot=1)))
    a, b = _book("A"), _book("B")
    for book in (a, b):
        _start_wanted(book)
    (lease,) = _exchange(reg, a, now=0.0).granted
    report = a.report(0.5)  # sent while the lease is free...
    decision, row = a.place(_features(), POLICY, RULE_SCORER, at=0.6, now=0.6)  # ...and used before it arrives
    assert isinstance(decision, Bind) and row.row_id == lease.row_id
    reg.finish("hot0", "other-0", "complete", 0.7)  # a place frees on hot0: start leases are not wanted now
    grant = reg.exchange_leases(report, 0.8)
    assert lease.row_id in grant.recalled_starts and lease.row_id in grant.held
    a.apply(report, grant, sent_at=0.5)
    warm = reg.books.actors["warm0"]
    assert (warm.state, len(warm.rows)) == ("starting", 1)  # still booked for A: nobody else binds it
    d = reg.admit(_features(), POLICY, "b-spawn", "b-0", 0.9, replica_id="B", lease=SlowPathLease(5.0))
    assert getattr(d, "actor_name", None) != "warm0"
    _exchange(reg, a, now=1.0)  # A reports the use: the registry follows the bind
    assert warm.start_lease == "" and len(warm.rows) == 1 and a.num_rows >= 1
    reg.check_invariants()


def test_a_recalled_unused_start_lease_is_not_used_and_comes_back_with_the_next_report():
    reg, book = _warm_leased()
    reg.finish("hot0", "other-0", "complete", 0.1)
    assert _exchange(reg, book, now=0.5).recalled_starts
    placed = book.place(_features(), POLICY, RULE_SCORER, at=0.6, now=0.6)
    assert placed is None or not isinstance(placed[0], Bind)  # the warm lease is off the view
    report = book.report(1.0)
    assert report.returned and not _start_leases(book)
    reg.exchange_leases(report, 1.0)
    assert reg.books.actors["warm0"].state == "warm"
    reg.check_invariants()


def test_a_request_of_the_other_lane_does_not_take_a_start_lease():
    reg = _with_warm(_full(_registry(num_hot=1)))
    book = _book()
    book.note_start("m", "short", 2000, RESIDENT, 4, 0, now=0.0)  # rows large enough for a long request
    _exchange(reg, book, now=0.0)
    long_request = _features(tokens=70)  # past the short lane's 64 tokens
    assert POLICY.lane(long_request.input_tokens, long_request.max_tokens) == "long"
    assert book.place(long_request, POLICY, RULE_SCORER, at=0.5, now=0.5) is None  # the registry decides it


def test_a_start_lease_used_but_not_started_is_the_callers_to_end_and_the_registry_kills_its_actor():
    reg, book = _warm_leased()
    _, row = book.place(_features(), POLICY, RULE_SCORER, at=0.5, now=0.5)
    assert book.is_unstarted_start(row.row_id)  # cancelled now, rows.py ends it with cluster.finish
    assert reg.finish("warm0", row.row_id, "cancelled", 0.6) is True and "warm0" not in reg.books.actors
    book.started(row.row_id)
    assert not book.is_unstarted_start(row.row_id)
    reg.check_invariants()


def test_no_start_lease_on_a_node_too_busy_for_a_start_at_full_speed_and_a_held_one_is_recalled():
    """With the rule's node_cpus, a start beside as many busy actors as cores is slower than the leased view
    (which sees none of them) would predict: such starts are left to the registry's own decisions."""
    reg = _with_warm(_full(_registry(num_hot=1)))  # hot0 busy, on node n with warm0
    book = LeaseBook(LeaseConfig(), "A", POLICY.max_batch, heartbeat_s=1.0, node_cpus=1)
    _start_wanted(book)
    assert not any(r.start for r in _exchange(reg, book, now=0.0).granted)  # one core, one busy actor
    roomy = LeaseBook(LeaseConfig(), "B", POLICY.max_batch, heartbeat_s=1.0, node_cpus=2)
    _start_wanted(roomy)
    (lease,) = _exchange(reg, roomy, now=0.1).granted
    assert lease.start == "warm"
    # An unused lease's actor is not busy on its node: it neither slows starts there nor holds the pool back.
    snapshot = reg.snapshot()
    assert snapshot.num_busy_on_node("n") == 1 and snapshot.num_starting_on_node("n") == 0
    reg.books.slots["s1"].total_bytes += 10_000  # room for one more actor's bytes on the warm lease's slot...
    reg.books.max_actors_per_slot = 2
    reg.try_spawn(Spawn("s1", "short", True, RESIDENT + ROW, RESIDENT), "other", "m",
                  RowReservation("other-req", 20, None, 0.2, 10.0), 0.2)  # ...where a second actor starts
    assert _exchange(reg, roomy, now=0.3).recalled_starts == {lease.row_id}  # two busy on two cores: recalled
    reg.check_invariants()


def test_a_spawn_lease_used_late_has_its_reconcile_grace_from_its_use():
    reg, book, lease = _spawn_leased()
    book.place(_features(), POLICY, RULE_SCORER, at=20.0, now=3.0)  # used after the spawn grace (10 s) ran out
    _exchange(reg, book, now=20.0)
    # Listed before its process was created: young since its use, not a ghost.
    assert lease.actor_name not in reg.reconcile({"hot0"}, now=21.0).ghosts
    assert lease.actor_name in reg.books.actors


def test_no_start_lease_while_a_hot_actor_of_the_model_is_still_starting():
    """Its batch's places come with its first token: a second request then joins or is dispatched to it."""
    reg = _registry(num_hot=0)
    reg.register_slots([SlotSpec("s0", "n", 10_000), SlotSpec("s1", "n", 10_000)])
    d = reg.admit(_features(), POLICY, "first", "req-0", 0.0, replica_id="A", lease=SlowPathLease(5.0))
    assert isinstance(d, Spawn) and d.keep_hot  # the model's first actor, starting
    book = _book()
    _start_wanted(book)
    assert not any(r.start for r in _exchange(reg, book, now=0.5).granted)
    reg.actor_started("first")
    reg.finish("first", "req-0", "complete", 1.0)  # idle and hot: the next request's place
    assert not any(r.start for r in _exchange(reg, book, now=1.5).granted)
