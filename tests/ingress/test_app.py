"""The zeroqueue app on real HTTP over the in-process cluster: API, errors, auth, no hidden queue, batching.
These ran on Serve before; what only Serve and Ray show (process death, a client leaving through Serve's proxy,
handles from another driver, metrics export, telemetry agents) stays in tests/serve/test_app.py, and an actor
lost mid-stream or a client leaving in-process is in the port's contract test and test_client_leaves.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.ingress.local import LocalServer, api_key_env, serve_locally
from tests.serve.waiting import wait_for

KEY = "zq-test-key-5d1c"
MODEL = "zq-tiny"
SLOW_MODEL = "zq-layered"
# Every refusal in the burst test comes back within this bound: far above a refusal's own time on any
# machine, far below forever, which is how long a request queued behind the holders would wait.
REJECT_BOUND_S = 5.0
MAX_BATCH = 3


@pytest.fixture(scope="module")
def server(tiny_zqs, layered_zqs):
    local = serve_locally(
        tiny_zqs,
        # The layered model decodes slowly enough here to hold a slot for seconds.
        models=[{"id": MODEL, "zqs_path": str(tiny_zqs)}, {"id": SLOW_MODEL, "zqs_path": str(layered_zqs)}],
        policy={"short_max_input_tokens": 512, "short_max_output_tokens": 256,
                "max_hot_short_actors": 1, "max_hot_long_actors": 1, "max_batch": MAX_BATCH},
        api_key_env=api_key_env("ZQ_TEST_API_KEY", KEY), max_body_bytes=64 * 1024, ping_interval_s=0.2)
    yield local
    local.stop()


@pytest.fixture(scope="module")
def zq(server: LocalServer) -> str:
    return server.base


def _body(max_tokens=8, stream=False, text="Why do queues hurt tail latency?", **extra) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": text}], **extra}


def _post(base, body, headers=None, **kw) -> httpx.Response:
    return httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": KEY, **(headers or {})},
                      timeout=60, **kw)


def test_a_final_assistant_message_is_continued_and_counted_as_the_prompt(zq):
    conversation = [{"role": "user", "content": "Label this: great product"}, {"role": "assistant", "content": "{"}]
    r = _post(zq, _body(max_tokens=4, temperature=0.0) | {"messages": conversation})
    assert r.status_code == 200, r.text
    counted = httpx.post(f"{zq}/v1/messages/count_tokens", json={"model": MODEL, "messages": conversation},
                         headers={"x-api-key": KEY}, timeout=30).json()["input_tokens"]
    closed = httpx.post(f"{zq}/v1/messages/count_tokens", headers={"x-api-key": KEY}, timeout=30, json={
        "model": MODEL, "messages": [*conversation, {"role": "user", "content": "x"}]}).json()["input_tokens"]
    # The prompt ends inside the assistant's turn (no end-of-turn, no next turn): it is continued.
    assert r.json()["usage"]["input_tokens"] == counted < closed
    assert r.json()["usage"]["output_tokens"] == 4


def test_timing_and_request_id_headers(zq):
    r = _post(zq, _body())
    assert r.status_code == 200, r.text
    dispatch = float(r.headers["X-Request-Dispatch-Time"])
    start = float(r.headers["X-Request-Start-Time"])
    assert r.headers["request-id"].startswith("req_")
    assert len(r.headers["X-Request-Dispatch-Time"].split(".")[1]) == 6
    assert dispatch - 0.05 <= start <= dispatch + 60  # the actor starts after the decision
    hops = dict(part.strip().split(";dur=") for part in r.headers["Server-Timing"].split(","))
    assert list(hops) == ["parse", "admit", "place", "start", "answer"]  # the ingress's time, hop by hop
    assert all(float(ms) >= 0 for ms in hops.values())
    # Seeded as test_create: unseeded, the random model may end its turn at once and stream no delta.
    with httpx.stream("POST", f"{zq}/v1/messages", json=_body(stream=True, seed=3, temperature=0.7),
                      headers={"x-api-key": KEY}, timeout=60) as s:
        events = [line.removeprefix("event: ") for line in s.iter_lines() if line.startswith("event: ")]
        assert "X-Request-Start-Time" in s.headers
        assert [p.split(";")[0].strip() for p in s.headers["Server-Timing"].split(",")] == [
            "parse", "admit", "place", "start"]  # a stream's headers leave before its answer
    events = [e for e in events if e != "ping"]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


@pytest.mark.parametrize(
    ("body", "status", "etype"),
    [
        ({"model": MODEL, "max_tokens": "12", "messages": [{"role": "user", "content": "x"}]}, 400,
         "invalid_request_error"),
        ({"model": MODEL, "max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "assistant", "content": "x"}]}, 400,
         "invalid_request_error"),
        (_body(temperature=1.5), 400, "invalid_request_error"),
        (_body(top_p=0), 400, "invalid_request_error"),
        (_body(top_k=0), 400, "invalid_request_error"),
        (_body(max_tokens=5000), 400, "invalid_request_error"),  # beyond the 2048-token window
        ({**_body(), "model": "nope"}, 404, "not_found_error"),
        (_body(text="x" * 70_000), 413, "request_too_large"),
    ],
)
def test_bad_requests_are_refused_before_any_work(zq, server, body, status, etype):
    before = server.actor_names()
    r = _post(zq, body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == etype and err["error"]["message"]
    assert err["request_id"] == r.headers["request-id"]
    assert server.actor_names() <= before  # nothing was started for it


def test_a_body_nested_too_deeply_is_a_400_with_its_request_id(zq, server):
    before = server.actor_names()
    r = httpx.post(f"{zq}/v1/messages", content=b"[" * 30_000, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text  # the JSON decoder's RecursionError was a 500
    assert r.json()["error"]["type"] == "invalid_request_error" and "nested too deeply" in r.json()["error"]["message"]
    assert r.json()["request_id"] == r.headers["request-id"] and server.actor_names() <= before


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/messages"), ("POST", "/v1/messages/"), ("POST", "/v1/messages/count_tokens"),
     ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("GET", "/health"), ("GET", "/nope"),
     ("POST", "/v1//messages"), ("GET", "/V1/models")],
)
def test_every_route_and_path_variant_needs_the_key(zq, method, path):
    for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": KEY[:-1]}, {"authorization": "Bearer nope"}):
        r = httpx.request(method, f"{zq}{path}", json=_body(), headers=headers, timeout=30)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error" and "request-id" in r.headers
    ok = httpx.request(method, f"{zq}{path}", json=_body(max_tokens=2), headers={"authorization": f"Bearer {KEY}"},
                       timeout=60)
    assert ok.status_code != 401


def test_unknown_route_is_not_found_in_the_api_shape(zq):
    r = httpx.get(f"{zq}/v2/whatever", headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_x_stream_mode_low_latency_streams_the_same_answer_a_token_an_event(zq):
    from serve_app.sse import decode_events

    def stream(headers):
        r = _post(zq, _body(max_tokens=24, stream=True, temperature=0), headers)
        assert r.status_code == 200, r.text
        events = decode_events(r.content)
        deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
        tokens = next(e["usage"]["output_tokens"] for e in events if e["type"] == "message_delta")
        return r.headers["x-stream-mode"], deltas, tokens

    mode, fast, num_tokens = stream({"x-stream-mode": "low-latency"})
    assert mode == "low-latency"
    assert len(fast) <= num_tokens  # one event per token whose text is not empty (the actor sends each alone)
    default_mode, coalesced, _ = stream({})
    assert default_mode == "coalesced" and "".join(coalesced) == "".join(fast)  # the same answer
    bad = _post(zq, _body(stream=True), {"x-stream-mode": "fastest"})
    assert bad.status_code == 400 and "x-stream-mode" in bad.json()["error"]["message"]


def _long_stream(base, stop: threading.Event, started: threading.Event, statuses: list | None = None):
    body = {**_body(max_tokens=1500, stream=True, temperature=0), "model": SLOW_MODEL}
    with httpx.stream("POST", f"{base}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120) as s:
        if statuses is not None:
            statuses.append((s.status_code, s.read() if s.status_code != 200 else b""))
        for line in s.iter_lines():
            if line.startswith("event: content_block_delta"):
                started.set()
            if stop.is_set():
                break


def _health(base) -> dict:
    return httpx.get(f"{base}/health", headers={"x-api-key": KEY}, timeout=10).json()


def test_no_hidden_queue_a_burst_over_capacity_is_refused_at_once(zq, server):
    # Empty the slots of hot actors left by earlier tests, then fill every place with long requests:
    # a hot (long-lane) batch of MAX_BATCH rows on one slot, a dedicated actor (over the hot quota) on the other.
    for name in server.actor_names():
        server.kill(name)
    wait_for(lambda: _health(zq)["slots"]["free"] == 2, what="both slots free")
    stop = threading.Event()
    holders, statuses = [], []
    for _ in range(MAX_BATCH + 1):  # one at a time: each joins or spawns once the one before computes
        started = threading.Event()
        t = threading.Thread(target=_long_stream, args=(zq, stop, started, statuses), daemon=True)
        t.start()
        holders.append(t)
        assert started.wait(60), statuses
    try:
        # An actor started on a start lease is "busy" in the registry's books from its holder's next report.
        wait_for(lambda: _health(zq)["actors"].get("busy") == 2, 10, "the registry to hear of the last start")
        health = _health(zq)
        assert health["rows"] == MAX_BATCH + 1, health
        before = server.actor_names()
        client = httpx.Client(headers={"x-api-key": KEY}, timeout=30)

        def one(model):
            t0 = time.perf_counter()
            r = client.post(f"{zq}/v1/messages", json={**_body(max_tokens=4), "model": model})
            return r, time.perf_counter() - t0

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, [MODEL, SLOW_MODEL] * 8))
        assert _health(zq)["rows"] == MAX_BATCH + 1  # the holders ran throughout
        print("refusal ms:", sorted(round(e * 1000) for _, e in results))
        for r, elapsed in results:
            assert r.status_code == 503, r.text
            assert r.headers.get("content-type") == "application/json", (r.headers, r.text)
            assert r.json()["error"]["type"] == "overloaded_error"
            assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) >= 1
            assert elapsed < REJECT_BOUND_S, f"a refusal took {elapsed * 1000:.0f} ms"
        assert server.actor_names() == before  # nothing was created for the refused requests
    finally:
        stop.set()
        for t in holders:
            t.join(60)
        for name in server.actor_names():  # the long lane's hot actor would hold its slot for the next tests
            server.kill(name)
        wait_for(lambda: _health(zq)["slots"]["free"] == 2, what="both slots free again")


def test_concurrent_requests_share_one_hot_actor_each_getting_its_own_answer(zq, server):
    """Rows of one batch: every answer is the one its request gets alone (greedy), none crosses over."""
    wait_for(lambda: _health(zq)["actors"].get("busy", 0) == 0, what="earlier requests to end")
    prompts = ["Why do queues hurt tail latency?", "Tell me about batching.", "What is a KV cache?"]
    alone = {p: _post(zq, _body(max_tokens=48, text=p, temperature=0)).json()["content"][0]["text"] for p in prompts}
    actors_before = server.actor_names()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: _post(zq, _body(max_tokens=48, text=p, temperature=0)), prompts))
    assert all(r.status_code == 200 for r in together), [r.text for r in together]
    assert {p: r.json()["content"][0]["text"] for p, r in zip(prompts, together, strict=True)} == alone
    assert server.actor_names() == actors_before  # they joined the hot actor: no new process


def _wait_free_slot(base) -> None:
    """Earlier tests' actors release their slots asynchronously after their streams end."""
    wait_for(lambda: _health(base)["slots"]["free"] >= 1, what="a free slot")


def test_back_to_back_requests_from_one_client_all_complete(zq):
    """The next request follows the moment the last one's final byte arrives: the row it held is free."""
    _wait_free_slot(zq)
    statuses = []
    with httpx.Client(headers={"x-api-key": KEY}, timeout=60) as client:
        for i in range(100):
            body = _body(max_tokens=2, stream=bool(i % 2))
            if body["stream"]:
                with client.stream("POST", f"{zq}/v1/messages", json=body) as s:
                    events = [line for line in s.iter_lines() if line.startswith("event: ")]
                    statuses.append((s.status_code, events[-1] if events else None))
            else:
                r = client.post(f"{zq}/v1/messages", json=body)
                statuses.append((r.status_code, "event: message_stop" if r.status_code == 200 else r.text))
    assert statuses == [(200, "event: message_stop")] * 100, [s for s in statuses if s[0] != 200][:3]
