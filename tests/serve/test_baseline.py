"""The queued baselines on real Ray Serve and real HTTP: same API as zeroqueue, same batched engine, and they queue.

The model is the `layered` one (8 layers of 512): a 1,900-token generation of it takes
seconds on any CPU, so a request "still running" when the next one arrives is made true
by its length, and every wait below is ended by the test itself (a client cancel), not by
the machine's speed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import SERVE_PORT

ROOT = Path(__file__).parents[2]
MODEL = "zq-layered"
PORT = SERVE_PORT
APP = "baseline-test"
MAX_BATCH = 2
LONG = 1900  # tokens: seconds of decoding for the layered model


def _args(zqs, **extra) -> dict:
    # One slot: one replica, so MAX_BATCH + 1 requests at once must meet Serve's queue.
    return {
        "models": [{"id": MODEL, "zqs_path": str(zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 1 << 30},
        "policy": {"max_batch": MAX_BATCH},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "ping_interval_s": 0.2,
        **extra,
    }


@pytest.fixture(scope="module")
def baseline(deploy_app, layered_zqs):
    from benchmarks.baseline.app import build_app

    return deploy_app(PORT, APP, build_app(_args(layered_zqs)))


def _body(max_tokens=8, stream=False) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "seed": 1,
            "messages": [{"role": "user", "content": "Why do queues hurt tail latency?"}]}


def _stream(base: str, max_tokens: int) -> dict:
    """One streamed request: its event types, the replica's start time, and client-side times."""
    sent = time.time()
    with httpx.stream("POST", f"{base}/v1/messages", json=_body(max_tokens, stream=True), timeout=120) as s:
        events = [line.removeprefix("event: ") for line in s.iter_lines() if line.startswith("event: ")]
        return {"status": s.status_code, "events": events, "sent": sent, "end": time.time(),
                "start": float(s.headers["X-Request-Start-Time"])}


class Holder:
    """A long streamed request that holds a row until the test lets go (a client cancel)."""

    def __init__(self, base: str) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.events: list[str] = []
        self.thread = threading.Thread(target=self._run, args=(base,), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "a holder never started"

    def _run(self, base: str) -> None:
        with httpx.stream("POST", f"{base}/v1/messages", json=_body(LONG, stream=True), timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("event: "):
                    self.events.append(line.removeprefix("event: "))
                if "content_block_delta" in self.events:
                    self.started.set()
                    if self.release.wait(60):
                        return  # leaving the block closes the connection mid-stream

    def cancel(self) -> None:
        self.release.set()
        self.thread.join(60)
        assert "message_stop" not in self.events, "the holder ended on its own: it was not long enough"


def test_json_request(baseline):
    r = httpx.post(f"{baseline}/v1/messages", json=_body(max_tokens=6), timeout=120)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["type"] == "message" and msg["content"][0]["type"] == "text"
    assert msg["usage"]["output_tokens"] == 6 and msg["stop_reason"] == "max_tokens"
    assert r.headers["request-id"].startswith("req_")


def test_streamed_request_has_zeroqueues_event_sequence(baseline):
    out = _stream(baseline, 5)
    assert out["status"] == 200
    events = [e for e in out["events"] if e != "ping"]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_errors_use_the_api_shape(baseline):
    r = httpx.post(f"{baseline}/v1/messages", json={**_body(), "model": "nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{baseline}/v1/messages", json={**_body(), "max_tokens": "3"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_replica_batches_max_batch_requests_and_queues_the_next_rather_than_fail(baseline):
    holders = [Holder(baseline) for _ in range(MAX_BATCH)]  # both rows of the one replica, running together
    extra: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: extra.append(httpx.post(f"{baseline}/v1/messages",
                                                                     json=_body(max_tokens=4), timeout=120)))
    waiter.start()
    waiter.join(1.0)
    assert not extra, "the extra request was answered while every row was taken"  # it waits in Serve's queue
    released = time.time()
    holders[0].cancel()  # a row frees up: the queued request runs then, and only then
    waiter.join(60)
    assert extra and extra[0].status_code == 200, extra and extra[0].text
    assert float(extra[0].headers["X-Request-Start-Time"]) >= released
    holders[1].cancel()


def test_a_bounded_queue_refuses_at_once_what_it_cannot_hold(baseline, layered_zqs):
    from ray import serve

    from benchmarks.baseline.app import build_app

    # The same app redeployed with a queue of one (and put back as it was afterwards).
    serve.run(build_app(_args(layered_zqs, baseline={"max_queued_requests": 1})), name=APP, route_prefix="/")
    base = baseline
    try:
        holders = [Holder(base) for _ in range(MAX_BATCH)]
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(httpx.post(f"{base}/v1/messages",
                                                                          json=_body(max_tokens=4), timeout=120)))
        waiter.start()
        waiter.join(1.0)
        assert not queued  # the one place in the queue is taken
        t0 = time.monotonic()
        refused = httpx.post(f"{base}/v1/messages", json=_body(max_tokens=4), timeout=30)
        assert refused.status_code == 503 and time.monotonic() - t0 < 5
        for h in holders:
            h.cancel()
        waiter.join(60)
        assert queued and queued[0].status_code == 200
    finally:
        serve.run(build_app(_args(layered_zqs)), name=APP, route_prefix="/")


def test_serve_yaml_builds_from_zeroqueues_own_config():
    from benchmarks.baseline.app import resolve_args

    ours = yaml.safe_load((ROOT / "benchmarks/baseline/serve.yaml").read_text())["applications"][0]
    theirs = yaml.safe_load((ROOT / "configs/serve.yaml").read_text())["applications"][0]
    assert ours["import_path"] == "benchmarks.baseline.app:build_app"
    assert resolve_args({"same_as": str(ROOT / ours["args"]["same_as"])}) == theirs["args"]
    direct = {"models": [{"id": MODEL, "zqs_path": "x.zqs"}]}
    assert resolve_args(direct) is direct
