"""bench_peer's own logic: the prompts each run sends, and its CPU table."""

from __future__ import annotations


def _serve_yaml() -> dict:
    """configs/serve.yaml as `make serve` reads it, a fresh copy each call (the variants change it in place)."""
    from pathlib import Path

    import yaml

    return yaml.safe_load(Path("configs/serve.yaml").read_text())


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


def test_the_same_config_again_is_reported_as_the_run_to_run_spread():
    """`zeroqueue-again` serves configs/serve.yaml unchanged, and the report sets it against the first run as any
    variant: ratios of one config's two runs."""


    from benchmarks import bench_peer

    config = _serve_yaml()
    assert bench_peer.VARIANTS["zeroqueue-again"][0](_serve_yaml()) == config
    row = {"served": 10, "ttft_p50_s": 0.2, "ttft_p99_s": 0.8, "itl_p50_s": 0.02, "output_tokens_per_s": 16.0,
           "goodput_per_s": 1.0}
    again = row | {"served": 8, "ttft_p99_s": 1.0}
    lines = bench_peer._variant_lines({"rates": [4], "servers": {"zeroqueue": {"4": row},
                                                                 "zeroqueue-again": {"4": again}}})
    assert "## configs/serve.yaml against `zeroqueue-again`" in lines
    assert "| 4 | 10 / 8 | 1.00× | 0.80× | 1.00× | 1.00× | 1.00× |" in lines


def test_a_reports_cpu_shares_are_of_the_cores_the_run_measured_on(monkeypatch):
    """A report rewritten on another machine (--report-only) divides by the run's own cores, kept in its JSON."""
    from benchmarks import bench_peer

    monkeypatch.setattr(bench_peer, "cores", lambda: 16)
    row = {"served": 10, "cpu": {"wall_s": 10.0, "by_role_s": {"engines": 12.0, "load client": 4.0}}}
    line = next(x for x in bench_peer._cpu_lines({"rates": [4], "cores": 2, "servers": {"zeroqueue": {"4": row}}})
                if x.startswith("| zeroqueue"))
    assert line.startswith("| zeroqueue | 4 | 80% | engines 60, load client 20 |")
    assert bench_peer.run_cores({}) == 16  # a run from before the cores were kept: this machine's


def test_each_layout_variant_changes_make_serves_config_only_where_it_says():
    """`zeroqueue-1x2` is make serve's config on one slot of both cores, and `zeroqueue-2slots-governed` (the
    layout it was measured as before it became make serve's) leaves make serve's config as it is."""


    from actors.actor_config import ActorConfig
    from benchmarks import bench_peer

    base = _serve_yaml()["applications"][0]["args"]
    one = bench_peer.VARIANTS["zeroqueue-1x2"][0](_serve_yaml())["applications"][0]["args"]
    assert (one["slots"]["num_cpu_slots"], one["policy"]["max_hot_short_actors"]) == (1, 1)
    assert (one["actor"]["num_cpus"], one["actor"]["compute_threads"], one["actor"]["min_compute_threads"]) == (2, 2, 1)
    assert {k: v for k, v in one.items() if k not in ("slots", "actor", "policy")} == {
        k: v for k, v in base.items() if k not in ("slots", "actor", "policy")}
    ActorConfig(**one["actor"])  # a valid actor config
    assert bench_peer.VARIANTS["zeroqueue-2slots-governed"][0](_serve_yaml())["applications"][0]["args"] == base
    assert (base["slots"]["num_cpu_slots"], base["actor"]["num_cpus"], base["actor"]["compute_threads"],
            base["actor"]["min_compute_threads"]) == (2, 1, 2, 1)


def test_the_report_says_how_guidellm_and_the_server_shared_the_cores(tmp_path):
    """With autogroup on, nice orders threads only within a session: the report says so rather than claim the nice
    the benchmark sets decides GuideLLM's share."""
    from benchmarks import bench_peer

    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("1\n")
    assert bench_peer.is_autogroup(flag) is True
    flag.write_text("0\n")
    assert bench_peer.is_autogroup(flag) is False
    assert bench_peer.is_autogroup(tmp_path / "absent") is None
    assert "split them evenly whatever their nice" in bench_peer.cpu_sharing(True)
    assert bench_peer.cpu_sharing(False).endswith("so it takes its CPU from both alike.")
    assert "did not record" in bench_peer.cpu_sharing(None)  # a run from before the setting was kept


def test_the_rule_variants_change_only_their_constant_and_stay_valid_configs():


    from benchmarks import bench_peer
    from serve_app.config import AppArgs

    base = _serve_yaml()["applications"][0]["args"]
    for name, changed in (("zeroqueue-flat-prompt", {"attention_pairs_per_s": None}),
                          ("zeroqueue-idle-node", {"node_cpus": 0})):
        args = bench_peer.VARIANTS[name][0](_serve_yaml())["applications"][0]["args"]
        assert {k: v for k, v in args.items() if k != "rule_scorer"} == {k: v for k, v in base.items()
                                                                          if k != "rule_scorer"}
        expected = {k: v for k, v in {**base["rule_scorer"], **changed}.items() if v is not None}
        assert args["rule_scorer"] == expected, name
        AppArgs.model_validate(args)
