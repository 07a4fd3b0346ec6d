"""Refusals before tokenizing: after the registry refused a model for want of capacity, the replica refuses
its next requests itself for `early_refusal_s`, with the slow path's retry-after and no registry call; as
the window ends one request (the probe) asks the registry again while the others are still refused; after a
lull nobody is refused on an old answer. Over the in-process cluster: one slot, a batch of one row, held
by a gated request (FaultyActor's `gate:`), so that every other request finds no place."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_app.local_cluster import LocalCluster, LocalClusterSpec
from tests.ingress.local import BASE_ARGS, MODEL, LocalServer, assert_nothing_left
from tests.reliability.faults import FaultyActor
from tests.reliability.harness import assert_documented_error, body, call
from tests.serve.waiting import wait_for

EARLY_REFUSAL_S = 1.0  # long, so that "within the window" holds on a slow machine
ADMIT_DELAY_S = 0.5  # the probe's admission is in flight this long: the others arrive meanwhile


class SlowAdmit(LocalCluster):
    """A registry that answers each admission `ADMIT_DELAY_S` late."""

    async def admit(self, *args, **kwargs):
        decision = await super().admit(*args, **kwargs)
        await asyncio.sleep(ADMIT_DELAY_S)
        return decision


@pytest.fixture
def server(tiny_zqs):
    local = LocalServer(BASE_ARGS | {"models": [{"id": MODEL, "zqs_path": str(tiny_zqs)}],
                                     "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 1 << 30},
                                     "early_refusal_s": EARLY_REFUSAL_S, "registry_timeout_s": 30.0,
                                     "policy": {"max_hot_short_actors": 1, "max_batch": 1,
                                                "num_warm_short_actors": 0, "num_warm_long_actors": 0}},
                        LocalClusterSpec(FaultyActor, SlowAdmit))
    yield local
    local.stop()


def _admits(server: LocalServer) -> int:
    return server.cluster.calls.get("admit", 0)


def _hold_the_row(server: LocalServer, gate, pool: ThreadPoolExecutor):
    """The one row runs a request until `gate` exists; returns its future."""
    holder = pool.submit(call, server.base, body(f"hold gate:{gate}", max_tokens=4))
    wait_for(lambda: server.on_loop(lambda: server.app.ingress.admission.num_running) == 1, 60,
             "the holder running in the only row")
    return holder


def _at_once(pool: ThreadPoolExecutor, server: LocalServer, n: int):
    """`n` requests sent together (a barrier: within a millisecond or so of each other); their endings."""
    barrier = threading.Barrier(n)

    def send(i: int):
        barrier.wait(30)
        return call(server.base, body(f"together {i}"))

    return list(pool.map(send, range(n)))


def _refused_by_the_registry(server: LocalServer) -> None:
    before = _admits(server)
    ending = call(server.base, body())
    assert_documented_error(ending, 503, "overloaded_error")
    assert _admits(server) == before + 1


@contextlib.contextmanager
def _the_row_held_and_a_refusal(server: LocalServer, tmp_path, num_threads: int):
    """The one row held by a gated request and the registry's refusal of the next: the window is open. On
    leaving, the gate opens, the holder completes and nothing is left reserved."""
    gate = tmp_path / "gate"
    with ThreadPoolExecutor(num_threads) as pool:
        holder = _hold_the_row(server, gate, pool)
        _refused_by_the_registry(server)
        yield pool
        gate.touch()
        assert holder.result(60).is_complete
    assert_nothing_left(server)


def test_within_the_window_a_model_is_refused_with_no_registry_call(server, tmp_path):
    with _the_row_held_and_a_refusal(server, tmp_path, 2):
        before, started = _admits(server), time.monotonic()
        answers, answered_at = [], []
        for i in range(5):
            answers.append(httpx.post(f"{server.base}/v1/messages", json=body(f"again {i}"), timeout=60))
            answered_at.append(time.monotonic())
        if time.monotonic() - started < EARLY_REFUSAL_S:  # all within the window (else the check says nothing)
            assert _admits(server) == before
        for r in answers:
            assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
            assert int(r.headers["retry-after"]) >= 1
        # Each is told a later place than the one before (retry_line.py): told one instant, clients that
        # honour it would all come back together and be refused again. The places are a predicted hold of
        # this 8-token request apart (~0.27 s with one row running), far beyond any response's jitter.
        told_at = [t + int(r.headers["retry-after-ms"]) / 1000 for t, r in zip(answered_at, answers, strict=True)]
        assert all(later > earlier for earlier, later in zip(told_at, told_at[1:], strict=False)), told_at
    assert call(server.base, body()).is_complete  # the row freed: no early refusal stands in its way


def test_as_the_window_ends_one_probe_asks_the_registry_and_the_rest_are_refused(server, tmp_path):
    with _the_row_held_and_a_refusal(server, tmp_path, 12) as pool:
        time.sleep(EARLY_REFUSAL_S)  # the window has ended; no request came since
        before = _admits(server)
        # Eight at once: the first is the probe, in the registry for ADMIT_DELAY_S; the other seven arrive
        # meanwhile. None gets the held row.
        endings = _at_once(pool, server, 8)
        assert _admits(server) == before + 1
        for ending in endings:
            assert_documented_error(ending, 503, "overloaded_error")


def test_after_a_lull_requests_are_not_refused_on_an_old_answer(server, tmp_path):
    with _the_row_held_and_a_refusal(server, tmp_path, 8) as pool:
        time.sleep(2 * EARLY_REFUSAL_S + 0.1)  # the window and another as long: nobody came
        before = _admits(server)
        endings = _at_once(pool, server, 4)
        assert _admits(server) == before + 4  # each asked the registry (and was refused: the row is held)
        for ending in endings:
            assert_documented_error(ending, 503, "overloaded_error")
