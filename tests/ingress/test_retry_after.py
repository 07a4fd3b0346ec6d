"""A refusal's retry-after is the registry's prediction of when a place frees, and a retry then is admitted.

One CPU slot and batches of one row, so a single request holds all the capacity. The rule
scorer is configured to over-predict for the tiny model here (a 3 s actor start and 50 ms
a token, where this model starts in-process in well under a second and decodes in milliseconds): the test
checks the refusal quotes the holder's *predicted* end, and that a client honouring it is
served — which needs the prediction to be no earlier than the real end, as a configured
rule must be for its own deployment.
"""

from __future__ import annotations

import math
import threading
import time

import httpx
import pytest

from tests.ingress.local import MODEL, serve_locally
from tests.reliability.faults import FaultyActor

# The refusal's figure against the registry's own prediction, seen from the client: the
# request's round trip separates the two clocks' readings.
TOLERANCE_S = 0.25


@pytest.fixture(scope="module")
def app(tiny_zqs):
    server = serve_locally(
        tiny_zqs, FaultyActor, slots={"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 1 << 30},
        policy={"max_batch": 1, "max_hot_short_actors": 1, "actor_overhead_bytes": 1 << 20},
        rule_scorer={"actor_start_s": 3.0, "decode_s_per_token": 0.05})
    yield server
    server.stop()


def _body(max_tokens: int, content: str = "Hello there") -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}


def test_a_refusal_quotes_the_holders_predicted_end_and_a_retry_then_is_admitted(app, tmp_path):
    base = app.base
    held: list[httpx.Response] = []
    # The holder keeps its row until the test opens its gate (FaultyActor holds its Completion): the tiny model
    # would otherwise be done, or end its turn, before the second request arrives.
    gate = tmp_path / "gate"
    holder = threading.Thread(target=lambda: held.append(httpx.post(
        f"{base}/v1/messages", json=_body(40, f"Hello there gate:{gate} ok"), timeout=120)))
    holder.start()
    # The holder's row is committed the moment it is admitted; its actor then needs seconds to start.
    deadline = time.monotonic() + 30
    while not (rows := [r for a in app.books().actors for r in a.rows]):
        assert time.monotonic() < deadline, "the holder was never admitted"
        time.sleep(0.01)
    (row,) = rows
    sent = time.time()
    refused = httpx.post(f"{base}/v1/messages", json=_body(4), timeout=30)
    answered = time.time()
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["type"] == "overloaded_error"
    wait_s = int(refused.headers["retry-after-ms"]) / 1000
    assert row.predicted_end - answered - TOLERANCE_S <= wait_s <= row.predicted_end - sent + TOLERANCE_S
    # The bound above ties the wait to the holder's predicted end, not to the policy's fixed answer.
    assert int(refused.headers["retry-after"]) == max(1, math.ceil(wait_s - 1e-9))

    gate.touch()
    time.sleep(max(0.0, sent + wait_s - time.time()))
    retried = httpx.post(f"{base}/v1/messages", json=_body(4), timeout=60)
    assert retried.status_code == 200, retried.text
    holder.join(60)
    assert held and held[0].status_code == 200
