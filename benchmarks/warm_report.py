"""The warm-start report: a run of `benchmarks.bench_warm` (its raw JSON) as markdown, goals judged."""

from __future__ import annotations

import statistics
from collections import defaultdict

MiB = 1 << 20
GOAL_TTFT_S, GOAL_RATIO = 0.35, 0.25
FRESH = "fresh spawn"  # the configuration label of a fresh spawn, as bench_warm records it
# How the client timed a request over HTTP: one kept client (its connection kept alive), or one built for the
# request after the clock started (every run before 2026-12-06; httpx builds an SSL context per client).
KEPT_CLIENT, NEW_CLIENT = "kept client", "new client"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(data: dict) -> str:
    meta, actors, http = data["meta"], data["actors"], data["http"]
    lines = [
        "# Warm actors against fresh spawns: time to first token, and what each preloaded layer costs", "",
        f"Command: `{meta['command']}`", "",
        f"Run {meta['started']}, {meta['elapsed_s'] / 60:.1f} minutes. {meta['cores']} cores, Python "
        f"{meta['python']}, torch {meta['torch']}; load average {meta['load_before'][0]:.2f} at the start, "
        f"{meta['load_after'][0]:.2f} at the end.", "",
        f"Model: `{meta['preset']}`, {meta['dtype']}, {meta['num_layers']} layers, "
        f"{meta['weight_bytes'] / MiB:.0f} MiB of weights; loaded in-process in {meta['load_s']:.2f} s on one "
        f"thread. Prompts: " + ", ".join(f"{k} {v} tokens" for k, v in meta["prompt_tokens"].items())
        + f" (the balanced prompt's prefill takes about the load's time). One output token, greedy; "
        f"{meta['repeats']} repeats per configuration, configurations in rotation.", "",
        "## Actors: the caller's call to the first token", "",
        "Each actor is created by the driver with the deployment's options (its worker lowered in priority "
        "from its interpreter's start) and serves one request. *Fresh spawn*: the request sent right after the spawn "
        "call, as the ingress does for a cold start. *Warm, N*: the request sent once the actor's `ready()` "
        "answered (embeddings and layers 0..N-1 resident, the rest held back until the request; with every "
        "layer, nothing is held back and the weights are packed for the actors' kernels before `ready()` answers, "
        "where the CPU runs them, while an actor holding fewer packs them beside its first request). Resident: "
        "the warm actor's process resident set (VmRSS) when ready: the interpreter, torch, the allocated "
        "model's touched pages.", "",
        "| prompt | configuration | TTFT median s | TTFT min–max s | × fresh spawn | spawn → ready s | resident MiB |",
        "|---|---|--:|---|--:|--:|--:|",
    ]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in actors:
        groups[(r["prompt"], r["config"])].append(r)
    fresh = {p: _median([r["ttft_s"] for r in rs]) for (p, c), rs in groups.items() if c == FRESH}
    best: dict[str, tuple[float, str]] = {}
    for (prompt, config), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "short", _order(kv[0][1]))):
        ttft = [r["ttft_s"] for r in rs]
        med = _median(ttft)
        ready = _median([r["ready_s"] for r in rs if r["ready_s"] is not None])
        rss = _median([r["rss_bytes"] for r in rs if r["rss_bytes"] is not None])
        lines.append(f"| {prompt} | {config} | {med:.3f} | {min(ttft):.3f}–{max(ttft):.3f} | "
                     f"{med / fresh[prompt]:.2f} | {'' if config == FRESH else f'{ready:.2f}'} | "
                     f"{'' if config == FRESH else f'{rss / MiB:.0f}'} |")
        if config != FRESH and (prompt not in best or med < best[prompt][0]):
            best[prompt] = (med, config)
    lines += ["", _tradeoff(groups, fresh, meta), ""]
    lines += _http(http, meta)
    return "\n".join(lines) + "\n"


def _order(config: str) -> int:
    return -1 if config == FRESH else int(config.rsplit("=", 1)[1])


def _tradeoff(groups: dict, fresh: dict, meta: dict) -> str:
    """What each preloaded layer costs in memory and saves in time, per prompt, from this run's medians."""
    out = ["What a layer costs and saves (from the medians above):", ""]
    num_layers = meta["num_layers"]
    for prompt in meta["prompt_tokens"]:
        one = groups.get((prompt, "warm, N=1"))
        full = groups.get((prompt, f"warm, N={num_layers}"))
        if not one or not full:
            continue
        d_ttft = _median([r["ttft_s"] for r in one]) - _median([r["ttft_s"] for r in full])
        d_rss = _median([r["rss_bytes"] for r in full]) - _median([r["rss_bytes"] for r in one])
        out.append(f"- {prompt} prompt: from N=1 to N={num_layers}, TTFT falls by {d_ttft * 1000:.0f} ms "
                   f"({d_ttft * 1000 / max(1, num_layers - 1):.1f} ms a layer) for {d_rss / MiB:.0f} MiB more "
                   f"resident ({d_rss / MiB / max(1, num_layers - 1):.1f} MiB a layer).")
    picked = ", ".join(f"N={n} for the {p} prompt" for p, n in meta["policy_n"].items())
    out.append(f"- The derivation (`cold_start.warm_layers` with the actor config's default rates) picks {picked}; "
               "where the actors pack their weights on a CPU the deployment holds every layer instead "
               "(`ActorConfig.warm_layers`).")
    return "\n".join(out)


def _http(http: list[dict], meta: dict) -> list[str]:
    if not http:
        return ["(The HTTP part was not run.)"]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in http:
        groups[r["pool"], r.get("client", NEW_CLIENT)].append(r)
    lines = ["## Through the app: the client's send to its first text delta", "",
             "The app on 2 CPU slots, no hot actors (every request is served by a bound warm actor or a fresh "
             "one, which then exits), streamed over HTTP on loopback, the short prompt, one request at a time "
             "once the last one's actor is gone and the pool is full again. The warm actors hold the layers the "
             "deployment chooses (every one where the actors pack their weights). Requests alternate between "
             f"a *{KEPT_CLIENT}* (one httpx client, its connection kept alive, as the SDKs keep theirs) and a "
             f"*{NEW_CLIENT}* built for the request after the clock started, as runs before 2026-12-06 timed "
             "every request: its TTFT also counts the client's own start (httpx builds an SSL context).", "",
             "| app | client | requests | tiers | TTFT median s | TTFT min–max s |", "|---|---|--:|---|--:|---|"]
    for (pool, client), rs in groups.items():
        ttft = [r["ttft_s"] for r in rs]
        tiers = ", ".join(f"{t} {sum(r['tier'] == t for r in rs)}" for t in sorted({r["tier"] for r in rs}))
        lines.append(f"| {pool} | {client} | {len(rs)} | {tiers} | {_median(ttft):.3f} | "
                     f"{min(ttft):.3f}–{max(ttft):.3f} |")
    lines += ["", "## Goals", ""]
    judged = KEPT_CLIENT if any(client == KEPT_CLIENT for _, client in groups) else NEW_CLIENT
    warm = [r["ttft_s"] for r in groups.get(("warm pool", judged), []) if r["tier"] == "warm"]
    cold = [r["ttft_s"] for r in groups.get(("no pool", judged), []) if r["tier"] == "cold"]
    if warm and cold:
        w, c = _median(warm), _median(cold)
        lines.append(f"Judged on the {judged}'s requests.")
        lines.append("")
        lines.append(f"- warm TTFT median ≤ {GOAL_TTFT_S} s: **{w:.3f} s** "
                     f"({'met' if w <= GOAL_TTFT_S else 'missed'})")
        lines.append(f"- warm TTFT ≤ {GOAL_RATIO} × the fresh spawn's in the same run: **{w / c:.2f}×** "
                     f"({w:.3f} against {c:.3f} s; {'met' if w / c <= GOAL_RATIO else 'missed'})")
    else:
        lines.append("- not judged: the run has no warm or no cold request through the app")
    return lines
