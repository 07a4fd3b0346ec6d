"""Warm pools over the in-process cluster, on real HTTP: bind, refill, a warm actor lost unseen, eviction.
What only Serve shows — every actor gone with the app, or with `serve shutdown` — is in tests/serve/test_warm.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from actors.request_actor import RequestActor
from tests.ingress.local import LocalServer, serve_locally
from tests.serve.waiting import wait_for

MODEL = "zq-tiny"
OTHER = "zq-layered"
POOL = 2  # the tiny model's short-lane warm actors: one per slot
ARGS = {
    # No hot actors: a bound warm actor serves its one request and exits, so the pool refills.
    "policy": {"short_max_input_tokens": 512, "short_max_output_tokens": 256, "max_hot_short_actors": 0,
               "max_hot_long_actors": 0, "warm_overrides": [[MODEL, POOL, 0]], "max_idle_s": 600},
    "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1, "warm_layers": 1},
    "warm_refresh_s": 0.2,
}


@pytest.fixture(scope="module")
def server(tiny_zqs, layered_zqs):
    local = serve_locally(tiny_zqs, models=[{"id": MODEL, "zqs_path": str(tiny_zqs)},
                                            {"id": OTHER, "zqs_path": str(layered_zqs)}], **ARGS)
    yield local
    local.stop()


def _actors_by_state(server: LocalServer) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in server.books().actors:
        out.setdefault(a.state, []).append(a.name)
    return out


def _post(server: LocalServer, model=MODEL, max_tokens=12, seed=5) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "messages": [{"role": "user", "content": "Why do queues hurt tail latency?"}]}
    return httpx.post(f"{server.base}/v1/messages", json=body, timeout=120)


def _pool_full(server: LocalServer) -> bool:
    return len(_actors_by_state(server).get("warm", [])) == POOL


def _in_process_text(zqs, max_tokens=12, seed=5) -> str:
    from actors.engine import Engine
    from actors.layer_loader import load_zqs
    from serve_app import api
    from serve_app.prompt import prompt_for

    model, tokenizer = load_zqs(zqs)
    req = api.parse_messages_request(
        {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
         "messages": [{"role": "user", "content": "Why do queues hurt tail latency?"}]})
    prompt, sampling = prompt_for(req, tokenizer, 2048)
    events = Engine(model, tokenizer).generate(prompt, sampling)
    return "".join(e.text for e in events if hasattr(e, "token_id"))


def test_a_request_binds_a_warm_actor_and_gets_what_a_fresh_actor_computes(server, tiny_zqs):
    wait_for(lambda: _pool_full(server), 60, "the warm pool to fill")
    warm = set(_actors_by_state(server)["warm"])
    r = _post(server)
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Tier"] == "warm"
    assert r.json()["content"][0]["text"] == _in_process_text(tiny_zqs)
    # The bound actor served its one request and exits; the pool refills to its size, never past it.
    sizes = []

    def refilled() -> bool:
        states = _actors_by_state(server)
        sizes.append(len(states.get("warm", [])) + len(states.get("warming", [])))
        return len(states.get("warm", [])) == POOL and not warm <= set(states["warm"])

    wait_for(refilled, 60, "the pool to refill with a new warm actor")
    assert max(sizes) <= POOL
    server.cluster.registry.check_invariants()


def test_a_warm_actor_that_dies_unseen_is_replaced_and_its_request_placed_elsewhere(server):
    wait_for(lambda: _pool_full(server), 60, "the warm pool to fill")
    for name in _actors_by_state(server)["warm"]:
        server.kill(name)  # both: the books still list them
    r = _post(server)
    assert r.status_code == 200, r.text  # bound to a dead actor, found out, decided again: a fresh spawn
    assert r.headers["request-id"].startswith("req_") and r.headers["X-Request-Tier"] == "cold"
    wait_for(lambda: _pool_full(server), 60, "the pool to be rebuilt")
    server.cluster.registry.check_invariants()


def test_another_models_request_evicts_a_warm_actor_and_the_evicted_actor_is_ended(server):
    wait_for(lambda: _pool_full(server), 60, "the warm pool to fill")  # both slots held by warm tiny actors
    warm = set(_actors_by_state(server)["warm"])
    r = _post(server, model=OTHER, max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Tier"] == "cold"
    # (A warm actor this replica holds on a start lease shows as starting: not evictable, but not evicted.)
    evicted = warm - {a.name for a in server.books().actors}
    assert len(evicted) == 1
    wait_for(lambda: not evicted & server.actor_names(), 30, "the evicted actor to be ended")
    wait_for(lambda: _pool_full(server), 60, "the pool to refill once the other model's actor is gone")


class SlowToWarm(RequestActor):
    """A warm actor whose start takes a second more, as a process start on a busy machine does."""

    async def ready(self, timeout_s=None):
        await asyncio.sleep(1.0)
        return await super().ready(timeout_s)


def test_a_replica_that_waits_for_its_first_warm_actors_serves_its_first_request_warm(tiny_zqs):
    # The server reports started once the lifespan's startup, the ingress's constructor, has returned: as Serve
    # routes to a replica (and `serve run` says the app is ready) only once its constructor has.
    local = serve_locally(tiny_zqs, SlowToWarm, startup_wait_s=30, **ARGS)
    try:
        states = [a.state for a in local.books().actors]
        assert "warm" in states, states  # without the wait: only "warming" here, and the request refused
        r = _post(local)
        assert r.status_code == 200, r.text
        assert r.headers["X-Request-Tier"] == "warm"
    finally:
        local.stop()


def test_a_replica_whose_warm_actors_cannot_start_answers_once_its_wait_is_over(tiny_zqs, caplog):
    # Slots too small for any actor: the pool never fills, and the replica gives up waiting after startup_wait_s;
    # it then answers, here that the model cannot fit (no slot could ever take it).
    local = serve_locally(tiny_zqs, startup_wait_s=0.5, slots={"kind": "cpu", "num_cpu_slots": 2,
                                                               "cpu_slot_bytes": 1 << 20}, **ARGS)
    try:
        assert "no warm actor of ['zq-tiny'] ready within startup_wait_s" in caplog.text
        r = _post(local)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    finally:
        local.stop()
