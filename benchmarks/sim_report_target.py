"""The simulation report's section on places by prediction: zero-queue with 8 fixed places, zero-queue admitting
joins by a TPOT target, and the queued baselines at 8 rows, on the same arrivals (benchmarks/simulate.py)."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.sim_config import SimConfig
from benchmarks.sim_format import num, pct, ratio
from benchmarks.sim_results import (
    SYSTEM_NAMES,
    ZQ_BY_PREDICTION,
    ClassMetrics,
    DecisionCost,
    PointResult,
    ScorerCheck,
)
from benchmarks.sim_scorer import prefill_tokens_per_s
from serve_app.scorer import RULE_SCORER

ZQ, FIFO, BOUNDED, SERVE = SYSTEM_NAMES
# The section's columns, in this order: the two zero-queue runs, then the queued baselines.
COMPARED = (ZQ, ZQ_BY_PREDICTION, FIFO, BOUNDED, SERVE)
SHORT_NAMES = {ZQ: "zq fixed", ZQ_BY_PREDICTION: "zq by prediction", FIFO: "FIFO", BOUNDED: "bounded FIFO",
               SERVE: "Serve default"}
TARGET_SECTION = "## Places by prediction: a TPOT target in place of a fixed count of rows"
TARGET_FLOOR_HEADER = "Erlang-B floor, the target's places %"


def _at(results: list[PointResult], process: str, load: float, system: str) -> PointResult | None:
    return next((r for r in results if r.process == process and r.load == load and r.system == system), None)


def _cells(results: list[PointResult], process: str, load: float, text) -> str:
    """One cell per compared system: `text(point)`, or a dash where that system did not run at this load."""
    points = (_at(results, process, load, s) for s in COMPARED)
    return " | ".join("–" if p is None else text(p) for p in points)


def _all(p: PointResult) -> ClassMetrics:
    return p.metrics["all"]


def _tables(cfg: SimConfig, results: list[PointResult], process: str) -> list[str]:
    names = " | ".join(SHORT_NAMES[s] for s in COMPARED)
    seps = "|--:" * len(COMPARED)
    target = cfg.tpot_target_s
    lines = [f"| load | Erlang-B floor, {cfg.max_batch} places % | {TARGET_FLOOR_HEADER} | rejected %: {names} "
             f"| rows per busy actor: {names} |", f"|--:|--:|--:{seps}{seps}|"]
    for load in cfg.loads:
        lines.append(f"| {load:.1f} | {pct(cfg.erlang_floor(load))} | {pct(cfg.erlang_target_floor(load))} "
                     f"| {_cells(results, process, load, lambda p: pct(_all(p).reject_rate))} "
                     f"| {_cells(results, process, load, lambda p: num(p.rows_per_busy_actor))} |")
    lines += ["", f"| load | TTFT P50 (s): {names} | TTFT P99 (s): {names} | goodput/s: {names} "
              f"| goodput, by prediction ÷ fixed |", f"|--:{seps}{seps}{seps}|--:|"]
    for load in cfg.loads:
        fixed, by = _at(results, process, load, ZQ), _at(results, process, load, ZQ_BY_PREDICTION)
        gain = ratio(_all(by).goodput_per_s, _all(fixed).goodput_per_s) if by is not None and fixed else "–"
        lines.append(f"| {load:.1f} | {_cells(results, process, load, lambda p: num(_all(p).ttft_s[0]))} "
                     f"| {_cells(results, process, load, lambda p: num(_all(p).ttft_s[1]))} "
                     f"| {_cells(results, process, load, lambda p: num(_all(p).goodput_per_s, 1))} | {gain} |")
    lines += ["", f"| load | TPOT ÷ target P50 / P99 / % over it: {names} |", f"|--:{seps}|"]
    for load in cfg.loads:
        def tpot(p: PointResult) -> str:
            m = _all(p)
            return f"{num(m.tpot_s[0] / target)} / {num(m.tpot_s[1] / target)} / {pct(m.tpot_over_target)}"

        lines.append(f"| {load:.1f} | {_cells(results, process, load, tpot)} |")
    return lines


def _why_target(cfg: SimConfig) -> str:
    cal, target = cfg.calibration, cfg.tpot_target_s
    steps = target / cal.decode_s_per_token
    return (f"Every request states a TPOT target of **T = {1000 * target:.1f} ms**, {num(steps)}× the calibration's "
            f"one-row decode step ({1000 * cal.decode_s_per_token:.2f} ms): a row may decode at most "
            f"{num(steps)}× slower than alone. Why this T: it is the batch's own currency — a step of b rows takes "
            f"1 + {cal.batch_row_cost:g} × (b − 1) one-row steps, so T allows **{cfg.target_rows} rows** per actor "
            f"(slowdown({cfg.target_rows}) = {num(cal.slowdown(cfg.target_rows))}, slowdown({cfg.target_rows + 1}) "
            f"= {num(cal.slowdown(cfg.target_rows + 1))}), more than the fixed {cfg.max_batch} (whose full batch "
            f"runs {num(cal.slowdown(cfg.max_batch))}× slower than alone, within T) and fewer than the safety cap "
            f"of {cfg.zq_max_batch}: a target that binds, and a TPOT ({1 / target:.0f} tokens/s) a reader still "
            "takes for streaming speed.")


def _scorer_text(cfg: SimConfig, checks: Sequence[ScorerCheck]) -> str:
    cal = cfg.calibration
    text = ("**The scorer.** Both zero-queue runs decide with the rule scorer priced with the calibration "
            f"(benchmarks/sim_scorer.py): a {1000 * cal.decode_s_per_token:.2f} ms one-row step, + "
            f"{cal.batch_row_cost:g} of it per extra row, no KV-read term (the simulated step has none), prefill at "
            f"{prefill_tokens_per_s(cal):.0f} tokens/s (the hot-TTFT points' slope, first to last), an actor start of "
            f"{cal.spawn_to_start_s:.3f} s and the weights loaded in {cal.all_resident_s:.3f} s. So a join's "
            "predicted TPOT is the simulated one. What does not map: the rule adds load and prefill where the "
            "simulation overlaps them, and with a target it predicts a joiner's prompt fed in chunks where the "
            "simulation prefills it whole after one step — TTFT predictions only rank candidates here (the requests "
            "state no TTFT target), and the ranking is the same: an idle hot actor first, then the batch with the "
            f"fewest rows. The fixed run used the placeholder `RULE_SCORER` before (a "
            f"{1000 * RULE_SCORER.decode_s_per_token:.0f} ms step, + {RULE_SCORER.batch_row_cost:g} of it per row, "
            f"KV reads at {RULE_SCORER.kv_read_bytes_per_s / 1e9:.0f} GB/s); the same arrivals decided by it: ")
    parts = []
    for c in checks:
        parts.append(f"at load {c.load:.1f} ({c.process}, {c.num_arrivals} arrivals) the outcomes are "
                     f"{'identical' if c.is_identical else 'not identical'}: {pct(c.same_place)}% of the arrivals "
                     f"placed on the same slot (or refused by both), refused {pct(c.reject_default)}% with the "
                     f"placeholder against {pct(c.reject_calibrated)}% priced")
    text += "; ".join(parts) + "."
    if checks and not all(c.is_identical for c in checks):
        # What one more row costs the placeholder's step, in KV positions of this model read per step.
        kv_s = cal.model_numbers().kv_bytes_per_token / RULE_SCORER.kv_read_bytes_per_s
        per_row = RULE_SCORER.decode_s_per_token * RULE_SCORER.batch_row_cost / kv_s
        text += (f" The placeholder ranks joins by rows and KV positions together (one row weighs as much as "
                 f"{per_row:,.0f} positions of this model), the priced rule by rows alone (the candidates come "
                 "ordered by rows, then positions): the two differ in which batch a request joins, and one request placed "
                 "elsewhere moves every later placement, so the share on the same slot says little")
        gap = max(abs(c.reject_default - c.reject_calibrated) for c in checks)
        text += (f"; what is refused differs by at most {num(100 * gap)} points." if gap < 0.001 else
                 f"; what is refused differs by up to {num(100 * gap)} points.")
    return text


def _headline(cfg: SimConfig, results: list[PointResult], process: str) -> str:
    loads = cfg.measured_target_loads
    top = loads[-1]
    one = min(loads, key=lambda x: abs(x - 1.0))
    target = cfg.tpot_target_s

    def m(system: str, load: float) -> PointResult:
        p = _at(results, process, load, system)
        assert p is not None, (process, load, system)
        return p

    parts = []
    for load in dict.fromkeys((one, top)):
        f, b, q = m(ZQ, load), m(ZQ_BY_PREDICTION, load), m(BOUNDED, load)
        parts.append(
            f"at load {load:.1f} zero-queue by prediction refuses {pct(_all(b).reject_rate)}% (its floor "
            f"{pct(cfg.erlang_target_floor(load))}%) against {pct(_all(f).reject_rate)}% with {cfg.max_batch} fixed "
            f"places (floor {pct(cfg.erlang_floor(load))}%) and {pct(_all(q).reject_rate)}% for the bounded FIFO; "
            f"it runs {num(b.rows_per_busy_actor)} rows per busy actor against {num(f.rows_per_busy_actor)}; TTFT "
            f"P99 {num(_all(b).ttft_s[1])} s against {num(_all(f).ttft_s[1])} s; goodput "
            f"{ratio(_all(b).goodput_per_s, _all(f).goodput_per_s)} the fixed run's; TPOT P99 "
            f"{num(_all(b).tpot_s[1] / target)}× the target against {num(_all(f).tpot_s[1] / target)}×, "
            f"{pct(_all(b).tpot_over_target)}% of its requests over it")
    caveat = " (both floors are Poisson references)" if process == "bursty" else ""
    return f"**{process}**{caveat}: " + "; ".join(parts) + "."


def target_section(cfg: SimConfig, results: list[PointResult], costs: Sequence[DecisionCost],
                   checks: Sequence[ScorerCheck]) -> list[str]:
    if cfg.tpot_target_s is None or not cfg.measured_target_loads:
        return []
    loads = cfg.measured_target_loads
    which = "every load of the sweep" if loads == cfg.loads else "loads " + ", ".join(f"{x:.1f}" for x in loads)
    lines = [
        TARGET_SECTION, "",
        _why_target(cfg), "",
        f"Zero-queue runs a second time on the same arrivals ({which}), every request stating T, with "
        f"`PolicyConfig.max_batch` = {cfg.zq_max_batch} as a safety cap only: `decide` admits a join only where the "
        "scorer predicts the batch's step with the newcomer in it within the newcomer's target and every running "
        f"row's (`RowView.tpot_target_s`). The fixed run and the queued baselines keep {cfg.max_batch} rows (their "
        "requests are held against T here, not admitted by it). Capacity, loads and the first Erlang-B floor are "
        f"the fixed run's ({cfg.num_slots} × {cfg.max_batch} = {cfg.num_places} places); {TARGET_FLOOR_HEADER} = "
        f"B({cfg.num_slots} × {cfg.target_rows} = {cfg.num_slots * cfg.target_rows}, A), the same A: what admitting "
        "whenever one of the target's places is free refuses at the least. Rows per busy actor: the mean over the "
        "measured window of the rows an actor (or replica) runs while it runs any. TPOT per admitted request = "
        "(e2e − TTFT) ÷ (output tokens − 1). The comparison is of admission rules on one engine: a queue in front of "
        f"{cfg.target_rows}-row batches would gain the same capacity; the baselines here are the fixed run's.", "",
        _scorer_text(cfg, checks), "",
    ]
    if len(costs) > 1:
        c = costs[1]
        lines += [f"The two zero-queue backends with the target, over the first {c.num_arrivals} arrivals at load "
                  f"1.0: registry {c.registry_us:.0f} µs, incremental {c.incremental_us:.0f} µs per arrival, "
                  f"outcomes identical: **{'yes' if c.is_identical else 'NO'}**; {pct(c.join_rate)}% joined.", ""]
    lines += ["**Headline.** " + " ".join(_headline(cfg, results, p) for p in cfg.processes), ""]
    ours = [r for r in results if r.system == ZQ_BY_PREDICTION]
    worst = max(_all(r).tpot_over_target for r in ours)
    lines += [(f"No request admitted by prediction decoded slower than T, at any load ({pct(worst)}% over it at worst)"
               if worst == 0 else f"Up to {pct(worst)}% of the requests admitted by prediction decoded slower than T")
              + ": the scorer prices the simulated step exactly and a batch only slows by the rows it admits, so here "
              "the target holds by construction. On an engine the prefill chunks a joiner adds to the running rows' "
              "steps and long contexts' KV reads, which this model leaves out, are what could break it "
              "(the actors measure their steps against the rule: actors/step_cost.py, StepCheck).", ""]
    for process in cfg.processes:
        lines += [f"### Places by prediction, {process} arrivals", "", *_tables(cfg, results, process), ""]
    return lines
