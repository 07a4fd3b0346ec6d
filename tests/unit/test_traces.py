"""Request traces: the writer's bounds (size, queue, never blocking), the record schema, and the config switch."""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
import time
from collections import Counter

import pytest

from actors.messages import Completion, Timings
from serve_app.config import AppArgs, ingress_config
from serve_app.decisions import Join, Reject, Spawn
from serve_app.scorer import Candidate, Prediction
from serve_app.snapshot import RequestFeatures
from serve_app.traces import (
    SCHEMA,
    TraceConfig,
    TraceWriter,
    outcome_record,
    read_traces,
    tpot_s,
    trace_record,
)

FEATURES = RequestFeatures("m", 40, 8, 1000, 2, 30, actor_overhead_bytes=7, total_target_s=9.0,
                           tpot_target_s=0.2, temperature=0.0, top_k=40)
CANDIDATE = Candidate("cold", "s0", None, 5000, 0, 0.1, 0.2, 1)
SPAWN = Spawn("s0", "short", True, 1200, 1007, CANDIDATE, Prediction(1.5, 2.5, 0.125))
JOIN_CANDIDATE = Candidate("join", "s1", "zq-a", 4000, 1, 0.0, 0.5, 2, batch_rows=3, batch_tokens=900)
JOIN = Join("zq-a", "s1", "short", 96, JOIN_CANDIDATE, Prediction(0.05, 0.4, 0.05))


def _completion(arrival=100.0, output_tokens=8, is_cold=True, mean_step_threads=0.0) -> Completion:
    timings = Timings(actor_start=arrival + 1, request_arrival=arrival + 2, first_layer_resident=arrival + 2.5,
                      all_layers_resident=arrival + 3, compute_start=arrival + 3, first_layer_compute_start=arrival + 3,
                      first_token=arrival + 3.5, last_token=arrival + 4.25)
    return Completion("req_1", "max_tokens", None, 40, output_tokens, is_cold, 2, timings,
                      mean_step_threads=mean_step_threads)


def _writer(tmp_path, **kw) -> TraceWriter:
    return TraceWriter(TraceConfig(str(tmp_path / "t" / "traces.jsonl"), **kw))


def test_a_finished_request_leaves_its_features_decision_and_outcome(tmp_path):
    w = _writer(tmp_path)
    outcome = outcome_record(100.0, 100.25, SPAWN.reserve_bytes, _completion(), first_token_seen_at=103.625)
    assert w.write(trace_record("req_1", "m", 100.0, FEATURES, SPAWN, outcome))
    assert w.write(trace_record("req_2", "m", 101.0, FEATURES, Reject("no_capacity", 1.0, "full"), None))
    assert w.flush()
    first, second = read_traces([w.path])
    assert first["schema"] == SCHEMA and first["request_id"] == "req_1" and first["model"] == "m"
    assert first["features"] == {"input_tokens": 40, "max_tokens": 8, "temperature": 0.0, "top_k": 40, "top_p": None,
                                 "weight_bytes": 1000, "kv_bytes_per_token": 2, "workspace_bytes": 30,
                                 "actor_overhead_bytes": 7, "ttft_target_s": None, "total_target_s": 9.0,
                                 "tpot_target_s": 0.2}
    d = first["decision"]
    assert d["kind"] == "spawn" and d["reserve_bytes"] == 1200
    assert d["predicted"] == {"ttft_s": 1.5, "total_s": 2.5, "tpot_s": 0.125, "ttft_high_s": None}
    assert Candidate(**d["candidate"]) == CANDIDATE
    assert first["outcome"] == pytest.approx({
        "ok": True, "error": None, "dispatch_s": 0.25, "reserved_bytes": 1200, "load_s": 2.0, "ttft_s": 3.5,
        "ttft_seen_s": 3.625, "total_s": 4.25, "tpot_s": 0.75 / 7, "output_tokens": 8, "stop_reason": "max_tokens", "is_cold": True,
        "first_layers": 2, "peak_bytes": None, "mean_step_threads": None})  # the actor did not say
    assert second["decision"] == {"kind": "reject", "reason": "no_capacity", "retry_after_s": 1.0, "message": "full"}
    assert second["outcome"] is None
    w.close()


def test_a_joined_request_records_the_batch_it_joined_and_its_measured_step_time(tmp_path):
    w = _writer(tmp_path)
    outcome = outcome_record(100.0, 100.01, JOIN.reserve_bytes, _completion(is_cold=False, mean_step_threads=1.5))
    assert w.write(trace_record("req_j", "m", 100.0, FEATURES, JOIN, outcome))
    assert w.flush()
    (record,) = read_traces([w.path])
    d = record["decision"]
    assert d["kind"] == "join" and d["keep_hot"] is True and d["slot_id"] == "s1" and d["reserve_bytes"] == 96
    assert d["candidate"]["batch_rows"] == 3 and d["candidate"]["batch_tokens"] == 900
    assert Candidate(**d["candidate"]) == JOIN_CANDIDATE
    assert d["predicted"] == {"ttft_s": 0.05, "total_s": 0.4, "tpot_s": 0.05, "ttft_high_s": None}
    assert record["outcome"]["ok"] and record["outcome"]["load_s"] is None
    assert record["outcome"]["tpot_s"] == pytest.approx(0.75 / 7)
    assert record["outcome"]["mean_step_threads"] == 1.5  # its steps' threads, as the actor counted them
    w.close()


@pytest.mark.parametrize("output_tokens", [0, 1])
def test_tpot_is_none_with_fewer_than_two_output_tokens(output_tokens):
    out = outcome_record(100.0, 100.25, 5, _completion(output_tokens=output_tokens))
    assert out["ok"] and out["ttft_s"] == 3.5 and out["tpot_s"] is None
    assert out["ttft_seen_s"] is None  # the ingress did not say when it received the first token
    assert tpot_s(1.0, None, 5) is None and tpot_s(None, 2.0, 5) is None and tpot_s(1.0, 2.0, 3) == 0.5


@pytest.mark.parametrize("error", ["cancelled", "failed"])
def test_a_request_that_did_not_complete_is_traced_with_how_it_ended_and_no_timings(error):
    out = outcome_record(10.0, 10.5, 99, None, error)
    assert out == {"ok": False, "error": error, "dispatch_s": 0.5, "reserved_bytes": 99}


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


# Two replicas sharing a file. Records of one fixed length make the rotation exact: a file
# moves to .1 when it holds k = max_bytes // line lines and one more would not fit, so .1
# always holds k lines and the file (total - 1) % k + 1, and the two are the last lines
# written. A replica that sized the file by its own lines, or appended to a file another
# had just moved, or moved a file another had just started, breaks these counts.
ROTATE_BYTES = 1024


def _fixed_record(writer: int, i: int) -> dict:
    return {"schema": SCHEMA, "writer": writer, "i": f"{i:06d}"}


LINE_BYTES = len(json.dumps(_fixed_record(0, 0), separators=(",", ":"))) + 1


def _assert_rotated_exactly(path, total: int, per_writer: int, num_writers: int = 2) -> None:
    k = ROTATE_BYTES // LINE_BYTES
    rotated = path.with_name(path.name + ".1").read_bytes().splitlines()
    current = path.read_bytes().splitlines()
    assert total > 2 * k, "the test must force several rotations"
    assert (len(rotated), len(current)) == (k, (total - 1) % k + 1)
    records = [json.loads(line) for line in rotated + current]  # every line whole
    for w in range(num_writers):
        kept = [int(r["i"]) for r in records if r["writer"] == w]
        assert kept == list(range(per_writer - len(kept), per_writer)), f"writer {w}: not its newest lines in order"


def test_two_writers_taking_turns_rotate_by_the_file_size_not_their_own_count(tmp_path):
    writers = [_writer(tmp_path, max_bytes=ROTATE_BYTES) for _ in range(2)]
    n = 60
    for i in range(n):
        for k, w in enumerate(writers):
            assert w.write(_fixed_record(k, i)) and w.flush()
    for w in writers:
        w.close()
    _assert_rotated_exactly(writers[0].path, 2 * n, n)


def _write_in_another_process(rotating: str, whole: str, writer: int, n: int, start) -> None:
    """One replica: the same records to a file that rotates and to one that never does."""
    writers = [TraceWriter(TraceConfig(rotating, max_bytes=ROTATE_BYTES, max_pending=n + 1)),
               TraceWriter(TraceConfig(whole, max_bytes=1 << 30, max_pending=n + 1))]
    start.wait(60)
    for i in range(n):
        for w in writers:
            if not w.write(_fixed_record(writer, i)):
                raise RuntimeError("record dropped")
    for w in writers:
        if not w.flush(60):
            raise RuntimeError("flush timed out")
        w.close()


def test_two_processes_rotating_one_file_keep_every_line_whole_and_the_newest_lines(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    rotating, whole = tmp_path / "rotating.jsonl", tmp_path / "whole.jsonl"
    n = 1500
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_write_in_another_process, args=(str(rotating), str(whole), k, n, start))
             for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    lines = [json.loads(line) for line in whole.read_bytes().splitlines()]
    assert len(lines) == 2 * n
    for k in range(2):
        assert [int(r["i"]) for r in lines if r["writer"] == k] == list(range(n))
    _assert_rotated_exactly(rotating, 2 * n, n)


def test_read_traces_skips_torn_and_foreign_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"schema": "zq-trace/3", "i": 1}\n{"schema": "zq-tr\n[1, 2]\n{"schema": "other"}\n'
                    '{"schema": "zq-trace/3", "i": 2}\n')
    skipped = Counter()
    assert [r["i"] for r in read_traces([path], skipped)] == [1, 2]
    assert skipped == {"torn": 1, "foreign": 2}


def test_lines_of_the_schema_before_batching_are_skipped_counted_and_warned_about(tmp_path, caplog):
    """A file appended to across an upgrade: its older lines are left out, its current lines still read."""
    assert SCHEMA == "zq-trace/3"
    path = tmp_path / "upgraded.jsonl"
    v1 = {"schema": "zq-trace/1", "decision": {"kind": "dispatch"}, "outcome": {"ok": True, "ttft_s": 0.1}}
    path.write_text("".join(json.dumps(v1 | {"i": i}) + "\n" for i in range(3))
                    + json.dumps({"schema": SCHEMA, "i": 3}) + "\n")
    skipped = Counter()
    with caplog.at_level(logging.WARNING, logger="serve_app.traces"):
        assert [r["i"] for r in read_traces([path], skipped)] == [3]
    assert skipped == {"zq-trace/1": 3}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(path) in warning and "3 zq-trace/1 lines skipped" in warning and "zq-trace/3" in warning


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
