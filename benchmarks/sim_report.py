"""Metrics, markdown tables and plots for the cluster simulator (benchmarks/simulate.py)."""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.sim_calibration import RequestClass, ServiceTimes, Workload, short_lane_probability
from benchmarks.sim_model import Outcome

if TYPE_CHECKING:
    from benchmarks.simulate import DecisionCost, PointResult, SimConfig

QUANTILES = (50.0, 99.0, 99.9)
SYSTEM_NAMES = ("zero-queue", "queued FIFO", "queued FIFO, bounded", "queued Serve default")


@dataclass(frozen=True)
class ClassMetrics:
    num_arrivals: int  # measured: arrived after the warm-up and before the horizon
    reject_rate: float
    cold_rate: float  # of the admitted: served by an actor spawned for them
    join_rate: float  # of the admitted: joined a batch that was already running
    ttft_s: tuple[float, float, float]  # P50, P99, P99.9 over the admitted
    e2e_s: tuple[float, float, float]
    slowdown_p99: float  # P99 of end to end / the request's own unloaded (hot) end to end
    throughput_per_s: float  # completions inside the measured window, per second
    goodput_per_s: float  # of those, the ones that met the SLO
    # The good completions' unloaded (hot, one-row) service time per second, over what the cluster
    # completes of it per second at capacity: the share of the cluster that did useful work in
    # time; unlike goodput it does not favour short requests.
    good_work_fraction: float

    @property
    def e2e_ratio(self) -> float:
        return self.e2e_s[1] / self.e2e_s[0] if self.e2e_s[0] > 0 else math.nan

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_s[1] / self.ttft_s[0] if self.ttft_s[0] > 0 else math.nan


def _quantiles(x: np.ndarray) -> tuple[float, float, float]:
    if len(x) == 0:
        return (math.nan,) * 3  # type: ignore[return-value]
    q = np.percentile(x, QUANTILES)
    return float(q[0]), float(q[1]), float(q[2])


def class_metrics(workload: Workload, service: ServiceTimes, outcome: Outcome, mix: tuple[RequestClass, ...],
                  slo_extra_s: float, work_capacity: float) -> dict[str, ClassMetrics]:
    """Per class and for "all". Latency and rejections: over the arrivals in the measured window;
    throughput and goodput: completions inside it (an unbounded queue finishes late, not more).
    `work_capacity`: seconds of hot one-row service the cluster completes per second at capacity."""
    start, end = workload.warmup_s, workload.horizon_s
    window = end - start
    arrived = (workload.arrival_s >= start) & (workload.arrival_s < end)
    admitted = ~outcome.is_rejected
    done_at = workload.arrival_s + outcome.e2e_s  # NaN when rejected
    with np.errstate(invalid="ignore"):
        ended_inside = admitted & (done_at >= start) & (done_at < end)
        good = ended_inside & (outcome.ttft_s - service.hot_ttft_s <= slo_extra_s)
    slowdown = outcome.e2e_s / service.hot_e2e_s
    out: dict[str, ClassMetrics] = {}
    for index, name in [*enumerate(c.name for c in mix), (-1, "all")]:
        of_class = np.ones_like(arrived) if index < 0 else workload.class_index == index
        sel, served = arrived & of_class, arrived & of_class & admitted
        n = int(sel.sum())
        out[name] = ClassMetrics(
            num_arrivals=n,
            reject_rate=float(outcome.is_rejected[sel].mean()) if n else math.nan,
            cold_rate=float(outcome.is_cold[served].mean()) if served.any() else math.nan,
            join_rate=float(outcome.is_joined[served].mean()) if served.any() else math.nan,
            ttft_s=_quantiles(outcome.ttft_s[served]),
            e2e_s=_quantiles(outcome.e2e_s[served]),
            slowdown_p99=_quantiles(slowdown[served])[1],
            throughput_per_s=float((ended_inside & of_class).sum()) / window,
            goodput_per_s=float((good & of_class).sum()) / window,
            good_work_fraction=float(service.hot_e2e_s[good & of_class].sum()) / (window * work_capacity),
        )
    return out


# ---------------------------------------------------------------- formatting


def _f(x: float, digits: int = 2) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{100 * x:.1f}"


def _get(results: list[PointResult], process: str, load: float, system: str) -> PointResult:
    return next(r for r in results if r.process == process and r.load == load and r.system == system)


def _ratio(a: float, b: float) -> str:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return "–"
    return "> 100×" if a / b > 100 else _f(a / b) + "×"  # beyond that it is a ratio to almost nothing


def _class_table(results: list[PointResult], process: str, loads: tuple[float, ...], systems: tuple[str, ...],
                 name: str) -> list[str]:
    lines = ["| load | system | arrivals | rejected % | cold % | joined % | TTFT P50 | P99 | P99.9 | e2e P50 | P99 "
             "| P99.9 | e2e P99/P50 | slowdown P99 | done/s | goodput/s |",
             "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for load in loads:
        for system in systems:
            m = _get(results, process, load, system).metrics[name]
            lines.append(f"| {load:.1f} | {system} | {m.num_arrivals} | {_pct(m.reject_rate)} | {_pct(m.cold_rate)} "
                         f"| {_pct(m.join_rate)} | {' | '.join(_f(x) for x in m.ttft_s)} "
                         f"| {' | '.join(_f(x, 1) for x in m.e2e_s)} | {_f(m.e2e_ratio)} | {_f(m.slowdown_p99)} "
                         f"| {_f(m.throughput_per_s, 1)} | {_f(m.goodput_per_s, 1)} |")
    return lines


def overload_floor(load: float) -> float:
    """No system can complete more than capacity: above it at least 1 - capacity/offered is refused
    (or, queued, never served in time)."""
    return max(0.0, 1.0 - 1.0 / load)


FLOOR_HEADER = "Erlang-B floor %"
FULL_BATCH_HEADER = "Erlang-B, full batches %"


def _refusal_table(results: list[PointResult], cfg: SimConfig, process: str) -> list[str]:
    zq, _, bounded, _ = SYSTEM_NAMES
    lines = [f"| load | offered/s | {FLOOR_HEADER} | {FULL_BATCH_HEADER} | rejected %: zq all | zq short | zq medium "
             "| zq long | bounded FIFO all | zq joined % |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for load in cfg.loads:
        z, b = (_get(results, process, load, x).metrics for x in (zq, bounded))
        lines.append(f"| {load:.1f} | {_f(load * cfg.capacity_per_s, 1)} | {_pct(cfg.erlang_floor(load))} "
                     f"| {_pct(cfg.erlang_full_batch(load))} | {_pct(z['all'].reject_rate)} | {_pct(z['short'].reject_rate)} "
                     f"| {_pct(z['medium'].reject_rate)} | {_pct(z['long'].reject_rate)} | {_pct(b['all'].reject_rate)} "
                     f"| {_pct(z['all'].join_rate)} |")
    return lines


def _headline_table(results: list[PointResult], process: str, loads: tuple[float, ...]) -> list[str]:
    zq, fifo, bounded, serve = SYSTEM_NAMES
    lines = ["| load | short TTFT P99 (s): zq | FIFO | bounded FIFO | Serve default | short e2e P99/P50: zq | FIFO "
             "| goodput/s: zq | FIFO | bounded FIFO | Serve default | zq ÷ FIFO | good work % of the cluster: zq "
             "| FIFO | bounded FIFO | Serve default |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for load in loads:
        z, f, b, s = (_get(results, process, load, x).metrics for x in (zq, fifo, bounded, serve))
        lines.append(f"| {load:.1f} | {' | '.join(_f(m['short'].ttft_s[1]) for m in (z, f, b, s))} "
                     f"| {_f(z['short'].e2e_ratio)} | {_f(f['short'].e2e_ratio)} "
                     f"| {' | '.join(_f(m['all'].goodput_per_s, 1) for m in (z, f, b, s))} "
                     f"| {_ratio(z['all'].goodput_per_s, f['all'].goodput_per_s)} "
                     f"| {' | '.join(_pct(m['all'].good_work_fraction) for m in (z, f, b, s))} |")
    return lines


def plot(results: list[PointResult], cfg: SimConfig, process: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(SYSTEM_NAMES, ("tab:blue", "tab:red", "tab:purple", "tab:orange"), strict=True))
    styles = {"short": "-", "medium": "--", "long": ":"}
    loads = list(cfg.loads)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for system, color in colors.items():
        rows = [_get(results, process, load, system).metrics for load in loads]
        for c in cfg.mix:
            axes[0, 0].plot(loads, [m[c.name].e2e_s[1] for m in rows], styles[c.name], color=color, marker=".",
                            label=f"{system}, {c.name}")
            axes[0, 1].plot(loads, [m[c.name].ttft_s[1] for m in rows], styles[c.name], color=color, marker=".")
        axes[1, 0].plot(loads, [100 * m["all"].reject_rate for m in rows], "-", color=color, marker=".", label=system)
        axes[1, 0].plot(loads, [100 * m["long"].reject_rate for m in rows], ":", color=color)
        axes[1, 1].plot(loads, [m["all"].goodput_per_s for m in rows], "-", color=color, marker=".", label=system)
    # Drawn over the measured curves: zero-queue's can lie right on them.
    axes[1, 0].plot(loads, [100 * cfg.erlang_floor(x) for x in loads], "--", color="black", lw=1.0, zorder=5,
                    label="Erlang-B floor")
    axes[1, 0].plot(loads, [100 * cfg.erlang_full_batch(x) for x in loads], "--", color="grey", lw=1.2, zorder=5,
                    label="Erlang-B, full batches")
    axes[1, 1].plot(loads, [cfg.capacity_per_s * x for x in loads], color="grey", lw=0.8, label="offered")
    axes[1, 1].axhline(cfg.capacity_per_s, color="grey", ls="--", lw=0.8, label="capacity")
    titles = ("P99 end-to-end latency (s), per class", "P99 TTFT (s), per class",
              "rejected % (solid: all, dotted: long)", f"goodput (req/s within the SLO: TTFT ≤ hot + "
              f"{cfg.calibration.slo_extra_s:g} s)")
    for ax, title in zip(axes.flat, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("offered load (× capacity)")
        ax.grid(alpha=0.3)
    axes[0, 0].set_yscale("log")
    axes[0, 1].set_yscale("log")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(colors), fontsize=7.5, frameon=False)
    axes[1, 0].legend(fontsize=8)
    axes[1, 1].legend(fontsize=8)
    fig.suptitle(f"{cfg.num_slots} slots × {cfg.max_batch} rows, {process} arrivals, mixed-length mix, calibration "
                 f"{cfg.calibration.name} (the rejection rate sits beside every tail)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- the report


def _serve_words(cfg: SimConfig) -> str:
    if cfg.serve_max_ongoing is None:
        return ("Ray Serve's routing with Ray Serve LLM's default `max_ongoing_requests` (no limit): every request "
                "goes to a replica at once and waits in that replica's own queue")
    return f"Ray Serve's routing with `max_ongoing_requests={cfg.serve_max_ongoing}` per replica"


def write_report(path: Path, cfg: SimConfig, results: list[PointResult], cost: DecisionCost,
                 floor: dict[str, ClassMetrics], wall_s: float, command: str) -> None:
    from benchmarks.sim_report_text import goals_text, model_text, not_modelled_text

    path.parent.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for process in cfg.processes:
        png = path.with_name(f"{path.stem}_{process}.png")
        plot(results, cfg, process, png)
        pngs[process] = png.name
    cal, loads = cfg.calibration, cfg.loads
    load_avg = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        "# Cluster simulation: zero-queue against a queued cluster", "",
        f"Command: `{command}`. Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{wall_s / 60:.1f} minutes of wall time on one core ({os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load average at the end {load_avg}, the simulation's own core included: "
        "other work on the machine changes the run time and nothing else — simulated time does not depend on it).",
        "",
        *model_text(cfg, floor, short_lane_probability), "",
        "## Calibration", "",
        f"Preset `{cal.name}`: {cal.description}.", "",
        "| figure | value | source |", "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in cal.sources],
        f"| derived: tail after load and prefill | {cal.cold_tail_s:.3f} s | cold first token − max(all resident, "
        "layer 0 + hot TTFT) at the reference prompt |",
        f"| derived: cold start over hot, 16 / 640 / 3072-token prompt | "
        f"{' / '.join(_f(float(cal.cold_ttft_s(n) - cal.hot_ttft_s(n))) for n in (16, 640, 3072))} s | "
        "the model above |", "",
    ]
    if cal.cold_checks:
        lines += ["Check of the cold-start model against the other measured prompts (seconds from actor start to "
                  "the first token, streamed, derived N, page cache):", "",
                  "| prompt tokens | modelled | measured | modelled − measured |", "|--:|--:|--:|--:|"]
        for tokens, measured in ((cal.cold_reference_tokens, cal.cold_first_token_s), *cal.cold_checks):
            modelled = float(cal.cold_from_start_s(tokens))
            lines.append(f"| {tokens} | {modelled:.3f} | {measured:.3f} | {modelled - measured:+.3f} |")
        tokens, measured = cal.cold_checks[-1]
        gap = measured - float(cal.cold_from_start_s(tokens))
        lines += ["", f"The {cal.cold_reference_tokens}-token row is the reference the tail is fitted to. Where the "
                  "prompt's prefill outlasts the load the model is optimistic: on the 2-core VM decompression and "
                  "prefill shared the cores and the memory bus, and the measured cold prefill ran slower than hot "
                  "(cold_start.md, 'Goals'); the model does not charge that. It misses by "
                  f"{gap:.2f} s at {tokens} tokens, and by more for the long class's "
                  f"{cfg.mix[-1].input_tokens[0]}–{cfg.mix[-1].input_tokens[1]}-token prompts: this flatters "
                  "zero-queue's cold starts" + (" (there are none in this sweep: every slot holds a hot actor)"
                                                if cfg.hot_fraction >= 1 else "")
                  + ". A GPU slot would not have that contention.", ""]
    lines += [*goals_text(cfg, results, floor), ""]
    for process in cfg.processes:
        lines += [f"## Summary, {process} arrivals", "",
                  f"Refusals. {FLOOR_HEADER} = B(c, A) with c = {cfg.num_slots} slots × {cfg.max_batch} rows = "
                  f"{cfg.num_places} requests running at once and A = offered/s × {cfg.mean_service_s:.2f} s (the "
                  "mean hot service time alone on an actor): what a system without a queue that admits whenever a "
                  "place is free must refuse of Poisson arrivals even if every request ran as fast as alone. "
                  f"{FULL_BATCH_HEADER} = the same with every request held as long as in a full batch "
                  f"(A = offered/s × {cfg.num_places / cfg.capacity_per_s:.2f} s = load × c): a reference, not a "
                  "floor, since rows of batches that are not full run faster"
                  + ("; bursty arrivals are refused more than Poisson ones of the same mean, so for them both are "
                     "Poisson references" if process == "bursty" else "")
                  + ". zq = zero-queue; joined % = admitted requests that became a row of a batch already "
                  "running.", "",
                  *_refusal_table(results, cfg, process), "",
                  "Latency and goodput. FIFO = queued FIFO (a central queue, a request sent to a replica only "
                  f"when it has a free row, unbounded); bounded FIFO = the same holding at most {cfg.bounded_queue}; "
                  f"Serve default = {_serve_words(cfg)}. Good work = the good completions' unloaded service time "
                  "÷ (window × what the cluster completes of it per second at capacity); requests that began before "
                  "the window and ended in it can push it a little past 100.", "",
                  *_headline_table(results, process, loads), "",
                  f"![{process}]({pngs[process]})", ""]
    systems = tuple(dict.fromkeys(r.system for r in results))
    for process in cfg.processes:
        for c in cfg.mix:
            lines += [f"### {process} arrivals, {c.name} requests", "",
                      "Seconds; rejected % beside every tail (a tail over fewer admitted requests looks better "
                      "than it is); cold % = admitted requests served by an actor spawned for them; joined % = "
                      "admitted requests that became a row of a batch already running.", "",
                      *_class_table(results, process, loads, systems, c.name), ""]
    lines += [
        "## Cost of a decision", "",
        f"Over the first {cost.num_arrivals} arrivals at load 1.0 (Poisson), per arrival (decision, commit and the "
        f"request's end): the real `RegistryState.admit` on the full {cfg.num_slots}-slot snapshot "
        f"**{cost.registry_us:.0f} µs**; the incremental books with the restricted snapshot "
        f"**{cost.incremental_us:.0f} µs**; outcomes identical: **{'yes' if cost.is_identical else 'NO'}**. "
        "The sweep uses the incremental backend; sim_clusters.py's docstring argues why its decisions are the "
        "registry's, and tests/unit/test_simulate.py checks it request by request (including a scorer that "
        f"reads every candidate field). {_pct(cost.join_rate)}% of these admissions joined a running batch. Most of "
        "the remaining cost is `decide()` itself: up to 8 hot, 8 join and 8 cold candidates built and scored per "
        "request.", "",
        *not_modelled_text(cfg), "",
    ]
    path.write_text("\n".join(lines))
