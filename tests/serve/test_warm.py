"""Warm pools on real Ray Serve and real HTTP: bind, refill, a warm actor lost, eviction, and the app's end."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import SERVE_PORT, named_actors
from tests.serve.waiting import wait_for

NAMESPACE = "zq-warm-tests"
MODEL = "zq-tiny"
OTHER = "zq-layered"
APP = "zeroqueue-warm"
PORT = SERVE_PORT
POOL = 2  # the tiny model's short-lane warm actors: one per slot


def _build(tiny_zqs, layered_zqs):
    from serve_app.app import build_app

    return build_app({
        "models": [{"id": MODEL, "zqs_path": str(tiny_zqs)}, {"id": OTHER, "zqs_path": str(layered_zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 2, "cpu_slot_bytes": 1 << 30},
        # No hot actors: a bound warm actor serves its one request and exits, so the pool refills.
        "policy": {"short_max_input_tokens": 512, "short_max_output_tokens": 256, "max_hot_short_actors": 0,
                   "max_hot_long_actors": 0, "warm_overrides": [[MODEL, POOL, 0]], "max_idle_s": 600},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1, "warm_layers": 1},
        "namespace": NAMESPACE,
        "warm_refresh_s": 0.2,
    })


@pytest.fixture(scope="module")
def zq(deploy_app, tiny_zqs, layered_zqs):
    return deploy_app(PORT, APP, _build(tiny_zqs, layered_zqs), NAMESPACE)


def _registry(ray):
    return ray.get_actor("zq-registry", namespace=NAMESPACE)


def _actors_by_state(ray) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in ray.get(_registry(ray).snapshot.remote()).actors:
        out.setdefault(a.state, []).append(a.name)
    return out


def _named(ray) -> set[str]:
    return named_actors(ray, NAMESPACE)


def _wait_for(predicate, timeout=60.0, what="condition"):
    wait_for(predicate, timeout, what)  # the pool's actors take seconds to start


def _post(base, model=MODEL, max_tokens=12, seed=5) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "messages": [{"role": "user", "content": "Why do queues hurt tail latency?"}]}
    return httpx.post(f"{base}/v1/messages", json=body, timeout=120)


def _pool_full(ray) -> bool:
    return len(_actors_by_state(ray).get("warm", [])) == POOL


def _in_process_text(zqs, max_tokens=12, seed=5) -> str:
    from actors.engine import Engine
    from actors.layer_loader import load_zqs
    from actors.sampling import SamplingParams
    from serve_app import api
    from serve_app.prompt import prompt_for

    model, tokenizer = load_zqs(zqs)
    req = api.parse_messages_request(
        {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
         "messages": [{"role": "user", "content": "Why do queues hurt tail latency?"}]})
    prompt, sampling = prompt_for(req, tokenizer, 2048)
    assert isinstance(sampling, SamplingParams)
    events = Engine(model, tokenizer).generate(prompt, sampling)
    return "".join(e.text for e in events if hasattr(e, "token_id"))


def test_a_request_binds_a_warm_actor_and_gets_what_a_fresh_actor_computes(zq, ray_cluster, tiny_zqs):
    ray = ray_cluster
    _wait_for(lambda: _pool_full(ray), what="the warm pool to fill")
    warm = set(_actors_by_state(ray)["warm"])
    r = _post(zq)
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Tier"] == "warm"
    assert r.json()["content"][0]["text"] == _in_process_text(tiny_zqs)
    # The bound actor served its one request and exits; the pool refills to its size, never past it.
    sizes = []

    def refilled() -> bool:
        states = _actors_by_state(ray)
        sizes.append(len(states.get("warm", [])) + len(states.get("warming", [])))
        return len(states.get("warm", [])) == POOL and not warm <= set(states["warm"])

    _wait_for(refilled, what="the pool to refill with a new warm actor")
    assert max(sizes) <= POOL
    ray.get(_registry(ray).check_invariants.remote())


def test_a_warm_actor_that_dies_unseen_is_replaced_and_its_request_placed_elsewhere(zq, ray_cluster):
    ray = ray_cluster
    _wait_for(lambda: _pool_full(ray), what="the warm pool to fill")
    for name in _actors_by_state(ray)["warm"]:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)  # both: the registry still lists them
    r = _post(zq)
    assert r.status_code == 200, r.text  # bound to a dead actor, found out, decided again: a fresh spawn
    assert r.headers["request-id"].startswith("req_") and r.headers["X-Request-Tier"] == "cold"
    _wait_for(lambda: _pool_full(ray), what="the pool to be rebuilt")
    ray.get(_registry(ray).check_invariants.remote())


def test_another_models_request_evicts_a_warm_actor_and_the_evicted_actor_leaves_rays_table(zq, ray_cluster):
    ray = ray_cluster
    _wait_for(lambda: _pool_full(ray), what="the warm pool to fill")  # both slots held by warm tiny actors
    warm = set(_actors_by_state(ray)["warm"])
    r = _post(zq, model=OTHER, max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Tier"] == "cold"
    evicted = warm - set(_actors_by_state(ray).get("warm", []))
    assert len(evicted) == 1
    _wait_for(lambda: not evicted & _named(ray), what="the evicted actor to leave Ray's actor table")
    _wait_for(lambda: _pool_full(ray), what="the pool to refill once the other model's actor is gone")


def test_deleting_the_app_leaves_no_actor_and_no_registry_behind(zq, ray_cluster):
    ray = ray_cluster
    from ray import serve

    _wait_for(lambda: _pool_full(ray), what="the warm pool to fill")
    assert _named(ray)  # warm actors, the registry and a telemetry agent
    serve.delete(APP)
    _wait_for(lambda: not _named(ray), timeout=30, what="every actor of the app to be gone")


def test_serve_shutdown_leaves_no_actor_and_no_registry_behind(zq, ray_cluster, tiny_zqs, layered_zqs):
    ray = ray_cluster
    from ray import serve

    serve.run(_build(tiny_zqs, layered_zqs), name=APP, route_prefix="/")  # again, after the test above deleted it
    _wait_for(lambda: _pool_full(ray), what="the warm pool to fill")
    serve.shutdown()
    _wait_for(lambda: not _named(ray), timeout=30, what="every actor of the app to be gone")
