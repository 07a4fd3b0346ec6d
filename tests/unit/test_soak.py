"""The chaos soak's pure parts: how a recorded request ended, the end state, the goals, the schedules. No Ray."""

from __future__ import annotations

import json

import pytest

from benchmarks.soak import Plan, arrival_plan, chaos_plan, parse_event
from benchmarks.soak_endings import CANCEL, COMPLETE, ERROR, NONE, OVERFLOW, classify
from benchmarks.soak_report import (
    end_state,
    judge,
    longest_gap_s,
    rss_growth,
    tally,
    write_report,
)

RID = "req_0123456789abcdef"


def ev(name: str, **data) -> list:
    return [name, {"type": name, **data}]


def start_events() -> list:
    return [ev("message_start", message={"id": "msg_1", "content": []}),
            ev("content_block_start", index=0, content_block={"type": "text", "text": ""})]


def delta(text: str = "hi") -> list:
    return ev("content_block_delta", index=0, delta={"type": "text_delta", "text": text})


def finish_events() -> list:
    return [ev("content_block_stop", index=0),
            ev("message_delta", delta={"stop_reason": "max_tokens", "stop_sequence": None},
               usage={"output_tokens": 2}),
            ev("message_stop")]


def error_data(kind: str = "api_error", request_id: str | None = RID) -> dict:
    body = {"type": "error", "error": {"type": kind, "message": "actor died"}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def sse(events: list, **kw) -> dict:
    return {"stream": True, "status": 200, "request_id": RID, "content_type": "text/event-stream; charset=utf-8",
            "events": events, "cancelled": False, "timed_out": False, "transport_error": None, "sent": 1.0,
            "end": 2.0} | kw


def plain(status: int, body, **kw) -> dict:
    return {"stream": False, "status": status, "request_id": RID, "content_type": "application/json", "body": body,
            "events": [], "cancelled": False, "timed_out": False, "transport_error": None, "sent": 1.0,
            "end": 2.0, "retry_after": "1" if status == 503 else None} | kw


MESSAGE = {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "text", "text": "x"}],
           "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}


# ---- complete -------------------------------------------------------------------------------


def test_a_stream_in_the_documented_order_is_complete_pings_anywhere_after_the_start():
    events = [*start_events(), ev("ping"), delta(), ev("ping"), delta(), *finish_events()]
    assert classify(sse(events)).kind == COMPLETE


def test_a_200_message_with_content_is_complete():
    assert classify(plain(200, MESSAGE)).kind == COMPLETE


@pytest.mark.parametrize("body, why", [
    ({**MESSAGE, "content": []}, "no content"),
    ({"_raw": "Internal Server Error"}, "not a Message"),
    ({**MESSAGE, "usage": {}}, "output_tokens"),
])
def test_a_200_body_not_of_the_documented_shape_has_no_ending(body, why):
    e = classify(plain(200, body))
    assert e.kind == NONE and why in e.reason


# ---- documented errors ------------------------------------------------------------------------


def test_a_503_overloaded_with_its_request_id_and_retry_after_is_a_documented_error():
    e = classify(plain(503, error_data("overloaded_error")))
    assert e == (e.__class__(ERROR, "503 overloaded_error"))


def test_a_500_api_error_with_its_request_id_is_documented_but_still_counted_as_a_500():
    recs = [plain(500, error_data("api_error")), plain(500, {"_raw": "Internal Server Error"})]
    assert classify(recs[0]).kind == ERROR and classify(recs[1]).kind == NONE
    counts = tally(recs)
    assert counts["http_500"] == 2 and counts["http_500_documented"] == 1
    assert counts["endings"][NONE] == 1 and counts["endings"][ERROR] == 1


@pytest.mark.parametrize("rec, why", [
    (plain(503, error_data("overloaded_error", request_id="req_other")), "not the header's"),
    (plain(503, error_data("overloaded_error", request_id=None)), "not the header's"),
    (plain(503, error_data("overloaded_error"), retry_after=None), "without retry-after"),
    (plain(503, error_data("api_error")), "for status 503"),
    (plain(503, {"_raw": "Request dropped due to backpressure"}), "not an error object"),
    (plain(503, error_data("overloaded_error"), request_id=None), "no request-id header"),
    (plain(502, error_data("api_error")), "undocumented status 502"),
])
def test_an_error_without_its_request_id_or_of_the_wrong_shape_has_no_ending(rec, why):
    e = classify(rec)
    assert e.kind == NONE and why in e.reason, e


def test_a_stream_ending_in_an_error_event_with_its_request_id_is_a_documented_error():
    assert classify(sse([*start_events(), delta(), ["error", error_data()]])) .kind == ERROR
    assert classify(sse([["error", error_data("overloaded_error")]])).kind == ERROR  # before anything else


def test_an_error_event_without_the_request_id_or_followed_by_more_has_no_ending():
    e = classify(sse([*start_events(), ["error", error_data(request_id=None)]]))
    assert e.kind == NONE and "request_id" in e.reason
    e = classify(sse([*start_events(), ["error", error_data()], delta()]))
    assert e.kind == NONE and "after the stream's end" in e.reason


# ---- cancels and no ending --------------------------------------------------------------------


def test_a_stream_the_soak_closed_part_way_is_a_cancel_only_if_the_soak_closed_it():
    events = [*start_events(), delta()]
    assert classify(sse(events, cancelled=True)).kind == CANCEL
    e = classify(sse(events))
    assert e.kind == NONE and "no terminal event" in e.reason


def test_a_stream_that_ended_before_the_planned_cancel_keeps_its_real_ending():
    assert classify(sse([*start_events(), delta(), *finish_events()], cancelled=True)).kind == COMPLETE


@pytest.mark.parametrize("events, why", [
    ([delta(), *finish_events()], "after 'nothing'"),
    ([*start_events(), delta(), ev("message_stop")], "'message_stop' after 'content_block_delta'"),
    ([*start_events(), *finish_events(), ev("ping")], "after the stream's end"),
    ([*start_events(), ["content_block_delta", {"type": "message_stop"}]], "carries data"),
    ([*start_events(), ev("content_block_delta", index=1, delta={})], "index 1"),
    ([*start_events(), ["<partial event>", "event: content_block_de"]], "'<partial event>'"),
    ([ev("ping"), *start_events(), *finish_events()], "'ping' after 'nothing'"),
])
def test_events_out_of_the_documented_order_have_no_ending(events, why):
    e = classify(sse(events))
    assert e.kind == NONE and why in e.reason, e


def test_resets_timeouts_and_cut_streams_have_no_ending():
    e = classify(plain(None, None, transport_error="ConnectError: refused"))
    assert e.kind == NONE and "no response" in e.reason
    assert classify(sse([*start_events()], timed_out=True)).reason == "client timeout"
    e = classify(sse([*start_events(), delta()], transport_error="RemoteProtocolError: peer closed"))
    assert e.kind == NONE and "stream cut after 'content_block_delta'" in e.reason
    e = classify(sse([], content_type="application/json"))
    assert e.kind == NONE and "not text/event-stream" in e.reason


def test_arrivals_not_sent_are_outside_the_count():
    recs = [{"overflow": True, "sent": 3.0, "end": 3.0}, plain(200, MESSAGE)]
    assert classify(recs[0]).kind == OVERFLOW
    counts = tally(recs)
    assert counts["sent"] == 1 and counts["overflow"] == 1


def test_parse_event_reads_the_name_and_the_json_data():
    block = b'event: message_stop\ndata: {"type":"message_stop"}'
    assert parse_event(block) == ["message_stop", {"type": "message_stop"}]
    assert parse_event(b"event: error\ndata: not json") == ["error", "not json"]


# ---- end state, memory, goals --------------------------------------------------------------------


def test_leaked_rows_and_orphans_both_ways():
    registry = [{"name": "zq-m-aaaaaaaaaaaa", "state": "busy", "rows": 2},
                {"name": "zq-m-bbbbbbbbbbbb", "state": "idle", "rows": 0},
                {"name": "zq-m-cccccccccccc", "state": "warm", "rows": 0}]  # not alive: a ghost
    before = ["zq-m-aaaaaaaaaaaa", "zq-m-bbbbbbbbbbbb", "zq-m-dddddddddddd", "zq-m-eeeeeeeeeeee"]
    after = ["zq-m-aaaaaaaaaaaa", "zq-m-bbbbbbbbbbbb", "zq-m-dddddddddddd"]  # e exited meanwhile: not an orphan
    end = end_state(registry, before, after)
    assert end["leaked_rows"] == 2 and end["orphans_alive"] == ["zq-m-dddddddddddd"]
    assert end["orphans_registered"] == ["zq-m-cccccccccccc"] and end["orphans"] == 2


def test_an_unreadable_registry_leaves_every_alive_actor_unaccounted():
    end = end_state(None, ["zq-m-aaaaaaaaaaaa"], ["zq-m-aaaaaaaaaaaa"], "no registry actor")
    assert end["leaked_rows"] is None and end["orphans"] == 1 and end["registry"] == "no registry actor"
    goals = judge(tally([plain(200, MESSAGE)]), end, 0.0)
    assert goals[2].met is False and "not read" in goals[2].figure


def test_rss_growth_from_the_witness_else_from_the_survivors():
    growth, how = rss_growth({"witness": {"name": "r1", "pid": 5, "start": 100, "end": 112}})
    assert growth == pytest.approx(0.12) and "r1" in how
    growth, how = rss_growth({"witness": None, "start": {"a": 100, "b": 100}, "end": {"a": 105, "c": 300}})
    assert growth == pytest.approx(0.05)
    growth, how = rss_growth({"witness": None, "start": {"a": 100}, "end": {"c": 300}})
    assert growth is None and "no ingress replica" in how


def test_goals_met_and_missed():
    clean = end_state([], [], [])
    goals = judge(tally([plain(200, MESSAGE), plain(503, error_data("overloaded_error"))]), clean, 0.05)
    assert [g.met for g in goals] == [True, True, True, True, None]  # no registry refusal: not measured
    bad = [plain(500, {"_raw": "boom"}), sse([*start_events()])]
    goals = judge(tally(bad), end_state([{"name": "zq-m-aaaaaaaaaaaa", "rows": 1}], [], []), 0.2,
                  {"the admission registry is unavailable; retry shortly": [0.1, 0.4]})
    assert [g.met for g in goals] == [False, False, False, False, False]
    assert goals[4].figure.startswith("2 refusals") and goals[4].figure.endswith("max 0.400 s")
    assert goals[0].figure.startswith("1 of 2") and goals[1].figure == "2 of 2"
    assert judge(tally(bad), clean, None)[3].met is None
    fast = judge(tally(bad), clean, None, {"the admission registry is unavailable; retry shortly": [0.1, 0.2]})
    assert fast[4].met is True


def test_longest_gap_without_a_completion():
    recs = [plain(200, MESSAGE, end=5.0), plain(200, MESSAGE, end=20.0), plain(503, error_data("overloaded_error"),
                                                                              end=40.0)]
    assert longest_gap_s(recs, 60.0) == pytest.approx(40.0)


# ---- schedules and the report ---------------------------------------------------------------------


def test_the_schedules_are_seeded_bounded_and_mixed():
    plan = Plan(minutes=2, rate=2.0, kill_every_s=5.0)
    arrivals, kills = arrival_plan(plan), chaos_plan(plan)
    assert arrivals == arrival_plan(plan) and kills == chaos_plan(plan)
    assert arrival_plan(Plan(minutes=2, rate=2.0, seed=8)) != arrivals
    assert 180 < len(arrivals) < 300 and all(0 < a.t < 120 for a in arrivals)
    assert 0.35 < sum(a.stream for a in arrivals) / len(arrivals) < 0.65
    assert all(a.stream and a.max_tokens >= 16 for a in arrivals if a.cancel_after is not None)
    assert len({a.input_tokens for a in arrivals}) > 2 and len({a.max_tokens for a in arrivals}) > 2
    assert 12 < len(kills) < 40 and {k for _, k in kills} <= {"actor", "registry_restart", "registry_gone", "ingress"}


def test_the_report_states_the_command_and_every_goal(tmp_path):
    plan = json.loads(json.dumps(Plan(minutes=1).__dict__))
    data = {
        "command": ".venv/bin/python -m benchmarks.soak --minutes 1", "started": 0.0, "elapsed_s": 150.0,
        "machine": {"cores": 2, "cpu": "x", "mem_gib": 8, "python": "3.11", "torch": "2", "ray": "2.60",
                    "loadavg_start": [0.5, 0.5, 0.5], "loadavg_end": [1.9, 1.0, 0.8]},
        "model": {"id": "zq-demo", "preset": "small", "params_m": 100, "layers": 12, "hidden": 768, "heads": 12,
                  "kv_heads": 4, "dtype": "bfloat16", "file_mb": 150},
        "plan": plan, "namespace": "zeroqueue-soak",
        "records": [plain(200, MESSAGE), plain(500, {"_raw": "boom"}), sse([*start_events(), delta()],
                                                                          cancelled=True)],
        "kills": [{"t": 3.2, "kind": "actor", "target": "zq-m-aaaaaaaaaaaa", "result": "killed"},
                  {"t": 7.0, "kind": "ingress", "target": None, "result": "no target"}],
        "rss": {"witness": {"name": "r1", "pid": 5, "start": 100 << 20, "end": 104 << 20, "peak": 110 << 20},
                "start": {}, "end": {"r1": 104 << 20}},
        "registry_actors": [], "alive_before": [], "alive_after": [],
    }
    verdicts = write_report(data, tmp_path / "soak.md")
    text = (tmp_path / "soak.md").read_text()
    assert data["command"] in text and "| 0 HTTP 500s | 1 of 3 (0 with the documented body) | **missed** |" in text
    assert "| ingress RSS growth ≤ 10% | +4.0% | met |" in text and "| actor | 1 | 0 | 3.2 |" in text
    assert "| ingress | 0 | 1 | – |" in text and "| cancel | 1 |" in text
    assert "missed" in verdicts and "met" in verdicts


def test_a_request_without_an_ending_names_the_kills_made_while_it_was_in_flight():
    recs = [plain(500, {"_raw": "Internal Server Error"}, sent=10.0, end=12.0, i=4)]
    kills = [{"t": 11.0, "kind": "ingress", "result": "killed"}, {"t": 13.0, "kind": "actor", "result": "killed"},
             {"t": 11.5, "kind": "actor", "result": "no target"}]
    counts = tally(recs, kills)
    (reason,) = counts["none_reasons"]
    assert counts["none_during"][reason] == {"ingress": 1}
    assert counts["none_examples"][reason].startswith("#4 at 10.0 s: status 500; JSON; body 'Internal Server Error'")
