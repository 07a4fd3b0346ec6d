"""bench_served_decode's own logic: a request's decode time a token, and its report."""

from __future__ import annotations

import pytest

from benchmarks import bench_served_decode as bench


def test_decode_a_token_is_the_deltas_span_over_the_tokens_the_usage_counted_between_them():
    # Four deltas; the second carried two tokens: 5 tokens in 0.1 s after the first delta.
    assert bench.decode_of([1.0, 1.02, 1.06, 1.1], [1, 3, 4, 6]) == pytest.approx(0.02)
    assert bench.decode_of([1.0], [1]) is None  # one token: no decode to time
    assert bench.decode_of([1.0, 1.1], [2, 2]) is None


def test_one_thread_changes_only_the_actors_compute_threads():
    """On make serve's two slots, bench_peer's 2x1 variant is its actors on one thread and nothing else."""
    from pathlib import Path

    import yaml

    config = yaml.safe_load(Path("configs/serve.yaml").read_text())
    changed = bench.LAYOUTS["one thread"](yaml.safe_load(Path("configs/serve.yaml").read_text()))
    assert changed["applications"][0]["args"]["actor"].pop("compute_threads") == 1
    config["applications"][0]["args"]["actor"].pop("compute_threads")
    assert changed == config


def test_the_report_sets_each_app_against_the_engine_alone_on_its_threads():
    def app(decode_s: float, ingress_s: float) -> dict:
        runs = [{"ttft_s": 0.1, "decode_s_per_token": decode_s, "tokens": 64}] * 4
        return {"runs": runs, "cpu": {"wall_s": 8.0, "by_role_s": {"engines": 6.0, "ingress": ingress_s}},
                "step_threads": 1.5}

    data = {"command": "cmd", "machine": {"cores": 2, "cpu": "a CPU", "torch": "2", "ray": "2"}, "load_before": 0.5,
            "elapsed_s": 60.0, "requests": 4, "tokens": 64, "engine_alone_s": {"2": 0.010, "1": 0.0125},
            "apps": {"configs/serve.yaml": app(0.016, 0.64), "one thread": app(0.015, 0.32)}}
    text = bench.report(data)
    assert "| served: configs/serve.yaml | 1–2, governed | 16.0 (16.0–16.0) | 1.60× | 100 | 1.50 |" in text
    assert "| served: one thread | 1 | 15.0 (15.0–15.0) | 1.20× | 100 | 1.50 |" in text
    assert "| engine alone | 2 | 10.0 | 1.00× | | |" in text
    # 0.64 s of ingress over 256 tokens: 2.5 ms a token, 8% of a core over the 8 s
    assert "ingress 2.50 (8%)" in text
