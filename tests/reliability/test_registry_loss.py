"""The registry lost — killed for good, or killed and restarted by Ray — while requests arrive and a stream runs;
and a registry that is only late.

Until a registry answers again every admission is a fast 503 with its request id (never a 500 or a
hang); a registry killed for good is re-created by the replicas' next heartbeat; a restarted or
re-created one comes back empty and is handed the running rows, so the stream already running
finishes and its actor is not killed as an orphan. A registry that answers one admission late
costs that admission only: the requests right behind it are served.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers import SERVE_PORT
from tests.reliability import harness
from tests.reliability.faults import FaultyActor, LateRegistry
from tests.reliability.harness import assert_documented_error, assert_nothing_left, body, call
from tests.serve.waiting import wait_for

NAMESPACE = "zq-registry-loss-tests"
PORT = SERVE_PORT
# The deadline on a decision; LateRegistry answers its cue later than this.
REGISTRY_TIMEOUT_S = 2.0
# A refusal of a registry Ray knows is gone makes no registry call beyond its deadline, plus the proxy
# and the ingress on a busy 2-core CI machine.
REFUSAL_BOUND_S = REGISTRY_TIMEOUT_S + 1.0
# Heartbeat (1 s) + creating or restarting the registry + handing over the slots and rows, on a slow machine.
BACK_BOUND_S = 30.0


@pytest.fixture(scope="module")
def zq(ray_cluster, tiny_zqs):
    assert LateRegistry.LATE_S > REGISTRY_TIMEOUT_S
    base = harness.deploy(PORT, "zeroqueue-registry-loss", NAMESPACE, tiny_zqs, actor_cls=FaultyActor,
                          registry_cls=LateRegistry, registry_timeout_s=REGISTRY_TIMEOUT_S,
                          registry_probe_timeout_s=2 * LateRegistry.LATE_S, policy={"max_hot_short_actors": 1})
    yield base
    harness.undeploy(ray_cluster, NAMESPACE)


def _incarnation(ray) -> str | None:
    """The registry's incarnation, or None while it is restarting or being re-created."""
    try:
        return ray.get(harness.registry(ray, NAMESPACE).attach.remote("test-observer"), timeout=10)
    except Exception:
        return None


def _running(ray, registry) -> list:
    """Actors running a request (a row leased to a replica with nothing in it does not count)."""
    return [a for a in ray.get(registry.snapshot.remote()).actors if any(r.num_tokens for r in a.rows)]


def _served_again(base: str) -> bool:
    ending = call(base, body(max_tokens=2))
    assert ending.status in (200, 503), ending  # refused while it comes back, never a 500
    return ending.is_complete


@pytest.mark.parametrize("is_restarted", [False, True], ids=["killed-for-good", "restarted"])
def test_a_lost_registry_means_fast_503s_then_service_again_and_the_running_stream_finishes(
        zq, ray_cluster, tmp_path, is_restarted):
    ray = ray_cluster
    assert call(zq, body()).is_complete
    gate = tmp_path / "gate"
    streamed: list[harness.Ending] = []
    stream = threading.Thread(target=lambda: streamed.append(
        call(zq, body(f"a long answer gate:{gate}", max_tokens=16, stream=True))))
    stream.start()
    wait_for(lambda: _running(ray, harness.registry(ray, NAMESPACE)), 30, "the stream to be running")
    first = ray.get(harness.registry(ray, NAMESPACE).attach.remote("test-observer"))
    ray.kill(harness.registry(ray, NAMESPACE), no_restart=not is_restarted)
    t0 = time.monotonic()
    ending = call(zq, body(max_tokens=2))
    if ending.status != 200:  # the registry may already be back
        assert_documented_error(ending, 503, "overloaded_error")
        assert ending.seconds < REFUSAL_BOUND_S, ending.seconds
    # Served again — on the replica's leased rows even before a new registry answers — and a new
    # incarnation, empty at its start, takes over.
    wait_for(lambda: _served_again(zq) and _incarnation(ray) not in (None, first), BACK_BOUND_S,
             "requests served, and a new registry")
    assert time.monotonic() - t0 < BACK_BOUND_S
    new = harness.registry(ray, NAMESPACE)
    # The running stream's row was handed over: its actor holds it in the new registry's books.
    wait_for(lambda: _running(ray, new), BACK_BOUND_S, "the running row handed over")
    running = _running(ray, new)
    assert len(running) == 1 and running[0].state == "busy", running
    gate.touch()
    stream.join(60)
    assert streamed and streamed[0].is_complete, streamed
    ray.get(new.detach.remote("test-observer"))
    assert_nothing_left(ray, NAMESPACE)


def test_an_idle_hot_actor_is_handed_to_a_restarted_registry_not_killed_as_an_orphan(zq, ray_cluster):
    from serve_app.registry import RegistryConfig

    ray = ray_cluster
    assert call(zq, body()).is_complete
    wait_for(lambda: any(a.state == "idle" for a in ray.get(harness.registry(ray, NAMESPACE).snapshot.remote()).actors),
             30, "an idle hot actor")
    [hot] = [a.name for a in ray.get(harness.registry(ray, NAMESPACE).snapshot.remote()).actors if a.state == "idle"]
    ray.kill(harness.registry(ray, NAMESPACE), no_restart=False)
    wait_for(lambda: _served_again(zq), BACK_BOUND_S, "requests served by the restarted registry")
    # Past the restarted registry's grace for hand-overs, and one reconcile more: an orphan would be dead.
    time.sleep(RegistryConfig.adopt_grace_s + 2 * RegistryConfig.reconcile_interval_s)
    actors = {a.name: a.state for a in ray.get(harness.registry(ray, NAMESPACE).snapshot.remote()).actors}
    assert actors.get(hot) in ("idle", "busy"), actors  # still the registry's, and alive:
    assert {"name": hot, "namespace": NAMESPACE} in ray.util.list_named_actors(all_namespaces=True)
    assert_nothing_left(ray, NAMESPACE)


def test_one_late_decision_costs_that_request_only_the_next_ones_are_served(zq, ray_cluster):
    assert call(zq, body()).is_complete
    # A prompt longer than any before it: no row this replica leases is large enough, so it takes the slow
    # path, the registry's decision.
    late = call(zq, body("why " * 200, max_tokens=LateRegistry.CUE_MAX_TOKENS))
    assert_documented_error(late, 503, "overloaded_error")  # its deadline passed: refused, not held
    # Sent while the registry is still busy with the late one: each waits its turn there and is served,
    # where a link that took one late answer for a lost registry refused them all until a heartbeat.
    followers = [call(zq, body(max_tokens=2)) for _ in range(4)]
    assert all(f.is_complete for f in followers), followers
    assert_nothing_left(ray_cluster, NAMESPACE)  # the late admission was abandoned and undone
