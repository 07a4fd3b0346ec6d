"""The warm-start report: medians per configuration, the per-layer trade-off, and the goals judged from a run."""

from __future__ import annotations

from benchmarks.warm_report import report

MiB = 1 << 20


def _run(warm_ttft: float, cold_ttft: float) -> dict:
    actors = []
    for prompt in ("short", "balanced"):
        actors.append({"prompt": prompt, "prompt_tokens": 16, "config": "fresh spawn", "warm_layers": None,
                       "ttft_s": 2.0, "ready_s": None, "rss_bytes": None})
        for n, ttft, rss in ((1, 0.30, 300), (4, 0.10, 340)):
            actors.append({"prompt": prompt, "prompt_tokens": 16, "config": f"warm, N={n}", "warm_layers": n,
                           "ttft_s": ttft, "ready_s": 1.5, "rss_bytes": rss * MiB})
    http = ([{"pool": "warm pool", "tier": "warm", "ttft_s": warm_ttft, "client": "kept client"}] * 3
            + [{"pool": "warm pool", "tier": "warm", "ttft_s": warm_ttft + 0.03, "client": "new client"}] * 3
            + [{"pool": "no pool", "tier": "cold", "ttft_s": cold_ttft, "client": "kept client"}] * 3)
    meta = {"command": "x", "started": "now", "elapsed_s": 60, "cores": 2, "python": "3.11", "torch": "2",
            "load_before": (0.1, 0, 0), "load_after": (0.2, 0, 0), "preset": "small", "dtype": "bfloat16",
            "num_layers": 4, "weight_bytes": 200 * MiB, "load_s": 0.5, "prompt_tokens": {"short": 16, "balanced": 300},
            "policy_n": {"short": 4, "balanced": 1}, "repeats": 1}
    return {"meta": meta, "actors": actors, "http": http}


def test_the_report_judges_both_goals_from_the_apps_warm_and_cold_requests():
    text = report(_run(warm_ttft=0.2, cold_ttft=2.0))
    assert "warm TTFT median ≤ 0.35 s: **0.200 s** (met)" in text
    assert "**0.10×** (0.200 against 2.000 s; met)" in text
    missed = report(_run(warm_ttft=0.6, cold_ttft=1.0))
    assert "(missed)" in missed and "**0.60×**" in missed


def test_the_goals_are_judged_on_the_kept_client_and_each_client_has_its_row():
    text = report(_run(warm_ttft=0.05, cold_ttft=2.0))
    assert "Judged on the kept client's requests." in text and "**0.050 s** (met)" in text
    assert "| warm pool | kept client | 3 | warm 3 | 0.050 |" in text
    assert "| warm pool | new client | 3 | warm 3 | 0.080 |" in text


def test_a_run_recorded_before_the_client_was_named_reads_as_a_new_client_per_request():
    run = _run(warm_ttft=0.2, cold_ttft=2.0)
    run["http"] = [{k: v for k, v in r.items() if k != "client"} for r in run["http"] if r["client"] != "new client"]
    text = report(run)
    assert "Judged on the new client's requests." in text and "| warm pool | new client | 3 |" in text


def test_the_trade_off_says_what_a_layer_costs_and_saves():
    text = report(_run(0.2, 2.0))
    # N=1 -> N=4: 200 ms less, 40 MiB more, over 3 layers.
    assert "TTFT falls by 200 ms (66.7 ms a layer) for 40 MiB more resident (13.3 MiB a layer)" in text
    assert "picks N=4 for the short prompt, N=1 for the balanced prompt" in text
    assert "| short | warm, N=1 | 0.300 |" in text and "| short | fresh spawn | 2.000 |" in text
