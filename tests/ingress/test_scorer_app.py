"""The app with the XGBoost scorer, traces and latency targets, on real HTTP over the in-process cluster."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.helpers import train_synthetic_scorer
from tests.ingress.local import MODEL, serve_locally


@pytest.fixture(scope="module")
def app(tiny_zqs, tmp_path_factory):
    from serve_app.xgb_scorer import ScorerCard, save_model

    work = tmp_path_factory.mktemp("scorer-app")
    # Synthetic law (tests/helpers.py): hot TTFT ~0.1 s, cold ~2 s — unlike the rule's ~3 s.
    save_model(train_synthetic_scorer(), work / "scorer.ubj", ScorerCard(sha256=""))
    traces = work / "traces.jsonl"
    server = serve_locally(tiny_zqs, models=[{"id": MODEL, "zqs_path": str(tiny_zqs), "total_target_s": 600}],
                           policy={"max_hot_short_actors": 1}, scorer_path=str(work / "scorer.ubj"),
                           traces={"enabled": True, "path": str(traces)})
    yield server, traces
    server.stop()


def _post(base, headers=None, max_tokens=4) -> httpx.Response:
    # Seeded: unseeded, the random model may end its turn before max_tokens.
    body = {"model": MODEL, "max_tokens": max_tokens, "seed": 3, "temperature": 0.7,
            "messages": [{"role": "user", "content": "Why no queue?"}]}
    return httpx.post(f"{base}/v1/messages", json=body, headers=headers or {}, timeout=120)


def _lines(path, at_least: int, timeout_s: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= at_least:
            return [json.loads(line) for line in lines]
        time.sleep(0.1)
    raise AssertionError(f"fewer than {at_least} trace lines after {timeout_s} s")


def test_requests_are_decided_by_the_xgboost_scorer_and_traced(app):
    server, traces = app
    base = server.base
    assert _post(base).status_code == 200  # cold: spawns the hot actor
    assert _post(base).status_code == 200  # hot
    cold, hot = _lines(traces, 2)[:2]
    assert cold["decision"]["kind"] == "spawn" and hot["decision"]["kind"] == "dispatch"
    # The registry ranked with the model (cold ~2 s, hot ~0.1 s), not the rule (cold ~3 s).
    assert cold["decision"]["predicted"]["ttft_s"] == pytest.approx(2.0, rel=0.2)
    assert hot["decision"]["predicted"]["ttft_s"] == pytest.approx(0.1, rel=0.3)
    for line, is_cold in ((cold, True), (hot, False)):
        out = line["outcome"]
        assert out["ok"] and out["is_cold"] is is_cold and out["output_tokens"] == 4
        assert 0 < out["dispatch_s"] < out["ttft_s"] <= out["total_s"]
        assert out["ttft_s"] <= out["ttft_seen_s"]  # the ingress received the first token after the actor sampled it
        assert out["reserved_bytes"] == line["decision"]["reserve_bytes"]
        assert line["features"]["total_target_s"] == 600  # the model's default
    assert cold["outcome"]["load_s"] > 0 and hot["outcome"]["load_s"] is None


@pytest.mark.parametrize("value", ["abc", "0", "-2", "inf", "nan"])
def test_a_malformed_target_header_is_refused_before_any_work(app, value):
    server, _ = app
    base, before = server.base, server.actor_names()
    r = _post(base, {"x-zq-ttft-target-s": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "x-zq-ttft-target-s" in r.json()["error"]["message"]
    assert server.actor_names() <= before


def test_an_unmeetable_target_is_refused_at_once_and_honestly(app):
    server, traces = app
    base, before = server.base, server.actor_names()
    num_lines = len(_lines(traces, 0))
    r = _post(base, {"X-ZQ-TTFT-Target-S": "0.001"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
    assert int(r.headers["retry-after"]) >= 1 and "latency target" in r.json()["error"]["message"]
    assert server.actor_names() <= before  # nothing was started
    line = _lines(traces, num_lines + 1)[num_lines]
    assert line["decision"] | {"message": ""} == {"kind": "reject", "reason": "latency_target", "retry_after_s": 1.0,
                                                   "message": ""}
    assert "no placement meets the latency targets" in line["decision"]["message"]
    assert line["features"]["ttft_target_s"] == 0.001 and line["outcome"] is None
    # A target the model says is met is admitted.
    assert _post(base, {"x-zq-ttft-target-s": "30", "x-zq-total-target-s": "300"}).status_code == 200
