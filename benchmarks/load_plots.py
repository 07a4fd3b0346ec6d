"""The load report's figures: goodput, refusals and P99 TTFT against offered load; the burst over time."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a benchmark machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from benchmarks.load_apps import QUEUE_ONGOING, SYSTEMS, ongoing_system  # noqa: E402
from benchmarks.load_stats import Record, Summary, timeline  # noqa: E402

# The queue at other batches (queue-ongoing-N) in lighter reds, dashed in the sweep.
COLORS = {"zeroqueue": "tab:blue", "queue-unbounded": "tab:red", "queue-bounded": "tab:orange",
          **{ongoing_system(n): c for n, c in zip(QUEUE_ONGOING, ("gold", "lightcoral", "brown"), strict=False)}}
MARKERS = {"zeroqueue": "o", "queue-unbounded": "s", "queue-bounded": "^",
           **{ongoing_system(n): m for n, m in zip(QUEUE_ONGOING, ("<", "v", "D"), strict=False)}}


def _records(run: dict[str, Any], app: str) -> list[Record]:
    return [Record(**r) for r in run["records"] if r["app"] == app]


def plot_sweep(points: Mapping[float, Mapping[str, Mapping[str, Summary]]],
               floor_rows: Sequence[tuple[float, ...]], capacity_rps: float, path: Path) -> None:
    """Four panels against offered load (x the unbounded queue's measured capacity), one line per system:
    goodput, refusal rate (with the Erlang-B floor), P99 TTFT of short requests and of all."""
    loads = sorted(points)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    (good, refused), (short, every) = axes
    for s in SYSTEMS:
        xs = [f for f in loads if s in points[f]]
        if not xs:
            continue
        style = {"color": COLORS.get(s, "gray"), "marker": MARKERS.get(s, "x"), "label": s,
                 "linestyle": "--" if s.startswith("queue-ongoing-") else "-"}
        good.plot(xs, [points[f][s]["all"].goodput_rps for f in xs], **style)
        refused.plot(xs, [100 * points[f][s]["all"].rejection_rate for f in xs], **style)
        for ax, cls in ((short, "short"), (every, "all")):
            ys = [points[f][s][cls].ttft.p99 if cls in points[f][s] else math.nan for f in xs]
            ax.plot(xs, ys, **style)
    good.plot(loads, [f * capacity_rps for f in loads], color="gray", linestyle=":", label="offered")
    refused.plot([row[0] for row in floor_rows], [100 * row[3] for row in floor_rows], color="black",
                 linestyle="--", label="Erlang-B, full-batch hold c/X")
    refused.plot([row[0] for row in floor_rows], [100 * row[4] for row in floor_rows], color="black",
                 linestyle=":", label="Erlang-B, batch-1 hold (the lowest floor)")
    refused.plot([row[0] for row in floor_rows], [100 * row[5] for row in floor_rows], color="tab:blue",
                 linestyle="--", linewidth=1, label="Erlang-B, zeroqueue's own full-batch hold")
    good.set_ylabel("goodput, req/s within the SLO")
    refused.set_ylabel("refused (503), % of offered")
    short.set_ylabel("P99 TTFT, short requests, s")
    every.set_ylabel("P99 TTFT, all requests, s")
    for ax in (short, every):
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"offered load, × queue-unbounded's measured capacity ({capacity_rps:.2f} req/s)")
    for ax in axes.flat:
        ax.axvline(1.0, color="gray", linewidth=0.6)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("zeroqueue against Serve's queue in front of the same batched engine (tails: completed requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_burst(data: dict[str, Any], path: Path) -> None:
    run = data["runs"]["burst"]
    sc = run["scenario"]
    duration = sum(p["duration_s"] for p in sc["phases"])
    bound = data["plan"]["reject_bound_s"]
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for app in SYSTEMS:
        recs = _records(run, app)
        if not recs:
            continue
        done = [r for r in recs if r.ok and r.ttft is not None]
        top.scatter([r.t_sched for r in done], [r.ttft for r in done], s=8, alpha=0.6, color=COLORS.get(app, "gray"),
                    label=f"{app}: TTFT, completed")
        mid.scatter([r.t_sched for r in done], [r.e2e for r in done], s=8, alpha=0.6, color=COLORS.get(app, "gray"),
                    label=f"{app}: end to end, completed")
        refused = [r for r in recs if r.rejected]
        mid.scatter([r.t_sched for r in refused], [r.e2e for r in refused], s=12, marker="x", color=COLORS.get(app, "gray"),
                    label=f"{app}: 503 answered in")
        bins = timeline(recs, duration)
        xs = [b.start for b in bins]
        low.step(xs, [b.rejected for b in bins], where="post", color=COLORS.get(app, "gray"), label=f"{app}: 503 refused")
        low.step(xs, [b.failed for b in bins], where="post", color=COLORS.get(app, "gray"), linestyle=":",
                 label=f"{app}: failed / abandoned")
        if app == SYSTEMS[0]:
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
