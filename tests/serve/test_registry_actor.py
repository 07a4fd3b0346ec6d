"""The shared registry on a real Ray cluster: racing replicas, and reconcile against Ray's actor table."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from serve_app.decisions import Reject, Spawn
from serve_app.policy import PolicyConfig
from serve_app.ray_cluster.registry_actor import get_registry
from serve_app.registry import RegistryConfig, SlotSpec
from serve_app.snapshot import RequestFeatures
from tests.helpers import policy

NAMESPACE = "zeroqueue-tests"
POLICY = policy()  # every request here is 10 + 10 tokens: short
NUM_ROUNDS = 20
SPAWN_600 = RequestFeatures("m", 10, 10, 580, 1, 0)  # a spawn for it reserves 600 bytes, 580 of them resident


class _Dummy:
    def ping(self) -> str:
        return "pong"


@pytest.fixture
def make_registry(ray_cluster):
    ray = ray_cluster
    created = []

    def make(policy: PolicyConfig = POLICY, **kw):
        config = RegistryConfig(name=f"zq-registry-test-{uuid.uuid4().hex[:8]}", namespace=NAMESPACE,
                                actor_namespace=NAMESPACE, **{"reconcile_interval_s": 3600.0, "adopt_grace_s": 0.0, **kw})
        handle = get_registry(config, policy)
        created.append(handle)
        return handle

    yield make
    for handle in created:
        ray.kill(handle, no_restart=True)


@pytest.fixture
def dummies(ray_cluster):
    """Detached actors named like request actors; whatever a test leaves alive is killed after it."""
    ray = ray_cluster
    names = []

    def make(is_started: bool = True) -> str:
        name = f"zq-dummy-{uuid.uuid4().hex[:12]}"
        handle = ray.remote(_Dummy).options(name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0).remote()
        names.append(name)
        assert _is_alive(ray, name)  # a name is in the table from creation on
        if is_started:
            assert ray.get(handle.ping.remote()) == "pong"
        return name

    yield make
    for name in names:
        if _is_alive(ray, name):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)


def _is_alive(ray, name: str) -> bool:
    return {"name": name, "namespace": NAMESPACE} in ray.util.list_named_actors(all_namespaces=True)


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _slot(ray, registry, slot_id):
    return next(s for s in ray.get(registry.snapshot.remote()).slots if s.slot_id == slot_id)


def test_concurrent_admits_place_one_request_per_free_slot(ray_cluster, make_registry):
    ray = ray_cluster
    registry = make_registry()
    features = RequestFeatures("m", 10, 10, 980, 1, 0)  # exactly 1000 bytes: one per slot
    for i in range(NUM_ROUNDS):
        ray.get(registry.register_slots.remote([SlotSpec(f"admit-{i:03d}", _node(ray), 1000)]))
        barrier, results = threading.Barrier(2), [None, None]

        def client(k: int, i=i, barrier=barrier, results=results) -> None:
            barrier.wait()
            results[k] = ray.get(registry.admit.remote(features, f"a{i}-{k}", f"q{i}-{k}"))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        spawns = [d for d in results if isinstance(d, Spawn)]
        assert len(spawns) == 1 and spawns[0].slot_id == f"admit-{i:03d}", results
        assert any(isinstance(d, Reject) and d.reason == "no_capacity" for d in results)
    ray.get(registry.check_invariants.remote())


def test_reconcile_forgets_a_dead_actor_and_its_reservation(ray_cluster, make_registry, dummies):
    ray = ray_cluster
    registry = make_registry(spawn_grace_s=0.2)
    ray.get(registry.register_slots.remote([SlotSpec("slot", _node(ray), 1000)]))
    name = dummies()
    assert isinstance(ray.get(registry.admit.remote(SPAWN_600, name, "r")), Spawn)
    time.sleep(0.3)  # past the grace
    report = ray.get(registry.reconcile_now.remote())
    assert name not in report.ghosts and name not in report.orphans  # alive and known

    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    _wait_until(lambda: not _is_alive(ray, name))
    report = ray.get(registry.reconcile_now.remote())
    assert report.ghosts == (name,) and report.released_bytes == 600
    assert ray.get(registry.snapshot.remote()).actors == ()
    assert _slot(ray, registry, "slot").reserved_bytes == 0
    ray.get(registry.check_invariants.remote())


def test_reconcile_kills_an_unknown_request_actor_as_an_orphan(ray_cluster, make_registry, dummies):
    ray = ray_cluster
    registry = make_registry()
    orphan = dummies()
    report = ray.get(registry.reconcile_now.remote())
    assert orphan in report.orphans
    _wait_until(lambda: not _is_alive(ray, orphan))
    assert not any(n.startswith("zq-registry-test-") for n in report.orphans)  # itself excluded


def test_a_new_registry_kills_unknown_actors_only_after_its_grace_for_hand_overs(ray_cluster, make_registry,
                                                                                 dummies):
    ray = ray_cluster
    registry = make_registry(adopt_grace_s=2.0)
    running = dummies()  # a replica's running row, not handed over yet
    ray.get(registry.reconcile_now.remote())
    assert _is_alive(ray, running)  # within the grace: it may still be handed over
    time.sleep(2.0)
    assert running in ray.get(registry.reconcile_now.remote()).orphans
    _wait_until(lambda: not _is_alive(ray, running))


def test_only_idle_actors_ray_lists_alive_are_taken_from_a_hand_over(ray_cluster, make_registry, dummies):
    from serve_app.registry import AdoptedActor

    ray = ray_cluster
    registry = make_registry()
    ray.get(registry.register_slots.remote([SlotSpec("s0", _node(ray), 1000), SlotSpec("s1", _node(ray), 1000)]))
    alive = dummies()
    idle = [AdoptedActor(alive, "m", "s0", "short", 500), AdoptedActor("zq-m-0123456789ab", "m", "s1", "short", 500)]
    assert ray.get(registry.adopt.remote([], idle)) == [alive]  # the other one was killed meanwhile


def test_the_background_loop_reconciles_without_being_asked(ray_cluster, make_registry, dummies):
    ray = ray_cluster
    registry = make_registry(reconcile_interval_s=0.2, spawn_grace_s=0.2)
    ray.get(registry.register_slots.remote([SlotSpec("slot", _node(ray), 1000)]))
    assert isinstance(ray.get(registry.admit.remote(SPAWN_600, "zq-never-0123456789ab", "r")), Spawn)
    orphan = dummies(is_started=False)  # the loop may kill it before it has started
    _wait_until(lambda: not _is_alive(ray, orphan))
    _wait_until(lambda: ray.get(registry.snapshot.remote()).actors == ())  # the ghost is forgotten
    assert _slot(ray, registry, "slot").reserved_bytes == 0


def _node(ray) -> str:
    """This cluster's node: a slot on a node Ray does not list as alive is removed by reconcile."""
    return ray.get_runtime_context().get_node_id()


def test_reconcile_removes_the_slots_of_a_node_that_is_gone(ray_cluster, make_registry):
    ray = ray_cluster
    registry = make_registry()
    gone = "f" * len(_node(ray))  # a node id Ray does not list: a GPU pod replaced, a worker lost
    ray.get(registry.register_slots.remote([SlotSpec("here", _node(ray), 1000), SlotSpec("gone", gone, 1000)]))
    report = ray.get(registry.reconcile_now.remote())
    assert report.lost_slots == ("gone",)
    assert [s.slot_id for s in ray.get(registry.snapshot.remote()).slots] == ["here"]
    decision = ray.get(registry.admit.remote(RequestFeatures("m", 10, 10, 980, 1, 0), "zq-m-0123456789ab", "q"))
    assert isinstance(decision, Spawn) and decision.slot_id == "here"  # never the dead node's (it sorted first)
    ray.get(registry.remove.remote("zq-m-0123456789ab"))
    ray.get(registry.check_invariants.remote())


def test_a_restarted_registry_refuses_a_replicas_admissions_until_that_replica_has_handed_over(
        ray_cluster, make_registry, dummies):
    """Ray restarts the registry empty. Between the heartbeat that sees it and the end of the hand-over,
    an admission from the same replica would be decided on books that lack the replica's running rows
    (and could place onto their slot): it is refused; once the rows are handed over, it is served."""
    from serve_app.ray_cluster.registry_link import RegistryLink
    from serve_app.registry import AdoptedRow

    ray = ray_cluster
    registry = make_registry()
    slots = [SlotSpec("s0", _node(ray), 1000), SlotSpec("s1", _node(ray), 1000)]
    features = RequestFeatures("m", 10, 10, 480, 1, 0)  # one actor per slot (POLICY); first fit takes s0
    link = RegistryLink(lambda: registry, "replica-1")
    link.heartbeat(lambda: ray.get(registry.register_slots.remote(slots)))
    running = dummies()
    assert isinstance(ray.get(link.handle.admit.remote(features, running, "r1", None, "replica-1", link.incarnation)),
                      Spawn)
    before = link.incarnation
    ray.kill(registry, no_restart=False)
    during: list = []

    def hand_over():
        ray.get(registry.register_slots.remote(slots))
        during.append(ray.get(link.handle.admit.remote(features, "zq-m-0123456789ab", "r2", None, "replica-1",
                                                link.incarnation)))
        row = AdoptedRow(running, "m", "s0", "short", False, True, 500, "r1", 0, 10, None, time.time() + 60, 60.0,
                         "replica-1")
        assert ray.get(registry.adopt.remote([row])) == ["r1"]

    _wait_until(lambda: _heartbeat_sees_a_new_incarnation(link, hand_over, before), timeout=30)
    [refused] = during
    assert isinstance(refused, Reject) and refused.reason == "registry_restarted", refused
    assert [a.name for a in ray.get(registry.snapshot.remote()).actors] == [running]  # nothing committed for r2
    admitted = ray.get(link.handle.admit.remote(features, "zq-m-0123456789ab", "r2", None, "replica-1", link.incarnation))
    assert isinstance(admitted, Spawn) and admitted.slot_id == "s1", admitted  # s0 is the running row's


def _heartbeat_sees_a_new_incarnation(link, hand_over, before: str) -> bool:
    import ray

    try:
        link.heartbeat(hand_over)
    except ray.exceptions.RayActorError:  # still restarting
        return False
    return link.incarnation != before


def test_the_registry_decides_at_nice_0_ahead_of_the_request_actors(ray_cluster, make_registry):
    import os
    import threading

    registry = make_registry()
    # The thread that runs its methods: Ray's workers would run it at RAY_worker_niceness, 15 by default.
    nice = ray_cluster.get(registry.__ray_call__.remote(
        lambda self: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    assert nice == 0
