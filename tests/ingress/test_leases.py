"""Leases on real HTTP over the in-process cluster: requests on a hot actor make no registry call, two
replicas share one hot batch to its last row whatever the split, and a silent replica's rows return."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.ingress.local import LocalServer, serve_locally
from tests.serve.waiting import wait_for

MODEL = "zq-tiny"
HEARTBEAT_S = 0.5
PROMPTS = [f"Question {i}: why do queues hurt tail latency?" for i in range(8)]


def _body(text: str, max_tokens: int = 2, stream: bool = False) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}


def _post(base: str, body: dict, replica: int | None = None) -> httpx.Response:
    headers = {} if replica is None else {"x-zq-replica": str(replica)}
    return httpx.post(f"{base}/v1/messages", json=body, headers=headers, timeout=120)


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["content"][0]["text"]


def _leases(server: LocalServer, i: int = 0):
    return server.apps[i].ingress.admission.leases


def _holds_valid_rows(server: LocalServer, i: int = 0) -> bool:
    return server.on_loop(lambda: _leases(server, i).num_rows > 0 and _leases(server, i).is_valid())


@pytest.fixture
def one_replica(tiny_zqs):
    server = serve_locally(tiny_zqs, registry_heartbeat_s=HEARTBEAT_S,
                           policy={"num_warm_short_actors": 0, "num_warm_long_actors": 0})
    yield server
    server.stop()


def test_sequential_requests_on_a_hot_actor_make_no_registry_call_but_the_heartbeat(one_replica):
    zq = one_replica.base
    for _ in range(2):  # a cold start, then a row the slow path leases to this replica
        _text(_post(zq, _body(PROMPTS[0])))
    wait_for(lambda: _holds_valid_rows(one_replica), what="a leased row, renewed by a heartbeat")
    before, started = dict(one_replica.cluster.calls), time.monotonic()
    with httpx.Client(timeout=120) as client:
        for i in range(50):
            body = _body(PROMPTS[i % len(PROMPTS)], stream=bool(i % 2))
            if body["stream"]:
                with client.stream("POST", f"{zq}/v1/messages", json=body) as s:
                    assert s.status_code == 200 and "event: message_stop" in s.read().decode()
            else:
                assert client.post(f"{zq}/v1/messages", json=body).status_code == 200
    elapsed = time.monotonic() - started
    calls = {k: n - before.get(k, 0) for k, n in one_replica.cluster.calls.items() if n != before.get(k, 0)}
    assert set(calls) <= {"exchange_leases"}, calls  # no admit, finish, abandon or actor_started
    # The bound, one exchange a heartbeat, counted against the wall time the requests took (whatever
    # this machine's speed), with one more for an exchange in flight at each end.
    assert calls.get("exchange_leases", 0) <= elapsed / HEARTBEAT_S + 2, (calls, elapsed)


@pytest.fixture
def two_replicas(tiny_zqs):
    """Two ingress replicas on one slot: one hot actor, whose batch of 8 rows is all the capacity there is."""
    server = serve_locally(tiny_zqs, num_replicas=2, registry_heartbeat_s=HEARTBEAT_S,
                           slots={"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 1 << 30},
                           policy={"num_warm_short_actors": 0, "num_warm_long_actors": 0, "max_batch": 8,
                                   "max_hot_short_actors": 1})
    yield server
    server.stop()


@pytest.mark.parametrize("split", [(4, 4), (7, 1), (1, 7)])
def test_two_replicas_fill_one_hot_batch_to_its_last_row_whatever_the_split(two_replicas, split):
    """Each replica holds spare rows from the sequential requests first; a burst split unevenly must not be
    refused while the other replica's rows sit free (the slow path recalls them)."""
    zq = two_replicas.base
    alone = {p: _text(_post(zq, _body(p, max_tokens=24), replica=i % 2)) for i, p in enumerate(PROMPTS)}
    wait_for(lambda: _holds_valid_rows(two_replicas, 0) and _holds_valid_rows(two_replicas, 1),
             what="both replicas holding leased rows")
    actors = two_replicas.actor_names()
    assert len(actors) == 1
    replicas = [0] * split[0] + [1] * split[1]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda pr: _post(zq, _body(pr[0], max_tokens=24), replica=pr[1]),
                                 zip(PROMPTS, replicas, strict=True)))
    assert [r.status_code for r in together] == [200] * len(PROMPTS), [r.text for r in together]
    assert {p: _text(r) for p, r in zip(PROMPTS, together, strict=True)} == alone
    assert two_replicas.actor_names() == actors  # every one joined the hot batch: no new process


def test_a_silent_replicas_leases_return_and_the_other_replica_gets_their_rows(two_replicas):
    zq = two_replicas.base
    for i in range(4):
        _text(_post(zq, _body(PROMPTS[i]), replica=1))
    wait_for(lambda: _holds_valid_rows(two_replicas, 1), what="replica 1 holding leased rows")
    silent = two_replicas.apps[1].ingress.admission
    two_replicas.on_loop(lambda: silent._gauges.cancel())  # it stops reporting, as a replica that hangs or dies
    registry = two_replicas.cluster.registry

    def rows_of_silent() -> int:
        with registry._lock:
            return sum(1 for a in registry._state.books.actors.values() for r in a.rows.values()
                       if r.is_lease and r.replica_id == silent.leases.replica_id)

    assert rows_of_silent() > 0
    wait_for(lambda: rows_of_silent() == 0, timeout=silent.leases.ttl_s + 5, what="its leases to expire")
    # Its rows are anyone's again: the other replica fills the whole batch.
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: _post(zq, _body(p, max_tokens=24), replica=0), PROMPTS))
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
