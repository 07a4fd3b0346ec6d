"""The load report's figures: latency CDFs per scenario, app and class; the burst over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a benchmark machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import LogLocator, NullFormatter  # noqa: E402

from benchmarks.load_apps import APPS  # noqa: E402
from benchmarks.load_scenarios import CLASSES  # noqa: E402
from benchmarks.load_stats import Record, timeline  # noqa: E402

COLORS = {"zeroqueue": "tab:blue", "baseline": "tab:red"}


def _records(run: dict[str, Any], app: str) -> list[Record]:
    return [Record(**r) for r in run["records"] if r["app"] == app]


def _cdf(ax, values: list[float], offered: int, **style) -> None:
    """Step CDF over *offered* requests: it tops out at the completed share."""
    if not values or not offered:
        return
    xs = sorted(values)
    ys = [(i + 1) / offered for i in range(len(xs))]
    ax.step(xs, ys, where="post", **style)


def plot_cdfs(data: dict[str, Any], path: Path) -> None:
    runs = [(n, r) for n, r in data["runs"].items() if r["records"]]
    if not runs:
        return
    classes = list(CLASSES)
    fig, axes = plt.subplots(len(runs), len(classes), figsize=(4.2 * len(classes), 3.0 * len(runs)), squeeze=False)
    for row, (name, run) in enumerate(runs):
        for col, cls in enumerate(classes):
            ax = axes[row][col]
            for app in APPS:
                recs = [r for r in _records(run, app) if r.cls == cls]
                done = [r for r in recs if r.ok]
                _cdf(ax, [r.e2e for r in done], len(recs), color=COLORS[app], label=f"{app} e2e")
                _cdf(ax, [r.ttft for r in done if r.ttft is not None], len(recs), color=COLORS[app],
                     linestyle="--", alpha=0.7, label=f"{app} TTFT")
            ax.set_xscale("log")
            ax.set_xlim(0.05, 1.2 * data["plan"]["timeout_s"])  # the same scale everywhere
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.xaxis.set_major_locator(LogLocator(base=10))
            ax.set_ylim(0, 1.02)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{name}: {cls}", fontsize=10)
            if col == 0:
                ax.set_ylabel("share of offered done")
            if row == len(runs) - 1:
                ax.set_xlabel("seconds")
    handles = [Line2D([], [], color=COLORS[app], linestyle=ls, label=f"{app} {what}")
               for app in APPS for ls, what in (("-", "end to end"), ("--", "TTFT"))]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_burst(data: dict[str, Any], path: Path) -> None:
    run = data["runs"]["burst"]
    sc = run["scenario"]
    duration = sum(p["duration_s"] for p in sc["phases"])
    bound = data["plan"]["reject_bound_s"]
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for app in APPS:
        recs = _records(run, app)
        if not recs:
            continue
        done = [r for r in recs if r.ok and r.ttft is not None]
        top.scatter([r.t_sched for r in done], [r.ttft for r in done], s=8, alpha=0.6, color=COLORS[app],
                    label=f"{app}: TTFT, completed")
        mid.scatter([r.t_sched for r in done], [r.e2e for r in done], s=8, alpha=0.6, color=COLORS[app],
                    label=f"{app}: end to end, completed")
        refused = [r for r in recs if r.rejected]
        mid.scatter([r.t_sched for r in refused], [r.e2e for r in refused], s=12, marker="x", color=COLORS[app],
                    label=f"{app}: 503 answered in")
        bins = timeline(recs, duration)
        xs = [b.start for b in bins]
        low.step(xs, [b.rejected for b in bins], where="post", color=COLORS[app], label=f"{app}: 503 refused")
        low.step(xs, [b.failed for b in bins], where="post", color=COLORS[app], linestyle=":",
                 label=f"{app}: failed / abandoned")
        if app == APPS[0]:
            low.step(xs, [b.offered for b in bins], where="post", color="gray", alpha=0.5, label="offered")
    mid.axhline(bound, color="black", linewidth=0.8, linestyle="--", label=f"refusal bound {bound:g} s")
    for ax in (top, mid, low):
        if sc.get("spike"):
            ax.axvspan(*sc["spike"], color="orange", alpha=0.15)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    for ax in (top, mid):
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    top.set_ylabel("TTFT s")
    mid.set_ylabel("seconds")
    low.set_ylabel("requests per second")
    low.set_xlabel("arrival time, s from the scenario's start (shaded: the 10× spike)")
    fig.suptitle("burst: latency and refusals over time, by arrival")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
