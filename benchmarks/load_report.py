"""The load benchmark's report: `benchmarks/results/load.md`, its figures, and the goals judged from one run."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from benchmarks import load_tables as tables
from benchmarks.common import was_busy
from benchmarks.erlang import refusal_floor
from benchmarks.load_apps import BOUNDED, SYSTEMS, UNBOUNDED, ZEROQUEUE
from benchmarks.load_goals import Goal, judge
from benchmarks.load_netem import Impairment
from benchmarks.load_scenarios import CLASSES, MIXED
from benchmarks.load_stats import Record, Slo, Summary, by_class, closed_loop_rate
from benchmarks.load_sweep import hold_time_s, refusal_floor_at

# label -> system -> class (and "all") -> Summary
Summaries = dict[Any, dict[str, dict[str, Summary]]]


def summaries(data: dict[str, Any]) -> tuple[Summaries, Summaries]:
    """(the sweep's points by load, the extra scenarios by name), for the systems that ran each."""
    slo = Slo(**data["plan"]["slo"])
    service = {c: v["service_s"] for c, v in data["calibration"].items()}
    points: Summaries = {}
    extras: Summaries = {}
    for name, run in data.get("runs", {}).items():
        window = sum(p["duration_s"] for p in run["scenario"]["phases"])
        records = [Record(**r) for r in run["records"]]
        per_system = {s: by_class([r for r in records if r.app == s], list(CLASSES), window, slo, service)
                      for s in SYSTEMS if any(r.app == s for r in records)}
        if per_system:
            (points if run["load"] is not None else extras)[run["load"] if run["load"] is not None else name] = \
                per_system
    return dict(sorted(points.items())), extras


def floors(data: dict[str, Any]) -> list[tuple[float, float, float, float, float, float]]:
    """(load, offered req/s, A, Erlang-B floor, the floor at batch-1 hold, the floor at zeroqueue's own
    full-batch hold) per sweep point.

    The floor is the issue's: c = slots x max_batch places, each held c / X seconds, X the
    unbounded queue's measured saturation throughput (Little's law with the engine full).
    Below full load a batch runs fewer rows and each step is faster, so requests hold their
    place for less than c / X and a system can refuse less than that figure. The second
    figure holds each request for its class's service time *alone* (batch 1, in-process),
    the least time any request can hold a place: the lowest the floor can be. The third
    holds each request c / X_zq, X_zq zeroqueue's own measured saturation throughput: the
    floor its engines allow, given what its control plane costs them.
    """
    c, x = data["places"], data["sweep"]["capacity_rps"]
    hold = hold_time_s(c, x)
    zq = data["capacity"].get(ZEROQUEUE)
    x_zq = (closed_loop_rate([Record(**r) for r in zq["records"]], zq["warmup_s"], zq["window_s"])[1]
            if zq else math.nan)
    alone_s = sum(share * data["calibration"][cls]["service_s"] for cls, share in MIXED)
    out = []
    for run in data["runs"].values():
        if run["load"] is None:
            continue
        rate = run["arrivals"] / run["scenario"]["phases"][0]["duration_s"]  # as offered, not as planned
        own = refusal_floor_at(c, rate, x_zq) if x_zq > 0 else math.nan
        out.append((run["load"], rate, rate * hold, refusal_floor_at(c, rate, x), refusal_floor(c, rate, alone_s), own))
    return sorted(out)


def write_report(data: dict[str, Any], out: Path) -> str:
    """Write the markdown report and its figures next to it; returns the summary to print."""
    from benchmarks.load_plots import plot_burst, plot_sweep

    points, extras = summaries(data)
    floor_rows = floors(data) if "sweep" in data else []
    gs = judge(points, {row[0]: row[3] for row in floor_rows}, data["plan"]["reject_bound_s"],
               {row[0]: row[5] for row in floor_rows})
    sweep_png = out.with_name(f"{out.stem}_sweep.png")
    burst_png = out.with_name(f"{out.stem}_burst.png")
    if points:
        plot_sweep(points, floor_rows, data["sweep"]["capacity_rps"], sweep_png)
    if "burst" in extras:
        plot_burst(data, burst_png)
    out.write_text("\n".join(_document(data, points, extras, floor_rows, gs, sweep_png, burst_png)) + "\n")
    verdicts = [f"{g.name}: {_verdict(g)} — {g.figures}" for g in gs]
    return "\n".join([*verdicts, "", *tables.floor_table(floor_rows, points), "", f"report: {out}"])


def _verdict(g: Goal) -> str:
    v = "not measured" if g.met is None else "met" if g.met else "MISSED"
    return f"{v} ({g.caveat})" if g.caveat else v


def _document(data, points: Summaries, extras: Summaries, floor_rows, gs: list[Goal], sweep_png: Path,
              burst_png: Path) -> list[str]:
    plan = data["plan"]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(data["started"]))
    lines = ["# Live load: zeroqueue against Serve's queue in front of the same batched engine", ""]
    if data["quick"]:
        lines += ["**QUICK RUN** (`--quick`): every load point for a few seconds, to check the harness; far too "
                  "few requests for tails or goal verdicts to mean anything.", ""]
    lines += [f"Command: `{data['command']}`", "", f"Run {started}, {data['elapsed_s'] / 60:.1f} minutes in all "
              f"(planned to fit {plan['budget']['total_s'] / 60:g}).", ""]
    lines += _setup(data)
    lines += _capacity(data)
    lines += ["## Goals (ratios from this run)", "", "| goal | target | this run | verdict |", "|---|---|---|---|"]
    lines += [f"| {g.name} | {g.target} | {g.figures} | {_verdict(g).replace('MISSED', '**missed**')} |"
              for g in gs]
    notes = [f"- {g.name.split('.')[0]}: {g.note}" for g in gs if g.note]
    lines += ["", "Why, where a goal was missed (from this run's figures):", "", *notes] if notes else []
    lines += _best_queue(data, points)
    lines += warm_section(data, points, extras)
    x = data["sweep"]["capacity_rps"]
    lines += ["", "## Refusals against the Erlang-B floor", "",
              f"B(c, A) with c = slots × max_batch = {data['places']} places and A = offered rate × (c / X), X = "
              f"{UNBOUNDED}'s measured saturation throughput ({x:.2f} req/s): each request holds one of the c "
              f"places for c / X = {hold_time_s(data['places'], x):.2f} s when the engine runs full (Little's law). "
              "A system without a queue whose requests hold their places that long refuses at least B(c, A) of "
              "Poisson arrivals; what it refuses beyond that is its own doing. Below full load batches are smaller "
              "and faster, requests hold their places for less, and a system can refuse less than that figure. The "
              "column beside it holds each request only for its class's service time alone (batch 1, in-process), "
              "the least any request can hold a place: the lowest the floor can be at that rate. The two bracket "
              "the physics: near the first at overload (batches full), near the second at light load. The third "
              "holds each request c / X_zq, X_zq zeroqueue's own measured saturation throughput: the floor its "
              "engines allow once its control plane (ingress, registry, the extra hop to the actor) has taken its "
              "share of the same cores; between the first and the third is that capacity, beyond the third its "
              "admission. A queue refuses less than any of them by making requests wait; the unbounded one never "
              "refuses.", "",
              *tables.floor_table(floor_rows, points), ""]
    if points:
        lines += [f"![goodput, refusals and P99 TTFT against offered load]({sweep_png.name})", "",
                  "## Per load point: throughput, goodput, refusals", "", *tables.throughput_table(points), "",
                  "## Per load point: latency, all requests", "",
                  "Percentiles over completed requests, n beside them; the refusal rate beside every tail. "
                  "`wait`: arrival to compute start as the server stamps it (`X-Request-Start-Time`): Serve's queue "
                  "for the baselines (then the replica's wait for its batch's next step, not stamped); the "
                  "ingress, the registry and a join's wait for the running step (or a cold start) for zeroqueue.",
                  "",
                  *tables.latency_table(points, "all"), "",
                  "## Per load point: latency, short requests", "", *tables.latency_table(points, "short"), "",
                  "## Per load point: latency, long requests", "", *tables.latency_table(points, "long"), "",
                  "## Not completed, by outcome", "", *(tables.failures(points) or ["None."]), ""]
    for name, run in data.get("runs", {}).items():
        if run["load"] is not None:
            continue
        lines += [f"## Extra: {run['scenario']['title']}", ""]
        if run["scenario"]["lossy"] and data.get("netem_error"):
            lines += [f"**Not run: this machine cannot build the lossy link.** {data['netem_error']}", ""]
            continue
        per_system = extras.get(name)
        if per_system is None:
            lines += ["No records.", ""]
            continue
        if run["scenario"]["lossy"]:
            lines += [f"The client in a network namespace of its own, through {Impairment(**plan['impairment']).describe()}"
                      ", then a TCP relay to Serve on loopback.", ""]
        lines += [*tables.throughput_table({name: per_system}, [*CLASSES, "all"]), "",
                  *tables.latency_table({name: per_system}, "all"), "", *tables.failures({name: per_system}), ""]
        if name == "burst" and burst_png.exists():
            lines += [f"![latency and refusals through the burst]({burst_png.name})", ""]
    return lines


def _setup(data: dict[str, Any]) -> list[str]:
    m, model, plan, args = data["machine"], data["model"], data["plan"], data["app_args"]
    slo = Slo(**plan["slo"])
    policy = ", ".join(f"`{k}: {v}`" for k, v in args.get("policy", {}).items()) or "defaults"
    busy = was_busy(m["loadavg_start"][0])
    one_lane = len(set(data["lanes"].values())) == 1
    return [
        "## Machine and setup", "",
        f"- {m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB RAM; Python {m['python']}, torch {m['torch']}, "
        f"Ray {m['ray']}, locust {m['locust']}",
        f"- load average (1/5/15 min): {' / '.join(f'{x:.2f}' for x in m['loadavg_start'])} at the start, "
        f"{' / '.join(f'{x:.2f}' for x in m['loadavg_end'])} at the end"
        + (". **Other jobs were using this machine**: every figure is noisier" if busy else ""),
        f"- model: `{model['id']}`, the `{model['preset']}` shape with random weights, {model['params_m']:.1f} M "
        f"parameters, {model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads "
        f"({model['kv_heads']} KV), vocab {model['vocab']}, {model['dtype']}; `.zqs` {model['file_mb']:.0f} MB",
        f"- every system built from the same args (`{plan['config_path']}`): {data['slots']} CPU slots, one torch "
        f"thread each, the same loader, batched engine (`max_batch` rows stepped together), dtype and process "
        f"priority: c = {data['places']} requests can run at once in each system",
        f"- **{ZEROQUEUE}**: `serve_app.app:build_app`, policy {policy}: a request joins a hot actor's batch, takes "
        "an idle hot actor, or starts a fresh actor on a free slot (*started cold*), else 503 at once. "
        f"Latency targets every request gets: {_targets(data['app_args'])}. Router: {data['scorer']}",
        f"- **{UNBOUNDED}** (`benchmarks/baseline/`): one long-lived replica per slot behind Serve's proxy, "
        "`max_ongoing_requests = max_batch`, `max_queued_requests = -1` (Serve's default: no bound); Serve's "
        "default router (power of two choices; a queued request re-polls with backoff)",
        f"- **{BOUNDED}**: the same, `max_queued_requests = {data['bounded_queue']}` (slots × max_batch): Serve "
        "answers 503 at once beyond it. A careful operator's bound: one more full batch per replica may wait, and "
        "the last of a full queue waits about one batch's service time (c / X, below), within the TTFT SLO; a "
        "longer queue only holds requests that will miss it",
        *([f"- **queue-ongoing-N** ({', '.join(str(n) for n in data['plan'].get('queue_ongoing', ()))}): "
           f"{UNBOUNDED} with each replica taking N requests at once (its engine's `max_batch` = "
           "`max_ongoing_requests` = N): the queue's other configurations, so that zeroqueue is compared with the "
           "best of them too (its closed loop: slots × N clients)"] if data["plan"].get("queue_ongoing") else []),
        ("- one lane: every class of the mix is in zeroqueue's short lane (`short_max_input_tokens` covers the "
         "long class's prompt), so every row of every system can take every request. The baselines have no "
         "lanes; splitting zeroqueue's 2 slots by lane would halve the rows any one class can use"
         if one_lane else f"- zeroqueue lanes per class: {data['lanes']} (rows are split by lane)"),
        f"- client: locust as a library, in its own process; streaming (SSE) on loopback; a request not done in "
        f"{plan['timeout_s']:g} s is abandoned (its connection closed, so the server cancels it) and counted as "
        f"`timeout`; at most {plan['max_in_flight']} in flight. Open-loop points: Poisson arrivals, the same "
        "schedule (arrivals, classes, prompts, seeds) for every system",
        f"- SLO for goodput: {slo.describe()}; goodput and throughput are per second of the offered window",
        "- percentiles are over completed requests; refusals and failures are counted beside them. P99.9 of "
        "fewer than 1000 requests is interpolated near the maximum; read it as such", "",
        "Each class's hot service time alone (batch 1, the in-process engine before Ray starts, computing as the "
        f"actors do: their threads, compute dtype and packed weights; median of {plan['calibration_repeats']}) sets its "
        "end-to-end SLO; nothing else:", "",
        "| class | mix share | prompt tokens | output tokens | hot service s (batch 1) | SLO e2e s | zeroqueue lane |",
        "|---|--:|--:|--:|--:|--:|---|",
        *[f"| {c} | {dict(MIXED).get(c, 0):.0%} | "
          f"{v['input_tokens']} | {v['output_tokens']} | {v['service_s']:.3f} | {slo.e2e_s(v['service_s']):.2f} | "
          f"{data['lanes'][c]} |" for c, v in data["calibration"].items()], "",
    ]


def _best_queue(data: dict[str, Any], points: Summaries) -> list[str]:
    """Issue 23's goals, against the best-configured queue as well as the queue at zeroqueue's settings."""
    from benchmarks import load_best_queue
    from serve_app.policy import PolicyConfig

    max_batch = PolicyConfig(**data["app_args"].get("policy", {})).max_batch
    goals, table = load_best_queue.judge(points, data.get("capacity", {}), max_batch)
    if not goals:
        return []
    return ["", "## Issue 23's goals: against the best-configured queue", "",
            "The queue's configurations that ran, each on the same schedules; the best is the one with the most "
            "goodput over the sweep (its own measure). zeroqueue's saturation is compared with it as well as "
            "with the queue at zeroqueue's own batch.", "", *table, "",
            "| goal | target | this run | verdict |", "|---|---|---|---|",
            *[f"| {g.name} | {g.target} | {g.figures} | {_verdict(g).replace('MISSED', '**missed**')} |"
              for g in goals]]


def _capacity(data: dict[str, Any]) -> list[str]:
    plan, sweep = data["plan"], data["sweep"]
    slo = Slo(**plan["slo"])
    service = {c: v["service_s"] for c, v in data["calibration"].items()}
    capacity = data["capacity"]
    first = capacity[UNBOUNDED]
    lines = [
        "## Capacity, measured live", "",
        f"Closed loop: {first['clients']} clients (= slots × max_batch), each sending its next request (class drawn "
        f"from the mix) as soon as its last one ended; a 503 is retried after its `retry-after-ms`, as the SDKs "
        f"do, at most {plan['max_retry_wait_s']:g} s later. Saturation throughput = requests "
        f"completed in the window after the warm-up / the window.", "",
        *tables.capacity_table(capacity, slo, service, sweep["capacity_rps"]), "",
        *(["CPU per completed request (ms), by process, over each system's capacity window (every process's "
           "user + system time, read every 0.5 s; `benchmarks/cpu_share.py` names the roles). A baseline "
           "replica's figure holds its engine and its own HTTP handling; zeroqueue's engines are its request "
           "actors, and its ingress and registry are the control plane the baselines do not have. On CPU slots "
           "all of it comes out of the same cores.", "", *tables.cpu_table(capacity), ""]
          if tables.cpu_table(capacity) else []),
        f"Offered loads are fractions of **{UNBOUNDED}'s {sweep['capacity_rps']:.2f} req/s**, the same "
        "schedules for every system. Each point lasts to hold about "
        f"{plan['budget']['target_n']} requests (clamped to {plan['budget']['min_s']:g}–{plan['budget']['max_s']:g} s)"
        + (f", then all scaled by {sweep['scale']:.2f} to fit the budget" if sweep["scale"] < 1 else "")
        + f"; planned to take {sweep['expected_s'] / 60:.1f} of the {sweep['left_s'] / 60:.1f} minutes left.", "",
        "| load | offered req/s | duration s | requests (n) | client lag P99 / max ms |", "|--:|--:|--:|--:|---|",
    ]
    for run in data["runs"].values():
        if run["load"] is None:
            continue
        duration = run["scenario"]["phases"][0]["duration_s"]
        lags = sorted(r["lag"] for r in run["records"])
        lag = f"{1000 * lags[int(0.99 * (len(lags) - 1))]:.0f} / {1000 * lags[-1]:.0f}" if lags else "–"
        lines.append(f"| {run['load']:g}× | {run['arrivals'] / duration:.2f} | {duration:.0f} | {run['arrivals']} | "
                     f"{lag} |")
    return [*lines, "", "Client lag: how late the client sent a request against its schedule, over all systems "
            "(TTFT is measured from the send, so it does not include it).", ""]


WARM_REFUSAL_BOUND_S = 0.25


def warm_section(data: dict[str, Any], points: Summaries, extras: Summaries) -> list[str]:
    """zeroqueue's process starts against its warm actors, and its refusals while actors start."""
    counts = data.get("registry_counters")
    if counts is None:
        return []
    zq = [per[ZEROQUEUE]["all"] for per in [*points.values(), *extras.values()] if ZEROQUEUE in per]
    cold, warm = sum(x.cold for x in zq), sum(x.warm for x in zq)
    spared = counts.get("spawn_with_warm_available", 0)
    lines = ["", "## Warm actors and process starts (zeroqueue)", "",
             f"Over every scenario: {warm} completed requests were bound to a warm actor (no process start), {cold} "
             f"started on a fresh actor (`X-Request-Tier`). The registry decided {counts.get('bind', 0)} binds, "
             f"{counts.get('spawn', 0)} spawns ({counts.get('evicted', 0)} actors evicted for them), "
             f"{counts.get('join', 0)} joins, {counts.get('dispatch', 0)} dispatches and {counts.get('reject', 0)} "
             f"refusals (warm-up and capacity windows included).", "",
             f"- no request pays a process start while a warm actor of its model was available on a fitting slot: "
             f"**{spared}** spawns were decided with one there ({'met' if spared == 0 else 'missed'})"]
    fresh = extras.get("coldburst", {}).get(ZEROQUEUE, {}).get("all")
    if fresh is not None:
        slow = fresh.reject_slower_than(WARM_REFUSAL_BOUND_S)
        answered = (f"{fresh.rejected} refusals, P99 {fresh.reject_answer.p99:.3f} s, slowest "
                    f"{fresh.reject_answer_max:.3f} s, {slow} over {WARM_REFUSAL_BOUND_S} s" if fresh.rejected
                    else "no refusal")
        lines.append(f"- every refusal answered within {WARM_REFUSAL_BOUND_S} s while actors start (the cold burst: "
                     f"10× from the first second of a fresh deployment; {fresh.cold} started cold, {fresh.warm} "
                     f"bound warm): {answered} ({'met' if slow == 0 else 'missed'})")
    return lines


def _targets(args: dict) -> str:
    """The served models' default TTFT and TPOT targets, as the app args state them."""
    return "; ".join(f"`{m['id']}` TTFT {m.get('ttft_target_s', 'none')} s, TPOT {m.get('tpot_target_s', 'none')} s"
                     for m in args.get("models", []))
