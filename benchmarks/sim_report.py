"""Markdown tables, plots and the report of the cluster simulator (benchmarks/simulate.py).

The metrics come from `benchmarks.sim_results`, the prose from `benchmarks.sim_report_text`.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import cores, load_text, python_version
from benchmarks.sim_calibration import short_lane_probability
from benchmarks.sim_config import SimConfig
from benchmarks.sim_format import num, pct, ratio
from benchmarks.sim_report_target import target_section
from benchmarks.sim_report_text import goals_text, model_text, not_modelled_text, serve_words
from benchmarks.sim_results import (
    SYSTEM_NAMES,
    ZQ_BY_PREDICTION,
    ClassMetrics,
    DecisionCost,
    PointResult,
    ScorerCheck,
    point,
)


def _class_table(results: list[PointResult], process: str, loads: tuple[float, ...], systems: tuple[str, ...],
                 name: str) -> list[str]:
    lines = ["| load | system | arrivals | rejected % | cold % | joined % | TTFT P50 | P99 | P99.9 | e2e P50 | P99 "
             "| P99.9 | e2e P99/P50 | slowdown P99 | done/s | goodput/s |",
             "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for load in loads:
        for system in systems:
            found = [r for r in results if r.process == process and r.load == load and r.system == system]
            if not found:  # places by prediction may run fewer loads
                continue
            m = found[0].metrics[name]
            lines.append(f"| {load:.1f} | {system} | {m.num_arrivals} | {pct(m.reject_rate)} | {pct(m.cold_rate)} "
                         f"| {pct(m.join_rate)} | {' | '.join(num(x) for x in m.ttft_s)} "
                         f"| {' | '.join(num(x, 1) for x in m.e2e_s)} | {num(m.e2e_ratio)} | {num(m.slowdown_p99)} "
                         f"| {num(m.throughput_per_s, 1)} | {num(m.goodput_per_s, 1)} |")
    return lines


FLOOR_HEADER = "Erlang-B floor %"
FULL_BATCH_HEADER = "Erlang-B, full batches %"


def _refusal_table(results: list[PointResult], cfg: SimConfig, process: str) -> list[str]:
    zq, _, bounded, _ = SYSTEM_NAMES
    lines = [f"| load | offered/s | {FLOOR_HEADER} | {FULL_BATCH_HEADER} | rejected %: zq all | zq short | zq medium "
             "| zq long | bounded FIFO all | zq joined % |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for load in cfg.loads:
        z, b = (point(results, process, load, x).metrics for x in (zq, bounded))
        lines.append(f"| {load:.1f} | {num(load * cfg.capacity_per_s, 1)} | {pct(cfg.erlang_floor(load))} "
                     f"| {pct(cfg.erlang_full_batch(load))} | {pct(z['all'].reject_rate)} | {pct(z['short'].reject_rate)} "
                     f"| {pct(z['medium'].reject_rate)} | {pct(z['long'].reject_rate)} | {pct(b['all'].reject_rate)} "
                     f"| {pct(z['all'].join_rate)} |")
    return lines


def _headline_table(results: list[PointResult], process: str, loads: tuple[float, ...]) -> list[str]:
    zq, fifo, bounded, serve = SYSTEM_NAMES
    lines = ["| load | short TTFT P99 (s): zq | FIFO | bounded FIFO | Serve default | short e2e P99/P50: zq | FIFO "
             "| goodput/s: zq | FIFO | bounded FIFO | Serve default | zq ÷ FIFO | good work % of the cluster: zq "
             "| FIFO | bounded FIFO | Serve default |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for load in loads:
        z, f, b, s = (point(results, process, load, x).metrics for x in (zq, fifo, bounded, serve))
        lines.append(f"| {load:.1f} | {' | '.join(num(m['short'].ttft_s[1]) for m in (z, f, b, s))} "
                     f"| {num(z['short'].e2e_ratio)} | {num(f['short'].e2e_ratio)} "
                     f"| {' | '.join(num(m['all'].goodput_per_s, 1) for m in (z, f, b, s))} "
                     f"| {ratio(z['all'].goodput_per_s, f['all'].goodput_per_s)} "
                     f"| {' | '.join(pct(m['all'].good_work_fraction) for m in (z, f, b, s))} |")
    return lines


def plot(results: list[PointResult], cfg: SimConfig, process: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip((*SYSTEM_NAMES, ZQ_BY_PREDICTION), ("tab:blue", "tab:red", "tab:purple", "tab:orange",
                                                          "tab:green"), strict=True))
    styles = {"short": "-", "medium": "--", "long": ":"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for system, color in colors.items():
        # Places by prediction may run fewer loads, or none.
        loads = [x for x in cfg.loads if any(r.process == process and r.load == x and r.system == system
                                             for r in results)]
        rows = [point(results, process, load, system).metrics for load in loads]
        for c in cfg.mix:
            axes[0, 0].plot(loads, [m[c.name].e2e_s[1] for m in rows], styles[c.name], color=color, marker=".",
                            label=f"{system}, {c.name}")
            axes[0, 1].plot(loads, [m[c.name].ttft_s[1] for m in rows], styles[c.name], color=color, marker=".")
        axes[1, 0].plot(loads, [100 * m["all"].reject_rate for m in rows], "-", color=color, marker=".", label=system)
        axes[1, 0].plot(loads, [100 * m["long"].reject_rate for m in rows], ":", color=color)
        axes[1, 1].plot(loads, [m["all"].goodput_per_s for m in rows], "-", color=color, marker=".", label=system)
    loads = list(cfg.loads)
    # Drawn over the measured curves: zero-queue's can lie right on them.
    axes[1, 0].plot(loads, [100 * cfg.erlang_floor(x) for x in loads], "--", color="black", lw=1.0, zorder=5,
                    label="Erlang-B floor")
    axes[1, 0].plot(loads, [100 * cfg.erlang_full_batch(x) for x in loads], "--", color="grey", lw=1.2, zorder=5,
                    label="Erlang-B, full batches")
    if cfg.measured_target_loads:
        axes[1, 0].plot(loads, [100 * cfg.erlang_target_floor(x) for x in loads], ":", color="black", lw=1.0,
                        zorder=5, label="Erlang-B floor, the target's places")
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


def write_report(path: Path, cfg: SimConfig, results: list[PointResult], costs: list[DecisionCost],
                 checks: list[ScorerCheck], floor: dict[str, ClassMetrics], wall_s: float, command: str) -> None:
    """`costs`: the decision cost of the fixed run, then of places by prediction where it ran; `checks`: the fixed
    run decided by the placeholder rule scorer against the calibrated one."""
    cost = costs[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for process in cfg.processes:
        png = path.with_name(f"{path.stem}_{process}.png")
        plot(results, cfg, process, png)
        pngs[process] = png.name
    cal, loads = cfg.calibration, cfg.loads
    load_avg = load_text()
    lines = [
        "# Cluster simulation: zero-queue against a queued cluster", "",
        f"Command: `{command}`. Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{wall_s / 60:.1f} minutes of wall time on one core ({cores()} cores, Python "
        f"{python_version()}; load average at the end {load_avg}, the simulation's own core included: "
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
        f"{' / '.join(num(float(cal.cold_ttft_s(n) - cal.hot_ttft_s(n))) for n in (16, 640, 3072))} s | "
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
                  f"Serve default = {serve_words(cfg)}. Good work = the good completions' unloaded service time "
                  "÷ (window × what the cluster completes of it per second at capacity); requests that began before "
                  "the window and ended in it can push it a little past 100.", "",
                  *_headline_table(results, process, loads), "",
                  f"![{process}]({pngs[process]})", ""]
    lines += target_section(cfg, results, costs, checks)
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
        f"reads every candidate field). {pct(cost.join_rate)}% of these admissions joined a running batch. Most of "
        "the remaining cost is `decide()` itself: up to 8 hot, 8 join and 8 cold candidates built and scored per "
        "request.", "",
        *not_modelled_text(cfg), "",
    ]
    path.write_text("\n".join(lines))
