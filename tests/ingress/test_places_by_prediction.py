"""A batch's places are set by prediction, `max_batch` only a safety cap: rows join a hot actor while every
row's TPOT target is predicted to hold, and a join that would break one is not taken. Over HTTP on the
in-process cluster: one slot, so every request is a row of its one hot actor or refused; rows are held
open by gated requests (FaultyActor's `gate:`), and the rule's constants are set so that its
predictions are known here: a step is 10 ms plus 5 ms per extra row, prompts and KV reads ~free
(uncorrected: `is_prediction_corrected` off)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from actors.request_actor import RequestActor
from serve_app.latency_targets import TPOT_HEADER, TTFT_HEADER
from serve_app.local_cluster import LocalClusterSpec
from tests.ingress.local import BASE_ARGS, MODEL, LocalServer, assert_nothing_left, serve_locally
from tests.reliability.faults import FaultyActor
from tests.reliability.harness import assert_documented_error, body, call
from tests.serve.waiting import wait_for

RULE = {"decode_s_per_token": 0.01, "batch_row_cost": 0.5, "prefill_tokens_per_s": 1e9, "kv_read_bytes_per_s": 1e18,
        "actor_start_s": 0.0}


def _serve(tiny_zqs, max_batch: int) -> LocalServer:
    return LocalServer(BASE_ARGS | {"models": [{"id": MODEL, "zqs_path": str(tiny_zqs)}],
                                    "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 1 << 30},
                                    "policy": {"max_hot_short_actors": 1, "max_batch": max_batch,
                                               "num_warm_short_actors": 0, "num_warm_long_actors": 0},
                                    "rule_scorer": RULE, "early_refusal_s": 0.0,
                                    # The rule's own predictions, known here: not corrected by the steps the
                                    # tiny model's actor measures on this machine.
                                    "is_prediction_corrected": False},
                       LocalClusterSpec(FaultyActor))


@pytest.fixture
def capped_at_32(tiny_zqs):
    local = _serve(tiny_zqs, 32)
    yield local
    local.stop()


def _num_running(server: LocalServer) -> int:
    return server.on_loop(lambda: server.app.ingress.admission.num_running)


def _hold(server: LocalServer, pool: ThreadPoolExecutor, gate, n: int, target_s: float | None):
    """`n` rows held open until `gate` exists, one after another (each a row of the hot actor); their futures."""
    headers = {TPOT_HEADER: str(target_s)} if target_s is not None else None
    held = []
    for i in range(n):
        held.append(pool.submit(call, server.base, body(f"row {i} gate:{gate}", max_tokens=4), headers=headers))
        wait_for(lambda i=i: _num_running(server) == i + 1 or held[-1].done(), 60, f"row {i} running")
        assert not held[-1].done(), held[-1].result()
    return held


def _actors_with_rows(server: LocalServer) -> dict[str, int]:
    snap = server.books()
    return {a.name: a.num_rows for a in snap.actors if a.num_rows}


@pytest.mark.parametrize("max_batch, num_admitted", [(32, 12), (8, 8)])
def test_loose_targets_admit_rows_up_to_the_cap_not_up_to_a_count(tiny_zqs, tmp_path, max_batch, num_admitted):
    """With a loose TPOT target, 12 rows share the one hot actor under a cap of 32; a cap of 8 refuses the 9th."""
    server = _serve(tiny_zqs, max_batch)
    gate = tmp_path / "go"
    try:
        with ThreadPoolExecutor(16) as pool:
            held = _hold(server, pool, gate, num_admitted, target_s=10.0)
            assert list(_actors_with_rows(server).values()) == [num_admitted]  # one actor, every row on it
            if num_admitted < 12:
                refused = call(server.base, body("one more"), headers={TPOT_HEADER: "10"})
                assert_documented_error(refused, 503, "overloaded_error")
            gate.touch()
            assert all(f.result(60).is_complete for f in held)
        assert_nothing_left(server)
    finally:
        server.stop()


def test_a_join_that_would_break_a_running_rows_target_is_not_taken(capped_at_32, tmp_path):
    server = capped_at_32
    gate = tmp_path / "go"
    with ThreadPoolExecutor(4) as pool:
        # Alone its steps are predicted at 10 ms; a second row would make them 15 ms.
        [holder] = _hold(server, pool, gate, 1, target_s=0.012)
        refused = httpx.post(f"{server.base}/v1/messages", json=body("a newcomer with no target of its own"),
                             timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        assert refused.json()["error"]["type"] == "overloaded_error"
        assert "latency targets" in refused.json()["error"]["message"]
        gate.touch()
        assert holder.result(60).is_complete
    wait_for(lambda: _num_running(server) == 0, 30, "the holder's row released")
    assert call(server.base, body("now alone")).is_complete


def test_a_newcomer_whose_own_target_a_join_would_break_is_refused_not_slowed(capped_at_32, tmp_path):
    server = capped_at_32
    gate = tmp_path / "go"
    with ThreadPoolExecutor(4) as pool:
        held = _hold(server, pool, gate, 2, target_s=None)  # two rows: a third makes every step 20 ms
        strict = call(server.base, body("strict"), headers={TPOT_HEADER: "0.015"})
        assert_documented_error(strict, 503, "overloaded_error")
        loose = pool.submit(call, server.base, body(f"loose gate:{gate}"), headers={TPOT_HEADER: "0.025"})
        wait_for(lambda: _num_running(server) == 3, 60, "the loose newcomer joined")
        gate.touch()
        assert all(f.result(60).is_complete for f in [*held, loose])
    assert_nothing_left(server)
    # Each request's steps measured against their prediction, and its TTFT against the router's, per tier.
    health = httpx.get(f"{server.base}/health", timeout=30).json()
    assert health["step_time_ratio"]["count"] >= 3 and health["step_time_ratio"]["p50"] > 0, health
    assert health["ttft_ratio"]["hot"]["count"] >= 2 and health["ttft_ratio"]["hot"]["p50"] > 0, health


class _TargetRecorder(RequestActor):
    """Records the due time of each request's first token as the actor got it, and as its row was given it."""

    seen: list[tuple[float | None, float | None]] = []

    async def generate(self, request):
        submit = self._runner.submit

        def recorded(prompt, params, tpot_target_s=None, first_token_due=None):
            _TargetRecorder.seen.append((request.first_token_due, first_token_due))
            return submit(prompt, params, tpot_target_s, first_token_due)

        self._runner.submit = recorded
        try:
            async for item in super().generate(request):
                yield item
        finally:
            self._runner.submit = submit


@pytest.mark.parametrize("is_paced", [True, False])
def test_a_requests_ttft_target_goes_to_its_actor_as_the_due_time_of_its_first_token(tiny_zqs, is_paced):
    """A request's arrival and TTFT target bound how slowly the engine may feed its prompt (actors/scheduler.py,
    tokens_due), unless the actors' config turns that off; a request with no target brings none."""
    _TargetRecorder.seen = []
    server = serve_locally(str(tiny_zqs), _TargetRecorder,
                           actor=BASE_ARGS["actor"] | {"is_prefill_paced_by_ttft": is_paced})
    try:
        sent = time.time()
        assert call(server.base, body("with a target"), headers={TTFT_HEADER: "5"}).is_complete
        answered = time.time()
        assert call(server.base, body("without one")).is_complete
        (sent_due, row_due), (no_sent_due, no_row_due) = _TargetRecorder.seen
        assert sent + 5.0 <= sent_due <= answered + 5.0
        assert row_due == (sent_due if is_paced else None)
        assert no_sent_due is None and no_row_due is None
        assert_nothing_left(server)
    finally:
        server.stop()
