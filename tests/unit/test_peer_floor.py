"""bench_peer's refusal floor: the places the targets allow shrink as steps slow, and the floor is Erlang-B's."""

from __future__ import annotations

import pytest

from benchmarks import peer_floor
from benchmarks.erlang import erlang_b

MODEL = {"rule": {"prefill_tokens_per_s": 1000.0, "decode_s_per_token": 0.01, "batch_row_cost": 0.1,
                  "kv_read_bytes_per_s": 1e15, "overhead_s": 0.0},
         "ttft_target_s": 1.0, "tpot_target_s": 0.05, "max_batch": 32, "num_actors": 2, "kv_bytes_per_token": 1}


def _row(correction, hold_s=2.0, failed=30, sent=100):
    return {"traces": {"step_correction_p50": correction}, "hold_mean_s": hold_s, "prompt_tokens_mean": 100,
            "output_tokens_mean": 16, "failed": failed, "sent": sent}


def test_places_are_the_batch_a_newcomer_joins_within_its_tpot_target_and_shrink_as_steps_slow():
    # A step of n rows: 0.01 * (1 + 0.1 * (n - 1)) s, within 0.05 s up to n = 41 rows: the cap of 32 binds.
    assert peer_floor.floor_row(MODEL, 4, _row(1.0))["per_actor"] == 32
    # Steps twice the rule's: TPOT alone would allow 16 rows, but the newcomer's prompt goes in the chunks the
    # rows' slack leaves: at 10 rows (0.038 s a step) 6 tokens a step, 17 steps, TTFT 0.88 s; at 11 (0.04 s) 5 a
    # step, 20 steps, 1.04 s: past the 1 s target.
    slow = peer_floor.floor_row(MODEL, 4, _row(2.0))
    assert slow["per_actor"] == 10 and slow["places"] == 20


def test_the_floor_is_erlang_b_of_the_places_at_the_rate_times_the_hold():
    f = peer_floor.floor_row(MODEL, 10, _row(2.0, hold_s=3.0))
    assert f["offered_erlangs"] == pytest.approx(30.0)
    assert f["floor"] == pytest.approx(erlang_b(20, 30.0)) and f["refused"] == pytest.approx(0.3)


def test_the_capacity_floor_is_what_the_engine_completes_a_second_at_the_correction():
    # 99 prompt tokens beyond the weights' pass at 1000/s, then 16 steps of a full batch of 32 shared by 32 rows:
    # 0.099 + 16 * 0.01 * (1 + 0.1 * 31) / 32 = 0.1195 s a request at the rule's speed, twice that at 2x.
    f = peer_floor.floor_row(MODEL, 8, _row(1.0))
    assert f["capacity_per_s"] == pytest.approx(1 / 0.1195, rel=1e-3)
    assert f["capacity_floor"] == pytest.approx(0.0)  # 8.4 a second against 8 arriving
    slow = peer_floor.floor_row(MODEL, 8, _row(2.0))
    assert slow["capacity_floor"] == pytest.approx(1 - 1 / (2 * (0.099 + 16 * 0.01 * 1.9 / 10)) / 8, rel=1e-3)


def test_without_a_recorded_correction_there_is_no_capacity_floor_and_the_places_are_the_rules():
    f = peer_floor.floor_row(MODEL, 4, _row(None))
    assert f["capacity_floor"] is None and f["per_actor"] == 32


def test_a_rate_without_served_requests_has_no_floor_and_the_report_skips_it():
    assert peer_floor.floor_row(MODEL, 4, {"traces": None, "hold_mean_s": None, "failed": 1, "sent": 1}) is None
    data = {"rates": [4.0, 8.0], "floor_model": MODEL, "cores": 2,
            "servers": {"zeroqueue": {"4": _row(1.0, failed=0), "8": {"traces": None, "hold_mean_s": None}}}}
    lines = peer_floor.report_lines(data, num_cores=2)
    assert [line.split("|")[1].strip() for line in lines if line.startswith("| 4")] == ["4"]
    assert "| met |" in lines[-1] and not any(line.startswith("| 8") for line in lines)


def test_engines_side_by_side_multiply_the_capacity_and_a_run_without_the_count_has_one():
    """Two slots, a hot actor computing on each: twice what one engine completes at the same correction."""
    one = peer_floor.floor_row(MODEL, 8, _row(2.0))
    two = peer_floor.floor_row(MODEL | {"num_engines": 2}, 8, _row(2.0))
    assert two["capacity_per_s"] == pytest.approx(2 * one["capacity_per_s"])
    assert two["capacity_floor"] == pytest.approx(max(0.0, 1 - two["capacity_per_s"] / 8))


def test_make_serves_config_counts_an_engine_per_slot_with_a_hot_actor():
    from benchmarks.bench_peer import app_args

    model = peer_floor.floor_model(app_args("configs/serve.yaml"))
    assert model["num_engines"] == 2 and model["num_actors"] == 3
