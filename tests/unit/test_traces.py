"""Request traces: the writer's bounds (size, queue, never blocking), the record schema, and the config switch."""

from __future__ import annotations

import json
import threading
import time

import pytest

from actors.messages import Completion, Timings
from serve_app.config import AppArgs, ingress_config
from serve_app.policy import Reject, RequestFeatures, Spawn
from serve_app.scorer import Candidate, Prediction
from serve_app.traces import (
    SCHEMA,
    TraceConfig,
    TraceWriter,
    outcome_record,
    read_traces,
    trace_record,
)

FEATURES = RequestFeatures("m", 40, 8, 1000, 2, 30, actor_overhead_bytes=7, total_target_s=9.0,
                           temperature=0.0, top_k=40)
CANDIDATE = Candidate("cold", "s0", None, 5000, 0, 0.1, 0.2, 1)
SPAWN = Spawn("s0", "short", True, 1200, 1007, CANDIDATE, Prediction(1.5, 2.5))


def _completion(arrival=100.0) -> Completion:
    timings = Timings(actor_start=arrival + 1, request_arrival=arrival + 2, first_layer_resident=arrival + 2.5,
                      all_layers_resident=arrival + 3, compute_start=arrival + 3, first_layer_compute_start=arrival + 3,
                      first_token=arrival + 3.5, last_token=arrival + 4.25)
    return Completion("req_1", "max_tokens", None, 40, 8, True, 2, timings)


def _writer(tmp_path, **kw) -> TraceWriter:
    return TraceWriter(TraceConfig(str(tmp_path / "t" / "traces.jsonl"), **kw))


def test_a_finished_request_leaves_its_features_decision_and_outcome(tmp_path):
    w = _writer(tmp_path)
    outcome = outcome_record(100.0, 100.25, SPAWN.reserve_bytes, _completion())
    assert w.write(trace_record("req_1", "m", 100.0, FEATURES, SPAWN, outcome))
    assert w.write(trace_record("req_2", "m", 101.0, FEATURES, Reject("no_capacity", 1.0, "full"), None))
    assert w.flush()
    first, second = read_traces([w.path])
    assert first["schema"] == SCHEMA and first["request_id"] == "req_1" and first["model"] == "m"
    assert first["features"] == {"input_tokens": 40, "max_tokens": 8, "temperature": 0.0, "top_k": 40, "top_p": None,
                                 "weight_bytes": 1000, "kv_bytes_per_token": 2, "workspace_bytes": 30,
                                 "actor_overhead_bytes": 7, "ttft_target_s": None, "total_target_s": 9.0}
    d = first["decision"]
    assert d["kind"] == "spawn" and d["reserve_bytes"] == 1200 and d["predicted"] == {"ttft_s": 1.5, "total_s": 2.5}
    assert Candidate(**d["candidate"]) == CANDIDATE
    assert first["outcome"] == pytest.approx({
        "ok": True, "error": None, "dispatch_s": 0.25, "reserved_bytes": 1200, "load_s": 2.0, "ttft_s": 3.5,
        "total_s": 4.25, "output_tokens": 8, "stop_reason": "max_tokens", "is_cold": True, "first_layers": 2,
        "peak_bytes": None})
    assert second["decision"] == {"kind": "reject", "reason": "no_capacity", "retry_after_s": 1.0}
    assert second["outcome"] is None
    w.close()


def test_an_incomplete_request_is_traced_without_timings():
    out = outcome_record(10.0, 10.5, 99, None, "incomplete")
    assert out == {"ok": False, "error": "incomplete", "dispatch_s": 0.5, "reserved_bytes": 99}


def test_the_file_is_bounded_and_moves_to_dot_1_once_full(tmp_path):
    w = _writer(tmp_path, max_bytes=2048)
    for i in range(100):
        w.write({"schema": SCHEMA, "i": i, "pad": "x" * 50})
    assert w.flush()
    old = w.path.with_name(w.path.name + ".1")
    assert w.path.stat().st_size <= 2048 and old.stat().st_size <= 2048
    kept = [r["i"] for r in read_traces([old, w.path])]
    assert kept == list(range(100 - len(kept), 100)) and len(kept) > 20  # the newest lines, in order, whole
    assert w.num_written == 100
    w.close()


def test_writing_never_blocks_and_a_full_queue_drops(tmp_path, monkeypatch):
    w = _writer(tmp_path, max_pending=2)
    release = threading.Event()
    original = w._append
    monkeypatch.setattr(w, "_append", lambda line: (release.wait(10), original(line)))  # a stalled disk
    t0 = time.perf_counter()
    accepted = [w.write({"schema": SCHEMA, "i": i}) for i in range(50)]
    assert time.perf_counter() - t0 < 0.5
    assert not all(accepted) and w.num_dropped == accepted.count(False) >= 47
    release.set()
    assert w.flush()
    assert len(list(read_traces([w.path]))) == accepted.count(True)
    w.close()


def test_a_bad_record_costs_only_itself(tmp_path):
    w = _writer(tmp_path)
    w.write({"schema": SCHEMA, "bad": float("nan")})  # not JSON
    w.write({"schema": SCHEMA, "bad": object()})
    w.write({"schema": SCHEMA, "good": 1})
    assert w.flush()
    assert [r.get("good") for r in read_traces([w.path])] == [1]
    w.close()


def test_two_writers_on_one_file_never_tear_a_line(tmp_path):
    writers = [_writer(tmp_path, max_bytes=4096) for _ in range(2)]
    for i in range(300):
        for k, w in enumerate(writers):
            w.write({"schema": SCHEMA, "writer": k, "i": i, "pad": "y" * 30})
    for w in writers:
        assert w.flush()
        w.close()
    path = writers[0].path
    for p in (path, path.with_name(path.name + ".1")):
        for line in p.read_text().splitlines():
            assert json.loads(line)["schema"] == SCHEMA


def test_read_traces_skips_torn_and_foreign_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"schema": "zq-trace/1", "i": 1}\n{"schema": "zq-tr\n[1, 2]\n{"schema": "other"}\n'
                    '{"schema": "zq-trace/1", "i": 2}\n')
    assert [r["i"] for r in read_traces([path])] == [1, 2]


def test_traces_are_off_unless_switched_on():
    base = {"models": [{"id": "m", "demo_preset": "small"}]}
    assert ingress_config(AppArgs.model_validate(base)).traces is None
    on = ingress_config(AppArgs.model_validate(base | {"traces": {"enabled": True, "path": "t.jsonl",
                                                                  "max_bytes": 4096}}))
    assert on.traces == TraceConfig("t.jsonl", 4096)
    with pytest.raises(ValueError):
        AppArgs.model_validate(base | {"traces": {"enabled": True, "max_bytes": 10}})
    with pytest.raises(ValueError):
        AppArgs.model_validate(base | {"traces": {"enabled": True, "unknown": 1}})
