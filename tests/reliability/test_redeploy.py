"""A redeploy with a changed config while streams run: the old replica drains its streams to their
message_stop (graceful_shutdown_timeout_s), the new replica serves new requests, and the registry —
which outlives both — decides with the new deployment's policy.

The policy change is observable in a decision: the first deployment keeps no hot actor
(max_hot_short_actors=0: every request starts a fresh actor, which exits after it), the second keeps one
(a request's actor stays, idle and hot, and the next request runs on it: tier "hot").
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.helpers import SERVE_PORT
from tests.reliability import harness
from tests.reliability.faults import FaultyActor
from tests.reliability.harness import assert_nothing_left, body, call
from tests.serve.waiting import wait_for

NAMESPACE = "zq-redeploy-tests"
PORT = SERVE_PORT
APP = "zeroqueue-redeploy"
OLD = {"registry_timeout_s": 0.25, "policy": {"max_hot_short_actors": 0, "max_batch": 1}}
NEW = {"registry_timeout_s": 0.5, "policy": {"max_hot_short_actors": 1, "max_batch": 4}}
# A new ingress replica serving: a replica process start, the imports and the model's header, on a busy
# 2-core CI machine where two actors and the old replica share the cores.
REPLICA_BOUND_S = 90.0
# A stream held across the redeploy: its cold start, then the new replica's start (the test opens the gate
# only once the new replica answers), then its last event. Both bounds above, plus margin.
STREAM_BOUND_S = 180.0
MAX_TRIES = 5
COLD_BOUND_S = 60.0  # one cold start of the tiny model on a slow machine: the client's timeout beyond it
# The old replica, drained, stops once its streams have ended (far below graceful_shutdown_timeout_s, 300 s).
DRAINED_BOUND_S = 60.0


@pytest.fixture(scope="module")
def zq(ray_cluster, tiny_zqs):
    base = harness.deploy(PORT, APP, NAMESPACE, tiny_zqs, actor_cls=FaultyActor, **OLD)
    yield base, tiny_zqs
    harness.undeploy(ray_cluster, NAMESPACE)


def _replica_id(base: str) -> str | None:
    try:
        return harness.health(base)["replica"]["id"]
    except (httpx.HTTPError, KeyError, ValueError):  # between replicas
        return None


def _post(base: str, payload: dict) -> httpx.Response:
    for _ in range(MAX_TRIES):
        r = httpx.post(f"{base}/v1/messages", json=payload, timeout=COLD_BOUND_S + 30)
        if r.status_code != 503:
            break
        # A refusal (the registry's 0.25 s deadline missed on a loaded machine) is retried as its
        # retry-after says, as a client does: this test is about the redeploy, not about capacity.
        time.sleep(float(r.headers["retry-after"]))
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"]
    return r


def _request_actors(ray) -> list[dict]:
    from serve_app.registry import is_request_actor_name

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and is_request_actor_name(a["name"])]


def _replica_states(serve) -> dict:
    return dict(serve.status().applications[APP].deployments["zeroqueue"].replica_states)


def test_a_redeploy_drains_the_running_streams_then_serves_with_the_new_policy(zq, ray_cluster, tmp_path):
    from ray import serve

    ray = ray_cluster
    base, zqs = zq
    registry = harness.registry(ray, NAMESPACE)

    # The old policy, as a decision shows it: a fresh actor, gone after its request.
    r = _post(base, body(max_tokens=4))
    assert r.headers["x-request-tier"] == "cold"
    wait_for(lambda: not _request_actors(ray), 30, "the old policy's actor to exit after its request")
    # /health reads the registry within the old config's 0.25 s deadline, which a loaded machine can miss
    # (a 503): asked again, as for the new replica below.
    seen: list[str | None] = []
    wait_for(lambda: seen.append(_replica_id(base)) or seen[-1] is not None, REPLICA_BOUND_S,
             "the old replica's /health")
    old_replica = seen[-1]

    # Two streams, held at their Completion: their tokens are out, their relays open on the old replica.
    gate = tmp_path / "gate"
    streamed: list[harness.Ending | None] = [None, None]

    def stream(k: int) -> None:
        streamed[k] = call(base, body(f"stream {k} runs through a redeploy gate:{gate} ok", max_tokens=12,
                                      stream=True), timeout=STREAM_BOUND_S + 30)

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(a.num_rows for a in ray.get(registry.snapshot.remote(), timeout=10).actors) == 2,
             COLD_BOUND_S, "both streams running")

    # Redeploy the same app with a changed config. serve.run returns once the new version is running; it
    # runs on a thread in case it also waits for the old replica, which drains until the gate opens.
    redeployed: list[str] = []
    redeploy = threading.Thread(target=lambda: redeployed.append(
        harness.deploy(PORT, APP, NAMESPACE, zqs, actor_cls=FaultyActor, **NEW)), daemon=True)
    redeploy.start()
    wait_for(lambda: _replica_id(base) not in (None, old_replica), REPLICA_BOUND_S, "the new replica to answer")
    # The old replica is still draining: both rows are still running, and no stream has ended.
    assert sum(a.num_rows for a in ray.get(registry.snapshot.remote(), timeout=10).actors) == 2
    assert streamed == [None, None] and all(t.is_alive() for t in threads), streamed

    gate.touch()
    for t in threads:
        t.join(STREAM_BOUND_S)
    for ending in streamed:
        assert ending is not None and ending.is_complete, ending  # drained to message_stop, not cut
        assert ending.request_id and ending.error_type is None and ending.text, ending
        assert ending.events[-1]["type"] == "message_stop"
    redeploy.join(REPLICA_BOUND_S)
    assert redeployed == [base]
    # The old replica stops once drained: one replica left, the new one.
    wait_for(lambda: _replica_states(serve) == {"RUNNING": 1}, DRAINED_BOUND_S, "the old replica to stop")
    # /health answers 503 while a registry call misses its deadline on a loaded machine: asked until it answers.
    wait_for(lambda: _replica_id(base) not in (None, old_replica), REPLICA_BOUND_S, "the new replica's /health")

    # New requests are served, with the new policy: the actor stays hot and the next request runs on it.
    r = _post(base, body(max_tokens=4))
    assert r.headers["x-request-tier"] == "cold"
    wait_for(lambda: [(a.state, a.is_hot) for a in ray.get(registry.snapshot.remote(), timeout=10).actors]
             == [("idle", True)], 30, "the new policy's hot actor, idle")
    r = _post(base, body(max_tokens=4))
    assert r.headers["x-request-tier"] == "hot", r.headers
    ending = call(base, body(max_tokens=4, stream=True))
    assert ending.is_complete and ending.text, ending
    assert_nothing_left(ray, NAMESPACE)  # the hot actor idle, nothing reserved, no orphan
    assert len(_request_actors(ray)) == 1
