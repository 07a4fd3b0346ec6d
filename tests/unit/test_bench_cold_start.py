"""The cold-start benchmark's arithmetic: overlap efficiency, regimes, the clock check, rows and the report."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from actors.cold_start import estimate_prefill_layer_seconds
from actors.messages import Timings
from actors.shard_header import open_zqs
from benchmarks import bench_cold_start as bench
from benchmarks.cold_start_report import clock_gap, overlap_efficiency, regime, report, rows
from benchmarks.cold_start_runs import (
    BASELINE,
    DERIVED,
    EVICTED,
    FIRST_ONE,
    MODES,
    PAGE_CACHE,
    Calibration,
    InProcess,
    Run,
)


def _run(mode: str, *, load: float, ttft: float, compute_start: float, hot_prefill: float, init: float = 0.1,
         clock_offset: float = 0.0, storage: str = PAGE_CACHE, t0: float = 1000.0) -> Run:
    """A run whose actor started at t0; its resident times reported `clock_offset` seconds early."""
    cold = Timings(actor_start=t0, request_arrival=t0 + init, first_layer_resident=t0 + 0.3 - clock_offset,
                   all_layers_resident=t0 + load - clock_offset, compute_start=t0 + init,
                   first_layer_compute_start=t0 + compute_start, first_token=t0 + ttft, last_token=t0 + ttft)
    h0 = t0 + 10
    hot = Timings(actor_start=t0, request_arrival=h0, first_layer_resident=cold.first_layer_resident,
                  all_layers_resident=cold.all_layers_resident, compute_start=h0 + 0.001,
                  first_layer_compute_start=h0 + 0.001, first_token=h0 + 0.001 + hot_prefill,
                  last_token=h0 + 0.001 + hot_prefill)
    return Run("m bf16", "balanced", 512, mode, storage, 12 if mode == BASELINE else 1, t0 - 2.0, t0 + init,
               t0 + ttft + 0.01, cold, h0 - 0.002, hot.first_token + 0.003, hot)


def _balanced_group(clock_offset: float = 0.0) -> list[Run]:
    """Load 1.0 s, prefill 1.0 s: load-then-compute takes 2.0 s, streamed 1.1 s."""
    runs = []
    for k in range(3):
        t0 = 1000.0 + 100 * k
        runs.append(_run(BASELINE, load=1.0, ttft=2.0, compute_start=1.0, hot_prefill=1.0,
                         clock_offset=clock_offset, t0=t0))
        runs.append(_run(DERIVED, load=1.05, ttft=1.1, compute_start=0.2, hot_prefill=1.0,
                         clock_offset=clock_offset, t0=t0 + 20))
    return runs


def test_overlap_efficiency_is_ttft_over_the_slower_of_load_and_prefill() -> None:
    assert overlap_efficiency(1.2, 1.0, 0.5) == pytest.approx(1.2)
    assert overlap_efficiency(3.0, 1.0, 2.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="must take some time"):
        overlap_efficiency(1.0, 0.0, 0.0)


def test_regime_names_the_slower_side_unless_within_the_factor() -> None:
    assert regime(1.0, 0.1) == "load-bound"
    assert regime(0.1, 1.0) == "compute-bound"
    assert regime(1.0, 1.4) == regime(1.4, 1.0) == "balanced"


def test_balanced_tokens_scales_linearly_in_multiples_of_16_within_bounds() -> None:
    assert bench.balanced_tokens(512, prefill_s=0.5, load_s=1.0, max_tokens=4096) == 1024
    assert bench.balanced_tokens(512, prefill_s=1.0, load_s=0.7, max_tokens=4096) == 352  # 358.4 -> 352
    assert bench.balanced_tokens(512, prefill_s=0.1, load_s=10.0, max_tokens=2000) == 2000
    assert bench.balanced_tokens(512, prefill_s=10.0, load_s=0.1, max_tokens=2000) == 64


def test_prefill_flops_count_what_the_actor_divides_by_its_rate() -> None:
    # 2 layers of (2 * 100 params * 10 tokens + 4 * 10^2 tokens^2 * 2 heads * 4 dims)
    assert bench.prefill_flops(2, 100, 2, 4, 10) == pytest.approx(2 * (2000 + 3200))
    rate = 5e9
    per_layer = estimate_prefill_layer_seconds(100, 2, 4, 10, rate)
    assert bench.prefill_flops(2, 100, 2, 4, 10) / rate == pytest.approx(2 * per_layer)


def test_schedule_runs_every_mode_once_per_block_rotating_the_first() -> None:
    blocks = bench.schedule(["short", "balanced"], repeats=3, evicted_repeats=2)
    page = [b for b in blocks if b[1] == PAGE_CACHE]
    assert len(page) == 6 and all(sorted(modes) == sorted(MODES) for _, _, modes in page)
    assert [modes[0] for p, _, modes in page if p == "short"] == [MODES[0], MODES[1], MODES[2]]
    evicted = [b for b in blocks if b[1] == EVICTED]
    assert [(p, modes) for p, _, modes in evicted] == [("balanced", (DERIVED, BASELINE)),
                                                      ("balanced", (BASELINE, DERIVED))]
    assert all(b[1] == PAGE_CACHE for b in bench.schedule(["short"], repeats=1, evicted_repeats=2))


def test_clock_gap_is_compute_start_after_the_last_group_in_load_then_compute_runs() -> None:
    assert clock_gap(_balanced_group()) == pytest.approx(0.0, abs=1e-9)
    # Resident times reported 0.1 s late: compute would seem to start before the load ended.
    assert clock_gap(_balanced_group(clock_offset=-0.1)) == pytest.approx(-0.1)
    assert clock_gap([r for r in _balanced_group() if r.mode != BASELINE]) is None


def test_rows_compare_each_mode_with_load_then_compute_of_the_same_group() -> None:
    runs = _balanced_group()
    table = rows(runs)
    by_mode = {r.mode: r for r in table}
    assert set(by_mode) == {DERIVED, BASELINE}  # no N=1 runs: no row
    derived = by_mode[DERIVED]
    assert derived.regime == "balanced"
    assert derived.load_ref == pytest.approx(1.0) and derived.prefill_ref == pytest.approx(1.0)
    assert derived.stats["load"].median == pytest.approx(1.05)
    assert derived.efficiency == pytest.approx(1.1)
    assert derived.vs_baseline == pytest.approx(0.55)
    assert by_mode[BASELINE].vs_baseline == pytest.approx(1.0)
    assert derived.stats["process_start"].median == pytest.approx(2.0)


def test_prompt_of_length_is_the_longest_chat_prompt_that_fits(tiny_zqs) -> None:
    reader, config, tokenizer = open_zqs(tiny_zqs)
    reader.close()
    for n in (16, 100):
        prompt = bench.prompt_of_length(tokenizer, config.max_position_embeddings, n)
        assert n - 4 <= len(prompt) <= n
    with pytest.raises(ValueError, match="cannot hold"):
        bench.prompt_of_length(tokenizer, config.max_position_embeddings, 2)


def test_report_renders_from_saved_json_with_goals_and_the_clock_note() -> None:
    runs = _balanced_group() + [
        _run(FIRST_ONE, load=1.1, ttft=1.6, compute_start=0.2, hot_prefill=1.0, t0=5000.0)]
    cal = Calibration(model="m", dtype="bf16", num_layers=12, num_params=100, weight_bytes=200,
                      file_bytes=140, load_s=1.0, init_s=0.1, load_bytes_per_s=2e8,
                      prompts={"balanced": 512}, prefill_s={"balanced": 1.0}, prefill_flops_per_s=1e11,
                      expected_n={"balanced": 1})
    meta = {"command": "x", "started": "now", "elapsed_s": 60.0, "load_before": "0", "load_after": "0",
            "load_threads": 1, "compute_threads": 1, "cpu_nice": 0, "repeats": 3, "cores": 2, "cpu": "cpu",
            "mem_gib": 1.0, "python": "3", "torch": "2", "ray": "2"}
    data = json.loads(json.dumps({"meta": meta, "calibrations": [asdict(cal)], "runs": [asdict(r) for r in runs],
                                  "in_process": [asdict(InProcess("m bf16", "balanced", 1.0, 0.999))] * 3}))
    text = report(data)
    assert "streamed, derived N: **met** (0.550 ≤ 0.6)" in text
    assert "streamed, N=1: **missed** by 33.3% (1.600 > 1.2)" in text
    assert "a median 0.0 ms after every group was resident" in text and "share one clock" in text
    # Resident times reported 0.1 s late would show as compute before the load ended: flagged.
    late = [asdict(r) for r in _balanced_group(clock_offset=-0.1)]
    text = report(json.loads(json.dumps({**data, "runs": late})))
    assert "a median -100.0 ms after every group was resident" in text
    assert "**negative: the actor's resident times are not on its compute clock" in text
    assert ("balanced (512 tokens): **met** (1.001 ≤ 1.1); the actor adds 1.0 ms: "
            "1.0 ms from arrival to compute start") in text
