"""bench_peer's own logic: the prompts each run sends, and its CPU table."""

from __future__ import annotations


def test_bench_peer_gives_every_rate_prompts_no_other_run_sends():
    """GuideLLM seeds its n-th prompt with seed + n: runs whose seeds lie closer than the prompts they send share
    prompts, which a server's prompt cache then computes for free."""
    from benchmarks.bench_peer import SEED_STRIDE, WARMUP_SEED, seed_of

    rates = [0.25, 0.5, 1, 2, 4, 8, 16]
    max_prompts = int(max(rates) * 600)  # ten minutes at the highest rate
    assert max_prompts < SEED_STRIDE
    firsts = [WARMUP_SEED] + [seed_of(i) for i in range(len(rates))]
    spans = sorted((first, first + max_prompts) for first in firsts)
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))


def test_bench_peer_reports_each_rates_cpu_as_a_share_of_the_cores_and_per_served_request(monkeypatch):
    from benchmarks import bench_peer

    monkeypatch.setattr(bench_peer, "cores", lambda: 2)
    row = {"served": 10, "cpu": {"wall_s": 10.0, "by_role_s": {"engines": 12.0, "load client": 4.0,
                                                                 "haproxy": 0.5, "ingress": 0.5}}}
    lines = bench_peer._cpu_lines({"rates": [4], "servers": {"zeroqueue": {"4": row}}})
    line = next(x for x in lines if x.startswith("| zeroqueue"))
    # 17 of 20 core-seconds busy; the server besides its engines: 1 s over 10 served requests
    assert line == "| zeroqueue | 4 | 85% | engines 60, load client 20, haproxy 2, ingress 2 | 100 |"
