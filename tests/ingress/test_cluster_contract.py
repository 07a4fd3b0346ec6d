"""The port's contract: the in-process cluster and Ray's agree, scenario by scenario.

The same app (`IngressApp` on uvicorn, no Serve) runs once over `LocalClusterSpec` and once over
`RayClusterSpec` — the real registry actor and request actors as Ray processes — with the same
config, the same FaultyActor, the same requests and the same expectations: where a request runs
(X-Request-Tier), how it ends (status, error type) and what the registry's books hold after it.

Scenarios, in order on one app: a warm actor bound; a spawn; a dispatch to the idle hot actor; a
join to a busy one; a refusal; a stream cancelled by its client; an actor lost before its first item
(placed again) and after it (the stream's error event). Faults are FaultyActor's (`gate:`, `once:`,
`fault:`): on Ray a death is the process's exit, in-process the actor ends itself.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from serve_app.sse import decode_events
from tests.ingress.local import MODEL, LocalServer
from tests.reliability.faults import FaultyActor
from tests.serve.waiting import wait_for

WARM_MODEL = "zq-tiny-warm"  # the same file under a second id, whose one warm actor serves once and exits
NAMESPACE = "zq-contract-tests"


def _args(zqs_path) -> dict:
    return {
        "models": [{"id": MODEL, "zqs_path": str(zqs_path)}, {"id": WARM_MODEL, "zqs_path": str(zqs_path)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 3, "cpu_slot_bytes": 1 << 30},
        "policy": {"max_hot_short_actors": 1, "hot_overrides": [[WARM_MODEL, 0, 0]],
                   "warm_overrides": [[WARM_MODEL, 1, 0]], "max_batch": 2, "actor_overhead_bytes": 1 << 20},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1, "warm_layers": 1},
        # A spawn makes the replica want a start lease for the demand window, which the registry grants once the
        # hot actor's rows are all leased: a placeholder actor of the model, starting, that the scenarios' count of
        # the model's actors then met (once under load: the books held it beside the hot actor). Start leases are
        # tests/unit/test_start_leases.py's; these scenarios take the slow path for binds and spawns.
        "leases": {"is_start_enabled": False},
        "namespace": NAMESPACE,
        "warm_refresh_s": 0.2,
        "ping_interval_s": 0.2,
    }


# Ray's run ("[ray]") needs the session's Ray cluster: under xdist, in the worker that holds it (tests/conftest.py).
@pytest.fixture(scope="module", params=["local", "ray"])
def server(request, tiny_zqs):
    from serve_app.local_cluster import LocalClusterSpec

    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        from serve_app.ray_cluster.cluster import RayClusterSpec

        spec = RayClusterSpec(actor_cls=FaultyActor)
    else:
        spec = LocalClusterSpec(actor_cls=FaultyActor)
    app = LocalServer(_args(tiny_zqs), spec)
    yield app
    app.stop()  # the last replica detaches: on Ray the registry kills every actor of the namespace, then itself


def _post(server: LocalServer, text: str = "hi", model: str = MODEL, max_tokens: int = 4, stream: bool = False,
          headers: dict | None = None) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "stream": stream, "seed": 3, "temperature": 0.7,
            "messages": [{"role": "user", "content": text}]}
    return httpx.post(f"{server.base}/v1/messages", json=body, headers=headers or {}, timeout=120)


def _actors(server: LocalServer, model: str, state: str | None = None) -> list:
    return [a for a in server.books().actors if a.model == model and (state is None or a.state == state)]


def _names(server: LocalServer, model: str) -> set[str]:
    return {a.name for a in _actors(server, model)}


def _the_hot_actor(server: LocalServer) -> str:
    """The one actor of MODEL the scenarios before left; where there is not exactly one, the books say what there is."""
    actors = _actors(server, MODEL)
    assert len(actors) == 1, [(a.name, a.state, a.is_hot, a.num_rows) for a in server.books().actors]
    return actors[0].name


def _settled(server: LocalServer) -> None:
    """No row held, nothing starting: the next scenario starts from books at rest."""
    wait_for(lambda: all(a.num_rows == 0 and a.state in ("idle", "warm") for a in server.books().actors), 60,
             "the books at rest")


def test_a_warm_actor_is_bound_and_its_pool_refilled(server):
    wait_for(lambda: _actors(server, WARM_MODEL, "warm"), 120, "the warm pool filled")
    (warm,) = _actors(server, WARM_MODEL, "warm")
    r = _post(server, model=WARM_MODEL)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-tier"] == "warm"
    # It served its one request (no hot actors for this model) and is gone; another warm actor replaces it.
    wait_for(lambda: (names := {a.name for a in _actors(server, WARM_MODEL, "warm")}) and warm.name not in names,
             120, "the pool refilled with a new warm actor")


def test_a_first_request_spawns_and_its_actor_stays_hot(server):
    r = _post(server)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-tier"] == "cold"
    _settled(server)
    assert len(_actors(server, MODEL, "idle")) == 1


def test_the_next_request_is_dispatched_to_the_idle_hot_actor(server):
    before = _names(server, MODEL)
    r = _post(server)
    assert (r.status_code, r.headers["x-request-tier"]) == (200, "hot"), r.text
    _settled(server)
    assert _names(server, MODEL) == before


def test_a_request_joins_the_busy_hot_actors_batch(server, tmp_path):
    before = _names(server, MODEL)
    gate = tmp_path / "gate"
    held: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: held.append(_post(server, f"hold gate:{gate}")), daemon=True)
    holder.start()
    try:
        wait_for(lambda: sum(a.num_rows for a in _actors(server, MODEL)) == 1, 60, "the holder's row")
        r = _post(server, max_tokens=2)
        # Hot, on the same actor: with that actor busy and its quota of one hot actor used, only a join is.
        assert (r.status_code, r.headers["x-request-tier"]) == (200, "hot"), r.text
        assert _names(server, MODEL) == before
    finally:
        gate.touch()
        holder.join(120)
    assert held and held[0].status_code == 200, held
    _settled(server)


def test_an_unmeetable_target_is_refused_with_retry_after_and_places_nothing(server):
    before = {a.name for a in server.books().actors}
    r = _post(server, headers={"x-zq-ttft-target-s": "0.000001"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
    assert int(r.headers["retry-after"]) >= 1
    assert {a.name for a in server.books().actors} == before
    assert sum(a.num_rows for a in server.books().actors) == 0


def test_a_stream_its_client_leaves_gives_its_row_back_and_the_actor_stays_hot(server, tmp_path):
    before = _names(server, MODEL)
    gate = tmp_path / "gate"  # its Completion never comes while the client is there
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "seed": 3, "temperature": 0.7,
            "messages": [{"role": "user", "content": f"leave gate:{gate}"}]}
    with httpx.stream("POST", f"{server.base}/v1/messages", json=body, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("event: content_block_start"):
                break
    _settled(server)  # the row released (as cancelled) once the client's leaving is seen
    gate.touch()
    assert _names(server, MODEL) == before
    r = _post(server)
    assert (r.status_code, r.headers["x-request-tier"]) == (200, "hot"), r.text


def test_an_actor_lost_before_its_first_item_costs_an_attempt_and_the_request_is_placed_again(server, tmp_path):
    hot = _the_hot_actor(server)
    r = _post(server, f"x fault:die-before-start once:{tmp_path / 'once'}")
    # The hot actor died under it; the registry forgot it, and the request was decided again: a new actor.
    assert (r.status_code, r.headers["x-request-tier"]) == (200, "cold"), r.text
    _settled(server)
    assert hot not in _names(server, MODEL)


def test_an_actor_lost_after_its_first_item_ends_the_stream_with_an_error_event(server):
    hot = _the_hot_actor(server)
    r = _post(server, "x fault:die-mid-decode", max_tokens=8, stream=True)
    assert r.status_code == 200
    events = decode_events(r.content)
    types = [e["type"] for e in events if e["type"] != "ping"]
    assert types == ["message_start", "content_block_start", "error"], types
    assert events[-1]["error"]["type"] == "overloaded_error"  # capacity lost, not a bug: retry
    _settled(server)
    assert hot not in _names(server, MODEL)
