"""An ingress replica dies mid-stream: Serve replaces it, the registry releases what it relayed, and
the app serves again.

What the client of the dead replica sees is Serve's proxy's doing, not ours: a process that is gone
cannot send an error event, and the proxy ends the stream (or answers a bare 500 to a request that
had not started its response). What the app owes is that the stream ends rather than hangs, that
nothing the dead replica reserved outlives `replica_silence_s`, and that new requests are served.
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

NAMESPACE = "zq-replica-loss-tests"
APP = "zeroqueue-replica-loss"
PORT = SERVE_PORT
# Ten missed heartbeats (replica_silence_s), one reconcile pass, Serve starting a new replica, on a slow machine.
RELEASE_BOUND_S = 60.0


@pytest.fixture(scope="module")
def zq(ray_cluster, tiny_zqs):
    base = harness.deploy(PORT, APP, NAMESPACE, tiny_zqs, actor_cls=FaultyActor,
                          policy={"max_hot_short_actors": 0})
    yield base
    harness.undeploy(ray_cluster, NAMESPACE)


def _replica_actors(ray) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and "SERVE_REPLICA" in a["name"] and APP in a["name"]]


def test_a_replica_killed_mid_stream_ends_the_stream_and_leaves_nothing_reserved(zq, ray_cluster, tmp_path):
    ray = ray_cluster
    gate = tmp_path / "gate"  # never opened: the stream runs until its replica dies
    ended: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{zq}/v1/messages", timeout=RELEASE_BOUND_S,
                              json=body(f"a long answer gate:{gate}", max_tokens=16, stream=True)) as r:
                for _ in r.iter_lines():
                    pass
            ended.append("closed")
        except httpx.HTTPError as e:  # the proxy cut the stream: an ending the client can see at once
            ended.append(type(e).__name__)

    client = threading.Thread(target=stream)
    client.start()
    registry = harness.registry(ray, NAMESPACE)
    wait_for(lambda: any(a.num_rows for a in ray.get(registry.snapshot.remote()).actors), 30,
             "the stream to be running")
    [replica] = _replica_actors(ray)
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=False)
    t0 = time.monotonic()
    client.join(RELEASE_BOUND_S)
    assert ended, "the client's stream did not end"
    assert_nothing_left(ray, NAMESPACE, timeout=RELEASE_BOUND_S)  # the rows and the actor it ran on
    assert time.monotonic() - t0 < RELEASE_BOUND_S
    wait_for(lambda: _is_served(zq), RELEASE_BOUND_S, "a new replica serving")


def _is_served(base: str) -> bool:
    try:
        return call(base, body(max_tokens=2)).is_complete
    except ValueError:  # Serve's own plain-text 503 while no replica is up
        return False
