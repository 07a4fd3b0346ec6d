"""The load benchmark's report: `benchmarks/results/load.md`, its plots, and the goals judged from one run."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.load_apps import APPS, BASELINE, ZEROQUEUE
from benchmarks.load_scenarios import CLASSES
from benchmarks.load_stats import Record, Slo, Summary, by_class, ratio
from benchmarks.machine_load import was_busy

GOAL_SPREAD = 1.15  # short requests' P99/P50 under the mixed load (the seed reports 1.05–1.15)
GOAL_P99_FRACTION = 0.2  # zeroqueue's short P99 at most this fraction of the baseline's
GOAL_GOODPUT = 1.5  # zeroqueue's goodput at 2× overload at least this multiple of the baseline's


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    figures: str
    met: bool | None  # None: not measured in this run
    note: str
    caveat: str = ""  # said beside the verdict: e.g. a tail that looks good because requests were refused


def records_of(run: dict[str, Any], app: str) -> list[Record]:
    return [Record(**r) for r in run["records"] if r["app"] == app]


def summaries(data: dict[str, Any]) -> dict[str, dict[str, dict[str, Summary]]]:
    """scenario -> app -> class (and `all`) -> Summary, for the apps that ran it."""
    slo = Slo(**data["plan"]["slo"])
    service = {c: v["service_s"] for c, v in data["calibration"].items()}
    out: dict[str, dict[str, dict[str, Summary]]] = {}
    for name, run in data["runs"].items():
        window = sum(p["duration_s"] for p in run["scenario"]["phases"])
        per_app = {app: by_class(records_of(run, app), list(CLASSES), window, slo, service)
                   for app in APPS if records_of(run, app)}
        if per_app:
            out[name] = per_app
    return out


def _f(x: float, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:.1f}%"


def goals(data: dict[str, Any], s: dict[str, dict[str, dict[str, Summary]]]) -> list[Goal]:
    bound = data["plan"]["reject_bound_s"]
    out = []
    for name, label in (("mixed", ""), ("mixed-slo", ", the client stating its TTFT SLO")):
        out.extend(_tail_goals(s.get(name, {}), label))
    burst = s.get("burst", {})
    if ZEROQUEUE in burst:
        spike = data["runs"]["burst"]["scenario"]["spike"]
        recs = [r for r in records_of(data["runs"]["burst"], ZEROQUEUE) if r.rejected]
        in_spike = [r for r in recs if spike and spike[0] <= r.t_sched < spike[1]]
        worst = max((r.e2e for r in recs), default=math.nan)
        over = sum(r.e2e > bound for r in recs)
        base_all = burst.get(BASELINE, {}).get("all")
        base_note = "" if base_all is None else (
            f"; the baseline refused {base_all.rejected} (its queue has no bound) and {base_all.offered - base_all.completed - base_all.rejected}"
            f" of its {base_all.offered} requests failed or were abandoned after {data['plan']['timeout_s']:g} s")
        out.append(Goal(
            "3a. every refusal answered within a fixed bound, at 10× overload",
            f"every 503 within {bound:g} s",
            f"{len(recs)} refusals in the burst ({len(in_spike)} in the spike), slowest {_f(worst)} s, "
            f"{over} over the bound{base_note}",
            None if not recs else over == 0,
            "" if over == 0 else f"{over} of {len(recs)} refusals slower than {bound:g} s"))
    overload = s.get("overload", {})
    if ZEROQUEUE in overload and BASELINE in overload:
        zq, base = overload[ZEROQUEUE]["all"], overload[BASELINE]["all"]
        g = ratio(zq.goodput_rps, base.goodput_rps)
        out.append(Goal(
            "3b. goodput at 2× overload", f"≥ {GOAL_GOODPUT} × the baseline's",
            f"zeroqueue {_f(zq.goodput_rps, 2)} good req/s ({zq.good} of {zq.offered}), baseline "
            f"{_f(base.goodput_rps, 2)} ({base.good} of {base.offered}): {_f(g, 2)}×",
            None if math.isnan(g) else g >= GOAL_GOODPUT,
            "" if math.isnan(g) or g >= GOAL_GOODPUT else
            f"missed by {_f(GOAL_GOODPUT / g, 2)}×; zeroqueue refused {_pct(zq.rejection_rate)}, completed "
            f"{zq.completed}, of which {zq.good} within the SLO"))
    return out


def _tail_goals(mixed: dict[str, dict[str, Summary]], label: str) -> list[Goal]:
    """Goals 1 and 2, on one mixed-lengths scenario's short requests."""
    out: list[Goal] = []
    if ZEROQUEUE in mixed and BASELINE in mixed and "short" in mixed[ZEROQUEUE]:
        zq, base = mixed[ZEROQUEUE]["short"], mixed[BASELINE]["short"]
        spread = zq.e2e.spread
        out.append(Goal(
            f"1. short requests' P99/P50 under the mixed load{label}", f"≤ {GOAL_SPREAD} for zeroqueue",
            f"zeroqueue {_f(spread, 2)} (P50 {_f(zq.e2e.p50)} s, P99 {_f(zq.e2e.p99)} s, {zq.completed} done, "
            f"{_pct(zq.rejection_rate)} refused); baseline {_f(base.e2e.spread, 2)} (P50 {_f(base.e2e.p50)} s, "
            f"P99 {_f(base.e2e.p99)} s, {_pct(base.rejection_rate)} refused)",
            None if math.isnan(spread) else spread <= GOAL_SPREAD,
            _why_spread(zq, spread), _refused(zq)))
        frac = ratio(zq.e2e.p99, base.e2e.p99)
        out.append(Goal(
            f"2. short requests' P99, zeroqueue against the baseline, same offered load{label}",
            f"≤ {GOAL_P99_FRACTION} × the baseline's (the seed: 9.3× lower P99, 13.5× lower P99.9)",
            f"P99 {_f(zq.e2e.p99)} s vs {_f(base.e2e.p99)} s: {_f(frac, 2)} × (baseline/zeroqueue "
            f"{_f(ratio(base.e2e.p99, zq.e2e.p99), 1)}×); P99.9 {_f(ratio(base.e2e.p999, zq.e2e.p999), 1)}× lower; "
            f"zeroqueue refused {_pct(zq.rejection_rate)} of short requests, the baseline {_pct(base.rejection_rate)}",
            None if math.isnan(frac) else frac <= GOAL_P99_FRACTION,
            "" if math.isnan(frac) or frac <= GOAL_P99_FRACTION else
            f"missed by {_f(frac / GOAL_P99_FRACTION, 1)}×: " + _why_spread(zq, zq.e2e.spread), _refused(zq)))
    return out


def _refused(x: Summary) -> str:
    if not x.rejected and not x.offered - x.completed:
        return ""
    failed = f", {_pct(x.failure_rate)} failed" if x.offered - x.completed - x.rejected else ""
    return (f"a tail of the {x.completed} of {x.offered} requests zeroqueue completed: it refused "
            f"{_pct(x.rejection_rate)}{failed}")


def _why_spread(zq: Summary, spread: float) -> str:
    if math.isnan(spread) or spread <= GOAL_SPREAD:
        return ""
    return (f"{zq.cold} of zeroqueue's {zq.completed} completed short requests started on a fresh actor (the "
            f"hot one was busy): a Ray worker process start and a weight load before compute. Arrival to compute "
            f"start: P50 {_f(zq.wait.p50)} s, P99 {_f(zq.wait.p99)} s; arrival to the ingress's decision: P50 "
            f"{_f(zq.dispatch.p50)} s, P99 {_f(zq.dispatch.p99)} s")


def _scenario_table(per_app: dict[str, dict[str, Summary]]) -> list[str]:
    rows = [(cls, app, per_app[app][cls]) for cls in [*CLASSES, "all"] for app in APPS
            if cls in per_app.get(app, {})]
    lines = [
        "| class | app | offered | done | refused (503) | other failures | throughput req/s | goodput req/s | "
        "started cold |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for cls, app, x in rows:
        lines.append(
            f"| {cls} | {app} | {x.offered} | {x.completed} | {x.rejected} ({_pct(x.rejection_rate)}) | "
            f"{x.offered - x.completed - x.rejected} ({_pct(x.failure_rate)}) | {_f(x.throughput_rps, 2)} | "
            f"{_f(x.goodput_rps, 2)} | {x.cold if app == ZEROQUEUE else '–'} |")
    lines += [
        "",
        "| class | app | TTFT P50 / P99 / P99.9 s | e2e P50 / P99 / P99.9 s | e2e P99/P50 | TPOT P50 ms | "
        "wait P50 / P99 s | dispatch P50 / P99 s | refused in (503) |",
        "|---|---|---|---|--:|--:|---|---|---|",
    ]
    for cls, app, x in rows:
        refused = f"P99 {_f(x.reject_answer.p99)} s, max {_f(x.reject_answer_max)} s" if x.rejected else "–"
        lines.append(
            f"| {cls} | {app} | {_f(x.ttft.p50)} / {_f(x.ttft.p99)} / {_f(x.ttft.p999)} | {_f(x.e2e.p50)} / "
            f"{_f(x.e2e.p99)} / {_f(x.e2e.p999)} | {_f(x.e2e.spread, 2)} | {_f(1000 * x.tpot.p50, 1)} | "
            f"{_f(x.wait.p50)} / {_f(x.wait.p99)} | {_f(x.dispatch.p50)} / {_f(x.dispatch.p99)} | {refused} |")
    lines.append("")
    for app in APPS:
        x = per_app.get(app, {}).get("all")
        if x is not None and x.failures:
            lines.append(f"- {app}, not completed, by status: " + ", ".join(f"{k}: {v}" for k, v in x.failures.items()))
    return lines


def write_report(data: dict[str, Any], out: Path) -> str:
    """Write the markdown report and its plots next to it; returns the goals' summary."""
    from benchmarks.load_plots import plot_burst, plot_cdfs

    s = summaries(data)
    gs = goals(data, s)
    cdf_png = out.with_name(f"{out.stem}_cdf.png")
    burst_png = out.with_name(f"{out.stem}_burst.png")
    plot_cdfs(data, cdf_png)
    if "burst" in data["runs"] and data["runs"]["burst"]["records"]:
        plot_burst(data, burst_png)
    out.write_text("\n".join(_document(data, s, gs, cdf_png, burst_png)) + "\n")
    return "\n".join(f"{g.name}: {'not measured' if g.met is None else 'met' if g.met else 'MISSED'}"
                     f"{' (' + g.caveat + ')' if g.caveat else ''} — {g.figures}" for g in gs)


def _policy(data: dict[str, Any]) -> str:
    policy = data["app_args"].get("policy", {})
    return ", ".join(f"`{k}: {v}`" for k, v in policy.items()) or "defaults"


def _document(data, s, gs, cdf_png: Path, burst_png: Path) -> list[str]:
    m, model, plan = data["machine"], data["model"], data["plan"]
    slo = Slo(**plan["slo"])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(data["started"]))
    busy = was_busy(m["loadavg_start"][0])
    lines = ["# Live load: zeroqueue against the queued Ray Serve baseline", ""]
    if data["quick"]:
        lines += ["**QUICK RUN** (`--quick`): short scenarios to check the harness; too few requests for "
                  "tail figures to mean much.", ""]
    lines += [f"Command: `{data['command']}`", "",
              f"Run {started}, {data['elapsed_s'] / 60:.1f} minutes in all.", "", "## Machine and setup", "",
              f"- {m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB RAM; Python {m['python']}, torch {m['torch']}, "
              f"Ray {m['ray']}, locust {m['locust']}",
              f"- load average (1/5/15 min): {' / '.join(f'{x:.2f}' for x in m['loadavg_start'])} at the start, "
              f"{' / '.join(f'{x:.2f}' for x in m['loadavg_end'])} at the end"
              + (". **Other jobs were using this machine**: every figure is noisier" if busy else ""),
              f"- model: `{model['id']}`, the `{model['preset']}` shape with random weights, {model['params_m']:.1f} M "
              f"parameters, {model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads "
              f"({model['kv_heads']} KV), vocab {model['vocab']}, {model['dtype']}; `.zqs` {model['file_mb']:.0f} MB",
              f"- both apps built from the same args (`{plan['config_path']}`): {data['slots']} CPU slots, one torch "
              "thread per request, the same loader, `Engine`, dtype and process priority",
              f"- **zeroqueue**: `serve_app.app:build_app` as configured (policy {_policy(data)}): an idle hot "
              "actor if one fits, else a fresh actor on a free slot (a Ray worker process start and a weight "
              "load before compute: *started cold*), else 503 at once",
              "- **baseline** (`benchmarks/baseline/`): one long-lived replica per slot directly behind Serve's "
              "proxy, `max_ongoing_requests=1`, `max_queued_requests=-1` (unbounded): Serve's own queue, with its "
              "default router (power of two choices; a queued request re-polls with backoff from 25 ms to 0.5 s)",
              f"- client: locust as a library, one user replaying an open-loop Poisson schedule (same arrivals, "
              f"prompts and seeds for both apps), streaming (SSE) on loopback; a request not done in "
              f"{plan['timeout_s']:g} s is abandoned (its connection closed, so the server cancels it) and counted "
              f"as `timeout`; at most {plan['max_in_flight']} in flight",
              f"- SLO for goodput: {slo.describe()}",
              "- percentiles are over completed requests; refusals and failures are counted beside them. "
              "P99.9 of fewer than 1000 requests is interpolated near the maximum; read it as such. "
              "`wait` is arrival to compute start as the server stamps it (`X-Request-Start-Time`): Serve's queue "
              "for the baseline, dispatch and any cold start for zeroqueue; `dispatch` is arrival to zeroqueue's "
              "decision acted on (`X-Request-Dispatch-Time`): Serve's proxy, the ingress and the registry",
              "", "## Calibration and offered load", "",
              "Hot service time: the in-process `Engine`, before Ray starts, one torch thread (median of "
              f"{plan['calibration_repeats']} after a warm-up). Capacity = slots / mean service time of the mix. It "
              "is an upper bound: under load both slots compute at once beside Serve's proxy, the ingress and the "
              "client on the same cores, so the machine delivers less and a nominal 0.9× can already overload it. "
              "Both apps are offered the same nominal loads.", "",
              "| class | prompt tokens | output tokens | hot service s | SLO e2e s | zeroqueue lane |",
              "|---|--:|--:|--:|--:|---|"]
    for c, v in data["calibration"].items():
        lines.append(f"| {c} | {v['input_tokens']} | {v['output_tokens']} | {v['service_s']:.3f} | "
                     f"{slo.e2e_s(v['service_s']):.2f} | {data['lanes'][c]} |")
    lines += ["", "| scenario | mix | load (× capacity) | capacity req/s | requests | client lag P99 / max ms |",
              "|---|---|---|--:|--:|---|"]
    for name, run in data["runs"].items():
        sc = run["scenario"]
        mix = ", ".join(f"{int(100 * w)}% {c}" for c, w in sc["mix"])
        phases = ", then ".join(
            (f"{p['start_load']:g}×" if p["start_load"] == p["end_load"] else f"{p['start_load']:g}→{p['end_load']:g}×")
            + f" {p['duration_s']:g} s" for p in sc["phases"])
        lags = sorted(r["lag"] for r in run["records"])
        lag = f"{1000 * lags[int(0.99 * (len(lags) - 1))]:.0f} / {1000 * lags[-1]:.0f}" if lags else "–"
        lines.append(f"| {name} | {mix} | {phases} | {run['capacity_rps']:.2f} | {run['arrivals']} | {lag} |")
    lines += ["", "## Goals (ratios from this run)", "", "| goal | target | this run | verdict |", "|---|---|---|---|"]
    for g in gs:
        verdict = "not measured" if g.met is None else "met" if g.met else "**missed**"
        if g.caveat:
            verdict += f" — {g.caveat}"
        lines.append(f"| {g.name} | {g.target} | {g.figures} | {verdict} |")
    notes = [f"- {g.name.split('.')[0]}: {g.note}" for g in gs if g.note]
    lines += ["", *notes] if notes else []
    for name, run in data["runs"].items():
        lines += ["", f"## {run['scenario']['title']}", ""]
        if run["scenario"]["lossy"] and data.get("netem_error"):
            lines += [f"**Not run: this machine cannot build the lossy link.** {data['netem_error']}", ""]
            continue
        if name not in s:
            lines += ["No records.", ""]
            continue
        if run["scenario"]["lossy"]:
            imp = plan["impairment"]
            lines += [f"Client in a network namespace of its own, through a veth pair with {imp['loss_pct']:g}% loss "
                      f"and {imp['delay_ms']:g} ± {imp['jitter_ms']:g} ms delay each way (tc netem), then a TCP relay "
                      "to Serve on loopback.", ""]
        lines += _scenario_table(s[name])
        if name == "burst" and burst_png.exists():
            lines += ["", f"![latency and refusals through the burst]({burst_png.name})"]
    lines += ["", "## Latency distributions", "",
              "Fraction of *offered* requests completed within x seconds (so a curve that tops out below 1 is "
              "the share refused, failed or abandoned); solid: end to end, dashed: time to first token.", "",
              f"![latency CDFs per app and class]({cdf_png.name})"]
    return lines

