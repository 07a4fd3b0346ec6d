"""The peer benchmark's reading of zeroqueue's request traces (benchmarks/peer_traces.py)."""

import json

import pytest

from benchmarks import peer_traces


def _record(tier, measured, predicted, *, kind="join", rows=3, threads=None, seen=None):
    if kind == "reject":
        return {"decision": {"kind": "reject", "reason": tier}, "outcome": None}
    return {"decision": {"kind": kind, "tier": tier, "predicted": {"ttft_s": predicted},
                         "candidate": {"batch_rows": rows, "batch_pending_prompt_tokens": 40, "step_correction": 1.2}},
            "outcome": {"ok": True, "ttft_s": measured, "dispatch_s": 0.01, "mean_step_threads": threads,
                        **({} if seen is None else {"ttft_seen_s": seen})}}


def test_counts_tiers_refusals_and_the_admitted_past_the_target_worst_first():
    records = [_record("hot", 0.2, 0.2, kind="dispatch"), _record("join", 0.6, 0.5), _record("join", 1.4, 0.9),
               _record("join", 1.1, 0.95), _record("latency_target", 0, 0, kind="reject"),
               _record("no_capacity", 0, 0, kind="reject"), _record("no_capacity", 0, 0, kind="reject"),
               {"decision": {"kind": "join", "tier": "join", "predicted": {"ttft_s": 0.5}},
                "outcome": {"ok": False, "error": "cancelled"}}]  # no first token: no TTFT to count
    out = peer_traces.summarise(records, ttft_target_s=1.0)
    assert out["tiers"]["hot"]["count"] == 1 and out["tiers"]["join"]["count"] == 3
    assert out["refused"] == {"latency_target": 1, "no_capacity": 2}
    assert out["num_late"] == 2
    assert [x["measured_s"] for x in out["late"]] == [1.4, 1.1]
    assert out["late"][0]["predicted_s"] == 0.9 and out["late"][0]["batch_rows"] == 3
    assert out["step_threads_mean"] is None  # no trace said


def test_the_threads_a_step_are_the_mean_over_served_requests_that_say():
    records = [_record("join", 0.5, 0.5, threads=2.0), _record("join", 0.5, 0.5, threads=1.0),
               _record("join", 0.5, 0.5, threads=1.5), _record("hot", 0.2, 0.2, kind="dispatch")]  # older: no field
    out = peer_traces.summarise(records, ttft_target_s=1.0)
    assert out["step_threads_mean"] == 1.5
    lines = peer_traces.report_lines({"rates": [4], "targets": {"ttft_target_s": 1.0},
                                      "servers": {"zeroqueue": {"4": {"traces": out}}}})
    assert any(line.startswith("| zeroqueue | 4 |") and "| 1.50 | — | 0 |" in line for line in lines)


def test_the_first_tokens_delivery_to_the_ingress_is_seen_less_sampled_over_the_traces_that_say():
    records = [_record("join", 0.5, 0.5, seen=0.52), _record("join", 0.4, 0.5, seen=0.43),
               _record("hot", 0.3, 0.3, kind="dispatch", seen=0.31), _record("hot", 0.2, 0.2, kind="dispatch")]
    out = peer_traces.summarise(records, ttft_target_s=1.0)
    assert out["delivery_p50_s"] == pytest.approx(0.02) and out["delivery_p99_s"] == pytest.approx(0.03, abs=1e-3)
    lines = peer_traces.report_lines({"rates": [4], "targets": {"ttft_target_s": 1.0},
                                      "servers": {"zeroqueue": {"4": {"traces": out}}}})
    assert any(line.startswith("| zeroqueue | 4 |") and "| 20 / 30 | 0 |" in line for line in lines)
    assert peer_traces.summarise(records[3:], ttft_target_s=1.0)["delivery_p50_s"] is None  # older lines: no field


def test_reads_only_whole_lines_written_since_the_offset(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n" + json.dumps({"a": 2}) + "\n" + '{"a": ')  # the last one half-written
    records, offset = peer_traces.read_new(path, 0)
    assert records == [{"a": 1}, {"a": 2}]
    with path.open("a") as f:
        f.write('3}\n')
    records, _ = peer_traces.read_new(path, offset)
    assert records == [{"a": 3}]
    assert peer_traces.read_new(tmp_path / "absent.jsonl", 7) == ([], 7)
