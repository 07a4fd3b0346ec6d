"""Warm pools on real Ray Serve: the app's end takes every warm actor and the registry with it, whether the
app is deleted or Serve shut down. Binding, refilling, a warm actor lost unseen and eviction are tested over
the in-process cluster (tests/ingress/test_warm.py)."""

from __future__ import annotations

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


def _wait_all_gone(ray) -> None:
    wait_for(lambda: not _named(ray), 30, "every actor of the app to be gone",
             detail=lambda: f"still alive: {sorted(_named(ray))}")


def _pool_full(ray) -> bool:
    return len(_actors_by_state(ray).get("warm", [])) == POOL


def test_deleting_the_app_leaves_no_actor_and_no_registry_behind(zq, ray_cluster):
    ray = ray_cluster
    from ray import serve

    _wait_for(lambda: _pool_full(ray), what="the warm pool to fill")
    assert _named(ray)  # warm actors, the registry and a telemetry agent
    serve.delete(APP)
    _wait_all_gone(ray)


def test_serve_shutdown_leaves_no_actor_and_no_registry_behind(zq, ray_cluster, tiny_zqs, layered_zqs):
    ray = ray_cluster
    from ray import serve

    serve.run(_build(tiny_zqs, layered_zqs), name=APP, route_prefix="/")  # again, after the test above deleted it
    _wait_for(lambda: _pool_full(ray), what="the warm pool to fill")
    serve.shutdown()
    _wait_all_gone(ray)
