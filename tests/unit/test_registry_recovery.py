"""A registry that comes back empty: rows handed back (adopt), abandonments that arrive first, a new policy."""

from __future__ import annotations

import pytest

from serve_app.decisions import Join, Spawn
from serve_app.policy import PolicyConfig
from serve_app.registry import AdoptedRow, RegistryState, SlotSpec
from serve_app.snapshot import RequestFeatures
from tests.helpers import policy

POLICY = policy(max_batch=8)
F = RequestFeatures("m", 10, 10, 500, 1, 0)  # a spawn reserves 520 bytes, a row 20


def _registry(*totals) -> RegistryState:
    reg = RegistryState(POLICY.max_actors_per_slot, max_batch=POLICY.max_batch)
    reg.register_slots(SlotSpec(f"s{i}", "node", total) for i, total in enumerate(totals))
    return reg


def _row(actor="a", request="r1", slot="s0", *, is_started=True, is_hot=True, resident=500, request_bytes=20):
    return AdoptedRow(actor, "m", slot, "short", is_hot, is_started, resident, request, request_bytes,
                      10, None, 5.0, 60.0)


def _actor(reg, name):
    return next((a for a in reg.snapshot().actors if a.name == name), None)


def test_adopted_rows_hold_what_the_lost_registry_held_and_end_as_before():
    reg = _registry(1000, 1000)
    taken = reg.adopt([_row(request="r1"), _row(request="r2"), _row("b", "r3", "s1", is_started=False,
                                                                     is_hot=False)], now=100.0)
    assert taken == ["r1", "r2", "r3"]
    a, b = _actor(reg, "a"), _actor(reg, "b")
    assert a.state == "busy" and a.num_rows == 2 and a.reserved_bytes == 540
    assert b.state == "starting" and b.reserved_bytes == 520  # still loading: no batch joins it yet
    reg.check_invariants()
    # The adopted rows end as any row does: the hot actor idles with its weights, the other is forgotten.
    reg.finish("a", "r1", "complete", now=101.0)
    reg.finish("a", "r2", "complete", now=101.0)
    reg.finish("b", "r3", "complete", now=101.0)
    assert _actor(reg, "a").state == "idle" and _actor(reg, "b") is None
    reg.check_invariants()


def test_adopted_actors_are_not_orphans_and_their_rows_get_fresh_deadlines():
    reg = _registry(1000)
    reg.adopt([_row()], now=100.0)
    report = reg.reconcile({"a", "stranger"}, now=101.0)
    assert report.orphans == ("stranger",) and not report.expired
    report = reg.reconcile({"a"}, now=100.0 + 61.0)  # busy_timeout_s 60 from the adoption
    assert report.expired == ("a",)


def test_adopt_takes_nothing_it_cannot_hold_and_nothing_twice():
    reg = _registry(600)
    assert reg.adopt([_row(slot="gone")], now=0.0) == []  # its node's slot is not registered
    assert reg.adopt([_row(resident=590)], now=0.0) == []  # 610 bytes do not fit in 600
    assert reg.adopt([_row()], now=0.0) == ["r1"]
    assert reg.adopt([_row()], now=0.0) == []  # already held
    assert reg.adopt([_row("other", "r9")], now=0.0) == []  # one actor per slot
    reg.check_invariants()


def test_an_admission_that_arrives_after_its_abandonment_commits_nothing():
    reg = _registry(1000)
    assert reg.abandon("late", now=0.0) is None  # the caller gave up before the registry saw the admission
    refused = reg.admit(F, POLICY, "a", "late", now=0.1)
    assert refused.reason == "no_capacity" and refused.retry_after_s is None
    assert not reg.snapshot().actors
    assert isinstance(reg.admit(F, POLICY, "a", "other", now=0.2), Spawn)
    reg.check_invariants()


def test_reconfigure_applies_a_redeploys_limits_to_the_commits_that_follow():
    reg = _registry(10_000)
    spawn = reg.admit(F, POLICY, "a", "r1", now=0.0)
    reg.actor_started(spawn and "a")
    one_row = PolicyConfig(**{**POLICY.__dict__, "max_batch": 1})
    reg.reconfigure(one_row.max_actors_per_slot, one_row.max_idle_s, one_row.max_batch)
    assert not isinstance(reg.admit(F, one_row, "b", "r2", now=0.1), Join)  # a batch of one is full
    two = PolicyConfig(**{**POLICY.__dict__, "max_batch": 2})
    reg.reconfigure(two.max_actors_per_slot, two.max_idle_s, two.max_batch)
    assert isinstance(reg.admit(F, two, "c", "r3", now=0.2), Join)


def test_the_rows_of_a_replica_that_is_gone_are_released_and_an_actor_running_only_those_is_killed():
    reg = _registry(10_000, 10_000)
    reg.adopt([AdoptedRow("shared", "m", "s0", "short", True, True, 500, "mine", 20, 10, None, 5.0, 60.0, "live"),
               AdoptedRow("shared", "m", "s0", "short", True, True, 500, "theirs", 20, 10, None, 5.0, 60.0, "gone"),
               AdoptedRow("only", "m", "s1", "short", False, True, 500, "lost", 20, 10, None, 5.0, 60.0, "gone")],
              now=0.0)
    assert reg.release_rows_of({"gone"}, now=1.0) == ["only"]
    shared = _actor(reg, "shared")
    assert shared.num_rows == 1 and shared.reserved_bytes == 520  # the live replica's row runs on
    assert _actor(reg, "only") is None
    assert reg.release_rows_of({"gone"}, now=2.0) == []  # nothing left of it
    reg.check_invariants()


def test_idle_hot_actors_handed_over_are_idle_again_not_orphans_and_a_busy_one_stays_busy():
    from serve_app.registry import AdoptedActor

    reg = _registry(1000, 1000)
    idle = [AdoptedActor("a", "m", "s0", "short", 500), AdoptedActor("b", "m", "s1", "short", 500)]
    # Another replica's running row on `a` is handed over first: `a` is busy, not idle.
    assert reg.adopt([_row("a", "r1")], now=0.0, idle=idle) == ["r1", "b"]
    assert _actor(reg, "a").state == "busy" and _actor(reg, "b").state == "idle"
    assert reg.reconcile({"a", "b"}, now=1.0).orphans == ()
    assert reg.adopt([], now=1.0, idle=idle) == []  # known already
    reg.check_invariants()


class _Handle:
    """A registry handle's `attach` as the link calls it (`handle.attach.remote(...)`); `ray.get` is patched."""

    class attach:  # noqa: N801  (the shape of a Ray method)
        @staticmethod
        def remote(replica_id):
            return "ref"


def test_a_link_whose_registry_did_not_answer_is_unavailable_until_a_heartbeat_is_answered(monkeypatch):
    import ray

    from serve_app.ray_cluster.registry_link import RegistryLink

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: "incarnation-1")
    link = RegistryLink(_Handle, "replica-1")
    assert link.is_available
    link.lost()  # Ray answered an admission with the registry's death
    assert not link.is_available
    handed_over = []
    link.heartbeat(lambda: handed_over.append(True))
    assert link.is_available and handed_over == [True] and link.incarnation == "incarnation-1"


def test_a_late_answer_keeps_the_link_available_and_only_an_unanswered_probe_stops_admissions(monkeypatch):
    import ray

    from serve_app.ray_cluster.registry_link import RegistryLink

    answers = iter(["incarnation-1", TimeoutError("no answer within the probe's deadline"), "incarnation-1"])
    timeouts: list[float] = []

    def get(ref, timeout=None):
        timeouts.append(timeout)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ray, "get", get)
    link = RegistryLink(_Handle, "replica-1", probe_timeout_s=2.0, attach_timeout_s=30.0)
    link.heartbeat(lambda: None)
    link.unanswered(TimeoutError())  # an admission's decision came late
    assert link.is_available  # late is not gone: the next admissions still ask
    assert link.wait() is True  # ...and the probe runs at once
    with pytest.raises(TimeoutError):
        link.heartbeat(lambda: None)
    assert not link.is_available  # the probe went unanswered: refused at once from here
    link.heartbeat(lambda: None)
    assert link.is_available
    assert timeouts == [30.0, 2.0, 2.0]  # the first attach waits for the registry's start; probes do not
    link.unanswered(ray.exceptions.RayActorError())  # dead: Ray said so
    assert not link.is_available


def test_a_restarted_registry_refuses_a_replica_that_has_not_handed_over_and_serves_one_that_has():
    from serve_app.decisions import Reject
    from serve_app.ray_cluster.registry_actor import RegistryActor
    from serve_app.registry import RegistryConfig

    registry = RegistryActor(RegistryConfig(reconcile_interval_s=3600.0), POLICY)
    try:
        registry.register_slots([SlotSpec("s0", "node", 10_000)])
        stale = registry.admit(F, "zq-m-000000000001", "r1", replica_id="replica-1", incarnation="before-restart")
        assert isinstance(stale, Reject) and stale.reason == "registry_restarted" and stale.http_status == 503
        assert registry.snapshot().actors == ()  # nothing committed for the refused request
        current = registry.attach("replica-1")
        assert isinstance(registry.admit(F, "zq-m-000000000001", "r1", replica_id="replica-1",
                                         incarnation=current), Spawn)
    finally:
        registry.stop()


def test_a_link_stays_unavailable_and_on_the_old_incarnation_until_its_hand_over_succeeds(monkeypatch):
    import ray

    from serve_app.ray_cluster.registry_link import RegistryLink

    answers = iter(["incarnation-1", "incarnation-2", "incarnation-2"])
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: next(answers))
    link = RegistryLink(_Handle, "replica-1")
    link.heartbeat(lambda: None)
    link.lost()

    def failing_hand_over():
        raise RuntimeError("the new registry did not take the rows")

    with pytest.raises(RuntimeError):
        link.heartbeat(failing_hand_over)
    assert not link.is_available and link.incarnation == "incarnation-1"  # admissions stay refused
    link.heartbeat(lambda: None)
    assert link.is_available and link.incarnation == "incarnation-2"


def test_a_heartbeat_skips_its_attach_within_a_heartbeat_of_another_answer_but_not_once_the_registry_is_lost(
        monkeypatch):
    import ray

    from serve_app.ray_cluster.registry_link import RegistryLink

    calls: list[float] = []
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: calls.append(timeout) or "incarnation-1")
    link = RegistryLink(_Handle, "replica-1", heartbeat_s=60.0)
    link.heartbeat(lambda: None)
    link.heard()  # the lease exchange was answered
    link.heartbeat(lambda: None)
    assert len(calls) == 1  # nothing to learn: no attach
    link.lost()
    link.heartbeat(lambda: None)
    assert len(calls) == 2 and link.is_available
