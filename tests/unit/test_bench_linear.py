"""bench_linear's report: the step's share of weight reads and the fastest chain, from figures given by hand."""

from __future__ import annotations

from benchmarks.bench_linear import report


def test_the_report_names_the_fastest_chain_and_what_the_step_would_take():
    eager, fp32, tuned = "eager (the runtime's linear)", "eager, fp32 weights", "compiled, max-autotune"
    data = {"dtype": "bfloat16", "weight_bytes": 269_000_000, "step_s": {1: 0.100, 8: 0.150},
            "packed_step_s": {1: 0.090, 8: 0.120},
            "chain_s": {eager: {1: 0.075, 8: 0.090}, fp32: {1: 0.074, 8: 0.180}, tuned: {1: 0.045, 8: 0.045}},
            "compile_s": {tuned: {1: 150.0, 8: 160.0}}, "max_abs_diff": {tuned: {1: 0.0, 8: 0.0078}},
            "machine": {"cores": 2, "cpu": "a CPU", "python": "3.11", "torch": "2.x"}}
    text = report(data, "cmd", 60.0, (0.5, 1.0))
    assert "| compiled, max-autotune | 1 | 45.0 | 6.0 | 0.60 | 150 |" in text
    assert "| eager, fp32 weights | 1 | 74.0 | 7.3 | 0.99 |  |" in text  # fp32 streams twice the bytes
    assert "75% of the eager step" in text and "1.67× the eager one" in text and "would take 70.0 ms" in text
    assert "at most 0.0078" in text
    assert "| the engine's whole step, packed weights (the actors') | 8 | 120.0 | | 1.33 | |" in text
