"""What zeroqueue's own request traces say about one rate of the peer benchmark (benchmarks/bench_peer.py).

GuideLLM sees a request's TTFT from outside; the app's traces (serve_app/traces.py) say where
the request went and what admission predicted for it: its tier (hot, join, warm, cold) and
predicted TTFT, its measured TTFT (the ingress's arrival to the actor's first token), and each
refusal's reason, the threads its steps computed on (the mean over them: the thread governor
drops to one while the node's other processes are busy), and how long the first token took from the
actor's sampling it to the ingress's receiving it (`ttft_seen_s - ttft_s`: the actor's event loop and
Ray's stream, which the measured TTFT leaves out and a client waits for). Per rate, `summarise` counts them, and
names the admitted requests whose measured TTFT passed the served model's TTFT target: admission
let each in on a prediction within the target (issue 23: no admission into seconds of waiting),
so each is a prediction that missed, and the report says by how much and where.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from benchmarks.load_stats import percentile

MAX_LISTED = 6  # the worst misses named per rate


def read_new(path: Path, offset: int) -> tuple[list[dict], int]:
    """The whole trace lines written to `path` since byte `offset`, and the offset after them."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
    records = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return records, offset + end


def summarise(records: list[dict], ttft_target_s: float | None) -> dict:
    """Admitted requests per tier (count, measured ÷ predicted TTFT P50 / P90, measured TTFT P99), refusals
    per reason, and the admitted requests past the TTFT target, worst first."""
    tiers: dict[str, list[tuple[float, float]]] = {}
    refused: Counter = Counter()
    late, corrections, threads, delivery = [], [], [], []
    for r in records:
        decision, outcome = r.get("decision") or {}, r.get("outcome") or {}
        if decision.get("kind") == "reject":
            refused[decision.get("reason") or "?"] += 1
            continue
        if decision.get("tier") in ("hot", "join"):  # what the router priced a running actor's steps at
            corrections.append((decision.get("candidate") or {}).get("step_correction", 1.0))
        measured, predicted = outcome.get("ttft_s"), (decision.get("predicted") or {}).get("ttft_s")
        if outcome.get("ok") and outcome.get("mean_step_threads"):
            threads.append(outcome["mean_step_threads"])
        if outcome.get("ok") and measured is not None and outcome.get("ttft_seen_s") is not None:
            delivery.append(outcome["ttft_seen_s"] - measured)
        if not outcome.get("ok") or measured is None or not predicted:
            continue
        tier = decision.get("tier") or "?"
        tiers.setdefault(tier, []).append((measured, predicted))
        if ttft_target_s is not None and measured > ttft_target_s:
            candidate = decision.get("candidate") or {}
            late.append({"tier": tier, "measured_s": measured, "predicted_s": predicted,
                         "bound_s": (decision.get("predicted") or {}).get("ttft_high_s"),
                         "batch_rows": candidate.get("batch_rows", 0),
                         "pending_tokens": candidate.get("batch_pending_prompt_tokens", 0),
                         "step_correction": candidate.get("step_correction", 1.0),
                         "dispatch_s": outcome.get("dispatch_s")})
    late.sort(key=lambda x: -x["measured_s"])
    by_tier = {}
    for tier, pairs in sorted(tiers.items()):
        ratios = [m / p for m, p in pairs]
        by_tier[tier] = {"count": len(pairs), "ratio_p50": percentile(ratios, 50), "ratio_p90": percentile(ratios, 90),
                         "ttft_p99_s": percentile([m for m, _ in pairs], 99)}
    return {"tiers": by_tier, "refused": dict(refused), "num_late": len(late), "late": late[:MAX_LISTED],
            "step_correction_p50": percentile(corrections, 50) if corrections else None,
            "step_threads_mean": sum(threads) / len(threads) if threads else None,
            "delivery_p50_s": percentile(delivery, 50) if delivery else None,
            "delivery_p99_s": percentile(delivery, 99) if delivery else None}


def report_lines(data: dict) -> list[str]:
    """The report's section: per zeroqueue server and rate, from the traces each rate recorded."""
    rows = [(name, rate, rows[f"{rate:g}"].get("traces")) for name, rows in data["servers"].items()
            if name.startswith("zeroqueue") for rate in data["rates"]]
    rows = [(name, rate, t) for name, rate, t in rows if t]
    if not rows:
        return []
    target = (data.get("targets") or {}).get("ttft_target_s")
    lines = ["## Where zeroqueue placed each request, and the admitted ones past the TTFT target", "",
             "From the app's request traces (serve_app/traces.py), per rate: admitted requests per tier with "
             "their TTFT measured ÷ predicted (P50 / P90) and measured TTFT P99 (the ingress's arrival to the "
             f"actor's first token, which GuideLLM's adds its own side to), refusals per reason, the threads the "
             f"served requests' steps computed on (their mean; actors/thread_governor.py), the first token's "
             "delivery from the actor's sampling it to the ingress's receiving it (P50 / P99: not in the measured "
             "TTFT, in GuideLLM's), and the admitted "
             f"requests whose measured TTFT passed the {target:g} s target: each was admitted on a prediction "
             "within it.", "",
             "| server | rate (req/s) | admitted per tier: n, ratio P50 / P90, TTFT P99 | refused | threads a step "
             "| first token to the ingress (ms) | past the target |",
             "|---|--:|---|---|--:|--:|--:|"]
    for name, rate, t in rows:
        tiers = "; ".join(f"{tier} {s['count']}, {s['ratio_p50']:.2f} / {s['ratio_p90']:.2f}, "
                          f"{s['ttft_p99_s'] * 1e3:.0f} ms" for tier, s in t["tiers"].items())
        refused = ", ".join(f"{reason} {n}" for reason, n in sorted(t["refused"].items())) or "0"
        threads = "—" if t.get("step_threads_mean") is None else f"{t['step_threads_mean']:.2f}"
        delivery = ("—" if t.get("delivery_p50_s") is None
                    else f"{t['delivery_p50_s'] * 1e3:.0f} / {t['delivery_p99_s'] * 1e3:.0f}")
        lines.append(f"| {name} | {rate:g} | {tiers or '—'} | {refused} | {threads} | {delivery} | {t['num_late']} |")
    late = [(name, rate, x) for name, rate, t in rows for x in t["late"]]
    if late:
        lines += ["", f"The admitted requests past the target (at most {MAX_LISTED} a rate, worst first):", "",
                  "| server | rate | tier | measured TTFT (ms) | predicted (ms) | bound checked (ms) | batch rows "
                  "| prompt tokens ahead | step correction |", "|---|--:|---|--:|--:|--:|--:|--:|--:|"]
        for name, rate, x in late:
            bound = "—" if x.get("bound_s") is None else f"{x['bound_s'] * 1e3:.0f}"
            lines.append(f"| {name} | {rate:g} | {x['tier']} | {x['measured_s'] * 1e3:.0f} | "
                         f"{x['predicted_s'] * 1e3:.0f} | {bound} | {x['batch_rows']} | {x['pending_tokens']} | "
                         f"{x['step_correction']:.2f} |")
    return lines + [""]
