"""Clients that leave: during admission, mid-stream; and a burst past capacity. Each request ends one of
the three ways, and nothing it reserved outlives it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.helpers import SERVE_PORT
from tests.reliability import harness
from tests.reliability.faults import FaultyActor, SlowRegistry
from tests.reliability.harness import assert_documented_error, assert_nothing_left, body, call
from tests.serve.waiting import wait_for

NAMESPACE = "zq-client-leaves-tests"
PORT = SERVE_PORT
NUM_SLOTS = 2  # one actor per slot and batches of one: exactly two requests run at once
# A refusal makes one registry call (SlowRegistry: 2 s) and no actor call; on a busy CI machine within this.
REFUSAL_BOUND_S = SlowRegistry.ADMIT_DELAY_S * (NUM_SLOTS + 3) + 10


@pytest.fixture(scope="module")
def zq(ray_cluster, tiny_zqs):
    base = harness.deploy(PORT, "zeroqueue-client-leaves", NAMESPACE, tiny_zqs, actor_cls=FaultyActor,
                          registry_cls=SlowRegistry,
                          registry_timeout_s=30.0, policy={"max_hot_short_actors": 0, "max_batch": 1})
    yield base
    harness.undeploy(ray_cluster, NAMESPACE)


def test_a_client_that_leaves_while_its_admission_is_decided_leaves_nothing_reserved(zq, ray_cluster):
    with pytest.raises(httpx.ReadTimeout):  # it leaves after 0.5 s; the decision takes 2 s
        httpx.post(f"{zq}/v1/messages", json=body(max_tokens=64), timeout=0.5)
    time.sleep(SlowRegistry.ADMIT_DELAY_S)  # the admission has landed (and been abandoned) by now
    assert_nothing_left(ray_cluster, NAMESPACE)
    assert call(zq, body()).is_complete  # the slot it would have held is free


def test_a_client_that_leaves_mid_stream_frees_its_row(zq, ray_cluster, tmp_path):
    gate = tmp_path / "gate"  # never opened: the stream holds its last item until the client leaves
    with httpx.stream("POST", f"{zq}/v1/messages", json=body(f"hello gate:{gate}", max_tokens=40, stream=True),
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break  # the first token: it is computing; the client goes
    assert_nothing_left(ray_cluster, NAMESPACE)
    assert not gate.exists()


def test_a_burst_of_capacity_plus_k_runs_capacity_and_refuses_k_at_once(zq, ray_cluster, tmp_path):
    k = 3
    gate = tmp_path / "gate"  # the admitted requests hold their answers until every refusal is in
    results: dict[int, harness.Ending] = {}

    def send(i: int) -> None:
        results[i] = call(zq, body(f"burst {i} gate:{gate}", max_tokens=8))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(NUM_SLOTS + k)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(e.status == 503 for e in results.values()) == k, REFUSAL_BOUND_S,
             f"{k} refusals while {NUM_SLOTS} requests run")
    gate.touch()
    for t in threads:
        t.join(120)
    refused = [e for e in results.values() if e.status == 503]
    done = [e for e in results.values() if e.status == 200]
    assert len(refused) == k and len(done) == NUM_SLOTS, results
    for e in refused:
        assert_documented_error(e, 503, "overloaded_error")
        assert e.seconds < REFUSAL_BOUND_S
    assert all(e.is_complete for e in done)
    assert_nothing_left(ray_cluster, NAMESPACE)
