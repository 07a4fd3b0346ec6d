"""bench_idle_steps' pure parts: the class draw follows bench_load's mix, and the report states each planner's figures
and the ratio to the whole-prompt planner."""

from __future__ import annotations

import random
from collections import Counter

from benchmarks import bench_idle_steps as bench
from benchmarks.load_scenarios import MIXED


def test_classes_are_drawn_by_their_share_of_the_mix():
    rng = random.Random(5)
    counts = Counter(bench._draw_class(rng).name for _ in range(20_000))
    assert set(counts) == {name for name, _ in MIXED}
    for name, share in MIXED:
        assert abs(counts[name] / 20_000 - share) < 0.02


def test_the_report_gives_each_planners_median_and_the_ratio_to_whole():
    loop = {"bounded": [{"requests_per_s": 3.0, "output_tokens_per_s": 30.0},
                        {"requests_per_s": 5.0, "output_tokens_per_s": 50.0},
                        {"requests_per_s": 4.0, "output_tokens_per_s": 40.0}],
            "whole": [{"requests_per_s": 5.0, "output_tokens_per_s": 55.0}] * 3}
    data = {"command": "cmd", "cores": 2, "cpu": "cpu", "cpu_features": ["avx2"], "python": "3.11", "torch": "2",
            "load_before": [0.5, 0.5, 0.5], "elapsed_s": 60.0, "repeats": 3, "seconds": 30.0,
            "facts": {"preset": "small", "params_m": 100.0, "layers": 12}, "dtype": "bfloat16", "threads": 1,
            "tpot_target_s": 0.15, "correction": 0.5, "idle_budget_tokens": 256,
            "step_cost": {"decode_s_per_token": 0.054, "prefill_tokens_per_s": 800.0},
            "behind": {"bounded": [{"short": 0.3, "long": 0.8}, {"short": 0.2, "long": 0.9}, {"short": 0.4, "long": 0.7}],
                       "whole": [{"short": 0.7, "long": 0.7}] * 3},
            "loops": {"3": loop}}
    text = bench.report(data)
    assert "| bounded | 0.300 (0.200–0.400) | 0.800 (0.700–0.900) |" in text
    assert "| whole | 0.700 (0.700–0.700) | 0.700 (0.700–0.700) |" in text
    assert "| 3 | bounded | 4.00 | 40.0 | 0.80 |" in text  # medians, and 4 / 5 requests a second
    assert "| 3 | whole | 5.00 | 55.0 | 1.00 |" in text
