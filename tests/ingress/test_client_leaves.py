"""Clients that leave: during admission, mid-stream; and a burst past capacity. Each request ends one of
the three ways, and nothing it reserved outlives it. Over the in-process cluster, whose registry answers
each admission `ADMIT_DELAY_S` after committing it (`SlowCluster`): a client can leave with a commit made."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from serve_app.local_cluster import LocalCluster, LocalClusterSpec
from tests.ingress.local import BASE_ARGS, MODEL, LocalServer, assert_nothing_left
from tests.reliability import harness
from tests.reliability.faults import FaultyActor
from tests.reliability.harness import assert_documented_error, body, call
from tests.serve.waiting import wait_for

NUM_SLOTS = 2  # one actor per slot and batches of one: exactly two requests run at once
ADMIT_DELAY_S = 1.0
# A refusal makes one registry call (ADMIT_DELAY_S) and no actor call; on a busy CI machine within this.
REFUSAL_BOUND_S = ADMIT_DELAY_S * (NUM_SLOTS + 3) + 10


class SlowCluster(LocalCluster):
    """A registry that commits each admission at once and answers it `ADMIT_DELAY_S` later."""

    async def admit(self, *args, **kwargs):
        decision = await super().admit(*args, **kwargs)
        await asyncio.sleep(ADMIT_DELAY_S)
        return decision


@pytest.fixture(scope="module")
def server(tiny_zqs):
    local = LocalServer(BASE_ARGS | {"models": [{"id": MODEL, "zqs_path": str(tiny_zqs)}],
                                     "registry_timeout_s": 30.0,
                                     "policy": {"max_hot_short_actors": 0, "max_batch": 1}},
                        LocalClusterSpec(FaultyActor, SlowCluster))
    yield local
    local.stop()


@pytest.fixture(scope="module")
def zq(server) -> str:
    return server.base


def test_a_client_that_leaves_while_its_admission_is_decided_leaves_nothing_reserved(zq, server):
    with pytest.raises(httpx.ReadTimeout):  # it leaves after 0.3 s; the decision comes after 1 s
        httpx.post(f"{zq}/v1/messages", json=body(max_tokens=64), timeout=0.3)
    time.sleep(ADMIT_DELAY_S)  # its admission was committed, then abandoned when the client left
    assert server.cluster.calls["abandon"] == 1  # the call was cancelled: the committed admission undone
    assert_nothing_left(server)
    assert call(zq, body()).is_complete  # the slot it would have held is free


def test_a_client_that_leaves_mid_stream_frees_its_row(zq, server, tmp_path):
    gate = tmp_path / "gate"  # never opened: the stream holds its last item until the client leaves
    with httpx.stream("POST", f"{zq}/v1/messages", json=body(f"hello gate:{gate}", max_tokens=40, stream=True),
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break  # the first token: it is computing; the client goes
    assert_nothing_left(server)
    assert not gate.exists()


def test_a_burst_of_capacity_plus_k_runs_capacity_and_refuses_k_at_once(zq, server, tmp_path):
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
    assert_nothing_left(server)
