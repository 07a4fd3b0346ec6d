"""The registry lost for good: every admission is a fast 503 with its request id, never a 500 or a hang."""

from __future__ import annotations

import time

import httpx
import pytest

NAMESPACE = "zq-registry-loss-tests"
APP = "zeroqueue-registry-loss"
PORT = 8768
# What the slowest CI machine meets for a refusal that makes no registry call at all: the
# deadline is registry_timeout_s (0.25 s), plus the proxy and the ingress on a busy 2-core box.
BOUND_S = 2.0


@pytest.fixture(scope="module")
def zq(ray_cluster, tiny_zqs):
    from ray import serve

    from serve_app.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app({
        "models": [{"id": "zq-tiny", "zqs_path": str(tiny_zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 1 << 30},
        "policy": {"max_hot_short_actors": 0},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "namespace": NAMESPACE,
    }), name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{PORT}"
    serve.shutdown()
    for a in ray_cluster.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == NAMESPACE:
            ray_cluster.kill(ray_cluster.get_actor(a["name"], namespace=NAMESPACE))


def _post(base: str) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/messages", timeout=60, json={
        "model": "zq-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    return r, time.monotonic() - t0


def test_with_the_registry_dead_every_request_is_a_fast_503_with_its_request_id(zq, ray_cluster):
    ray = ray_cluster
    ok, _ = _post(zq)
    assert ok.status_code == 200, ok.text
    ray.kill(ray.get_actor("zq-registry", namespace=NAMESPACE), no_restart=True)  # gone for good
    for _ in range(5):
        r, took = _post(zq)
        assert r.status_code == 503, r.text  # was a 500 (the dead actor's error) before the deadline
        body = r.json()
        assert body["error"]["type"] == "overloaded_error" and body["request_id"] == r.headers["request-id"]
        assert float(r.headers["retry-after-ms"]) > 0
        assert took < BOUND_S, took
