"""Start leases over HTTP on the in-process cluster: once a replica has had to start an actor, its next
bind or spawn is decided and made on its own start lease — a warm actor, or slot bytes for a named actor —
with no registry call, and the registry's books follow it from the next lease report."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_app.local_cluster import LocalClusterSpec
from tests.ingress.local import BASE_ARGS, MODEL, LocalServer
from tests.reliability.faults import FaultyActor
from tests.reliability.harness import body, call
from tests.serve.waiting import wait_for

# Calls a request's own placement or end would make; the warm pool's refill (fill_warm, warm_ready) is not one.
REQUEST_CALLS = {"admit", "finish", "actor_started", "abandon", "give_back"}


def _serve(tiny_zqs, num_warm: int) -> LocalServer:
    """Two slots, one row an actor: a request beside a running one needs an actor of its own."""
    return LocalServer(BASE_ARGS | {"models": [{"id": MODEL, "zqs_path": str(tiny_zqs)}],
                                    "registry_heartbeat_s": 0.5, "early_refusal_s": 0.0,
                                    "policy": {"max_batch": 1, "max_hot_short_actors": 2,
                                               "num_warm_short_actors": num_warm, "num_warm_long_actors": 0}},
                       LocalClusterSpec(FaultyActor))


def _start_lease(server: LocalServer, kind: str):
    """The free start lease of `kind` the replica may use now, if it holds one."""
    book = server.app.ingress.admission.leases

    def find():
        if not book.is_valid():
            return None
        return next((r for r in book._rows.values() if r.start == kind and r.row_id not in book._used), None)

    return server.on_loop(find)


@pytest.mark.parametrize("kind", ["warm", "spawn"])
def test_a_bind_or_a_spawn_on_a_start_lease_makes_no_registry_call(tiny_zqs, tmp_path, kind):
    server = _serve(tiny_zqs, num_warm=1 if kind == "warm" else 0)
    gate = tmp_path / "go"
    try:
        with ThreadPoolExecutor(1) as pool:
            if kind == "warm":
                wait_for(lambda: any(a.state == "warm" for a in server.books().actors), 60, "the warm pool filled")
            # The first request starts an actor through the slow path (a bind, or a spawn) and holds its one row.
            holder = pool.submit(call, server.base, body(f"hold gate:{gate}", max_tokens=4))
            wait_for(lambda: server.on_loop(lambda: server.app.ingress.admission.num_running) == 1 or holder.done(),
                     60, "the first request running")
            assert not holder.done(), holder.result()
            # Having just started one, the replica holds a start lease for the next (the pool refilled the free
            # slot with a warm actor, or the slot's bytes are held for a spawn).
            wait_for(lambda: _start_lease(server, kind) is not None, 60, f"a {kind} start lease")
            lease = _start_lease(server, kind)
            before = dict(server.cluster.calls)
            r = call(server.base, body("the next request", max_tokens=4))
            calls = {k: n - before.get(k, 0) for k, n in server.cluster.calls.items() if n != before.get(k, 0)}
            assert r.status == 200, r
            assert not set(calls) & REQUEST_CALLS, calls  # placed, started and ended with no registry call
            assert lease.actor_name in server.actor_names()
            gate.touch()
            assert holder.result().status == 200
        # The registry follows from the lease reports: the actor started on the lease is hot, its lease used.
        def followed() -> bool:
            actor = next((a for a in server.books().actors if a.name == lease.actor_name), None)
            return actor is not None and actor.is_hot and actor.state in ("idle", "busy")

        wait_for(followed, 30, "the registry to hear of the start")
        registry = server.cluster.registry
        with registry._lock:
            registry._state.check_invariants()
    finally:
        gate.touch()
        server.stop()
