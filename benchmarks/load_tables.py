"""The load report's tables: per-point summaries in, markdown rows out. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.load_apps import SYSTEMS, ZEROQUEUE
from benchmarks.load_goals import f_, pct
from benchmarks.load_scenarios import CLASSES
from benchmarks.load_stats import Record, Summary, Tail, by_class, output_tokens_per_s, window_completions

# label (a load, or a scenario's name) -> system -> class (and "all") -> Summary
Table = Mapping[Any, Mapping[str, Mapping[str, Summary]]]


def _label(key: Any) -> str:
    return f"{key:g}×" if isinstance(key, float) else str(key)


def _tail(t: Tail) -> str:
    return f"{f_(t.p50)} / {f_(t.p99)} / {f_(t.p999)} (n {t.n})"


def floor_table(rows: Sequence[tuple[float, float, float, float, float, float]], refused: Table) -> list[str]:
    """(load, offered req/s, A in Erlangs, floor, floor at batch-1 hold, floor at zeroqueue's own hold) per point,
    beside each system's refusal rate."""
    lines = ["| load | offered req/s | A (Erlangs) | Erlang-B floor B(c, A) | floor at batch-1 hold | "
             "floor at zeroqueue's own hold | " + " | ".join(f"{s} refused" for s in SYSTEMS) + " |",
             "|--:|--:|--:|--:|--:|--:|" + "--:|" * len(SYSTEMS)]
    for load, rate, erlangs, floor, strict, own in rows:
        cells = []
        for s in SYSTEMS:
            x = refused.get(load, {}).get(s, {}).get("all")
            cells.append("–" if x is None else f"{pct(x.rejection_rate)} ({x.rejected}/{x.offered})")
        lines.append(f"| {load:g}× | {rate:.2f} | {erlangs:.2f} | {pct(floor)} | {pct(strict)} | {pct(own)} | "
                     + " | ".join(cells) + " |")
    return lines


def throughput_table(table: Table, classes: Sequence[str] = ("all",)) -> list[str]:
    lines = ["| load | class | system | offered | done | refused (503) | other failures | throughput req/s | "
             "goodput req/s | 503 answered in: P99 / max s | started cold / warm |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|---|--:|"]
    for key, per_system in table.items():
        for cls in classes:
            for s in SYSTEMS:
                x = per_system.get(s, {}).get(cls)
                if x is None:
                    continue
                answered = f"{f_(x.reject_answer.p99)} / {f_(x.reject_answer_max)}" if x.rejected else "–"
                lines.append(
                    f"| {_label(key)} | {cls} | {s} | {x.offered} | {x.completed} | {x.rejected} "
                    f"({pct(x.rejection_rate)}) | {x.offered - x.completed - x.rejected} ({pct(x.failure_rate)}) | "
                    f"{f_(x.throughput_rps, 2)} | {f_(x.goodput_rps, 2)} | {answered} | "
                    f"{f'{x.cold} / {x.warm}' if s == ZEROQUEUE else '–'} |")
    return lines


def latency_table(table: Table, cls: str) -> list[str]:
    lines = ["| load | system | refused | TTFT P50 / P99 / P99.9 s | e2e P50 / P99 / P99.9 s | TTFT P99/P50 | "
             "e2e P99/P50 | TPOT P50 / P99 ms | wait P50 / P99 s |",
             "|---|---|--:|---|---|--:|--:|---|---|"]
    for key, per_system in table.items():
        for s in SYSTEMS:
            x = per_system.get(s, {}).get(cls)
            if x is None:
                continue
            lines.append(
                f"| {_label(key)} | {s} | {pct(x.rejection_rate)} | {_tail(x.ttft)} | {_tail(x.e2e)} | "
                f"{f_(x.ttft.spread, 2)} | {f_(x.e2e.spread, 2)} | {f_(1000 * x.tpot.p50, 1)} / "
                f"{f_(1000 * x.tpot.p99, 1)} | {f_(x.wait.p50)} / {f_(x.wait.p99)} |")
    return lines


def failures(table: Table) -> list[str]:
    """Every outcome other than a completion, per point and system: 503s, timeouts, errors."""
    lines = []
    for key, per_system in table.items():
        for s in SYSTEMS:
            x = per_system.get(s, {}).get("all")
            if x is not None and x.failures:
                lines.append(f"- {_label(key)}, {s}: " + ", ".join(f"{k}: {v}" for k, v in x.failures.items()))
    return lines


def capacity_table(capacity: Mapping[str, Mapping[str, Any]], slo, service: Mapping[str, float],
                   reference_rps: float) -> list[str]:
    """Each system's closed-loop saturation throughput, and what its requests met while it ran full."""
    lines = ["| system | clients | warm-up + window s | completed in window | of them " + " / ".join(CLASSES) + " | "
             "saturation req/s | × queue-unbounded | output tok/s | 503s (retried) | TTFT P50 / P99 s | "
             "e2e P50 / P99 s |",
             "|---|--:|---|--:|--:|--:|--:|--:|--:|---|---|"]
    for s in SYSTEMS:
        cap = capacity.get(s)
        if cap is None:
            continue
        records = [Record(**r) for r in cap["records"]]
        x = by_class(records, list(CLASSES), cap["warmup_s"] + cap["window_s"], slo, service)["all"]
        # Which requests completed: a system that refuses the long class completes more, cheaper, requests.
        counted = window_completions(records, cap["warmup_s"], cap["window_s"])
        done, rps = len(counted), len(counted) / cap["window_s"]  # closed_loop_rate's figures
        mix = " / ".join(str(sum(r.cls == c for r in counted)) for c in CLASSES)
        tokens_per_s = output_tokens_per_s(counted, cap["window_s"])
        lines.append(
            f"| {s} | {cap['clients']} | {cap['warmup_s']:g} + {cap['window_s']:g} | {done} | {mix} | {rps:.2f} | "
            f"{f_(rps / reference_rps if reference_rps else float('nan'), 2)} | {tokens_per_s:.0f} | "
            f"{x.rejected} | {f_(x.ttft.p50)} / {f_(x.ttft.p99)} | {f_(x.e2e.p50)} / {f_(x.e2e.p99)} |")
    return lines


def cpu_table(capacity: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """CPU ms per completed request, by process role, while each system ran full (benchmarks/cpu_share.py)."""
    measured = {s: capacity[s] for s in SYSTEMS if capacity.get(s, {}).get("cpu_s")}
    if not measured:
        return []
    roles = sorted({r for cap in measured.values() for r in cap["cpu_s"]},
                   key=lambda r: -max(cap["cpu_s"].get(r, 0.0) for cap in measured.values()))
    lines = ["| system | " + " | ".join(roles) + " | all | cores busy |", "|---|" + "--:|" * (len(roles) + 2)]
    for s, cap in measured.items():
        requests = cap["rps"] * cap["cpu_window_s"]
        per = {r: 1000 * cap["cpu_s"].get(r, 0.0) / requests for r in roles}
        lines.append(f"| {s} | " + " | ".join(f"{per[r]:.1f}" for r in roles)
                     + f" | {sum(per.values()):.1f} | {sum(cap['cpu_s'].values()) / cap['cpu_window_s']:.2f} |")
    return lines
