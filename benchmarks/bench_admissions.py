"""Admissions per second the control plane sustains, with 1, 2 and 4 ingress replicas, leases against central.

The same app (tiny model, one CPU slot, one hot actor of `max_batch` 8 rows, no warm pool) is deployed
on one Ray cluster with `num_replicas` N, once per design: `leases` (the default) and `central`
(`leases.is_enabled: false`: every admission and row end is a registry call). Serve's direct ingress is
on, and the client spreads its requests over the N replicas' own ports, as a load balancer in front of
them would (Serve's proxy is one process on the head: in front of N replicas it would be the bottleneck
this benchmark is not about). Two workloads, each `--seconds` long:

    dispatch-only  8 closed-loop clients of 1-token requests: every request is admitted on the hot actor
                   (8 clients, 8 rows), and each costs the control plane its admission, its relay and its
                   row's end; the tiny model's step is a few milliseconds, so the engine barely counts;
    refusal-only   8 holders keep every row of the hot actor busy (long streamed requests, renewed as they
                   end), and 16 closed-loop clients send 1-token requests that find no place: each is
                   refused with a 503 and its retry-after (a probe that slips into a row between two
                   holders is admitted and counted apart). One core decodes the holders' rows meanwhile.

For each: requests answered per second, by status; latency P50 / P99 of the answers; registry calls per
request (the registry's own count); CPU per request by process role (psutil, every process on the machine:
ingress, registry, telemetry, proxy, the engine, Ray's daemons, this client).

    .venv/bin/python -m benchmarks.bench_admissions           # ~8 min; writes benchmarks/results/admissions.md
    .venv/bin/python -m benchmarks.bench_admissions --quick   # a short run: checks the harness

Goals (the edge-admission issue): admissions/s with 4 ingress replicas >= 2.5x one replica's
(refusal-only), where the machine's cores allow; control-plane CPU (ingress + proxy + registry +
telemetry) per admitted request <= 12 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_cold_start import prepare_model
from benchmarks.common import (
    direct_ingress_bases,
    load_average,
    load_text,
    machine,
    start_serve_direct,
    was_busy,
)
from benchmarks.cpu_share import cpu_by_role, cpu_times
from benchmarks.load_stats import percentile
from benchmarks.run_files import measure_and_report

log = logging.getLogger("bench_admissions")

MODEL = "bench"
PORT = 8794
DESIGNS = ("leases", "central")
WORKLOADS = ("dispatch-only", "refusal-only")
MAX_BATCH = 8
NUM_PROBES = 16
PROMPT = "Why do queues hurt tail latency?"
CONTROL_PLANE = ("ingress", "proxy", "registry", "telemetry")
GOAL_SCALING, GOAL_CPU_MS = 2.5, 12.0


def _namespace(design: str, num_replicas: int) -> str:
    return f"zeroqueue-bench-admissions-{design}-{num_replicas}"


def _app_args(zqs: Path, design: str, num_replicas: int) -> dict[str, Any]:
    return {
        "models": [{"id": MODEL, "zqs_path": str(zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 2 << 30},
        "policy": {"max_hot_short_actors": 1, "max_hot_long_actors": 0, "max_idle_s": 3600, "max_batch": MAX_BATCH,
                   "num_warm_short_actors": 0, "num_warm_long_actors": 0, "actor_overhead_bytes": 268435456,
                   "short_max_output_tokens": 4096},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "leases": {"is_enabled": design == "leases"},
        # The central design as it was before leases: no early refusal either, every refusal a registry call.
        "early_refusal_s": 0.1 if design == "leases" else 0.0,
        "num_replicas": num_replicas,
        "namespace": _namespace(design, num_replicas),
    }


def _body() -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 1, "temperature": 0.0, "messages": [{"role": "user", "content": PROMPT}]}


async def _closed_loop(session: Any, bases: list[str], num_clients: int,
                       seconds: float) -> list[tuple[int, float]]:
    """`num_clients` clients, client i sending to replica i % N, each its next request when the last is
    answered, for `seconds`; every answer's (status, seconds)."""
    body = _body()
    until = time.monotonic() + seconds
    out: list[tuple[int, float]] = []

    async def client(i: int) -> None:
        url = f"{bases[i % len(bases)]}/v1/messages"
        while time.monotonic() < until:
            t0 = time.perf_counter()
            async with session.post(url, json=body) as r:
                await r.read()
                out.append((r.status, time.perf_counter() - t0))

    await asyncio.gather(*(client(i) for i in range(num_clients)))
    return out


async def _hold_rows(session: Any, base: str, stop: asyncio.Event, running: list[int]) -> None:
    """One holder: long streamed requests back to back until `stop`; `running[0]` counts those streaming."""
    body = {"model": MODEL, "max_tokens": 1800, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    while not stop.is_set():
        async with session.post(f"{base}/v1/messages", json=body) as r:
            if r.status != 200:
                await r.read()
                await asyncio.sleep(0.05)
                continue
            running[0] += 1
            try:
                async for _ in r.content.iter_any():
                    if stop.is_set():
                        break  # closing the connection ends the stream: the row goes back
            finally:
                running[0] -= 1


async def _window(session: Any, bases: list[str], num_clients: int, seconds: float,
                  registry: Any) -> dict[str, Any]:
    import ray

    calls_before, cpu_before, t0 = ray.get(registry.calls.remote()), cpu_times(), time.monotonic()
    answers = await _closed_loop(session, bases, num_clients, seconds)
    wall, cpu_after, calls_after = time.monotonic() - t0, cpu_times(), ray.get(registry.calls.remote())
    return {"wall_s": wall, **summarize_answers(answers), "cpu_s": cpu_by_role(cpu_before, cpu_after),
            "registry_calls": {k: n - calls_before.get(k, 0) for k, n in calls_after.items()}}


async def _deployment(zqs: Path, design: str, num_replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    import ray
    from ray import serve

    from serve_app.app import build_app

    # Named zeroqueue-*: its replicas' processes are then named as cpu_share's roles expect.
    name = f"zeroqueue-{design}-{num_replicas}"
    serve.run(build_app(_app_args(zqs, design, num_replicas)), name=name, route_prefix="/")
    registry = ray.get_actor("zq-registry", namespace=_namespace(design, num_replicas))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            bases = direct_ingress_bases(num_replicas)  # blocking, before any load
            async with session.post(f"{bases[0]}/v1/messages", json=_body()) as r:  # the cold start, alone
                if r.status != 200:
                    raise RuntimeError(f"the first request was answered {r.status}: {await r.text()}")
            await _closed_loop(session, bases, MAX_BATCH, args.warm_up_s)  # every replica's leases settle
            dispatch = await _window(session, bases, MAX_BATCH, args.seconds, registry)
            stop, running = asyncio.Event(), [0]
            holders = [asyncio.ensure_future(_hold_rows(session, bases[0], stop, running))
                       for _ in range(MAX_BATCH)]
            deadline = time.monotonic() + 60
            while running[0] < MAX_BATCH:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {running[0]} of {MAX_BATCH} holders are streaming")
                await asyncio.sleep(0.1)
            refusal = await _window(session, bases, NUM_PROBES, args.seconds, registry)
            stop.set()
            await asyncio.gather(*holders)
    finally:
        serve.delete(name)
        time.sleep(3)  # the last replica's detach takes every actor with it; the direct ports close
    return {"design": design, "num_replicas": num_replicas, "dispatch-only": dispatch, "refusal-only": refusal}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    zqs = prepare_model(args.preset, args.dtype, Path(args.cache_dir))
    load_before = load_average()
    start_serve_direct(PORT)
    runs = []
    try:
        for num_replicas in args.replicas:
            for design in DESIGNS if num_replicas % 2 else reversed(DESIGNS):
                log.info("%s, %d ingress replicas", design, num_replicas)
                runs.append(asyncio.run(_deployment(zqs, design, num_replicas, args)))
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"command": args.command, "started": started, "load_before": load_before, "load_after": load_average(),
            "machine": machine("torch", "ray"), "preset": args.preset, "dtype": args.dtype, "seconds": args.seconds,
            "runs": runs}


def summarize_answers(answers: list[tuple[int, float]]) -> dict[str, Any]:
    """What a window keeps of its answers (tens of thousands of them): counts by status, latency percentiles."""
    by_status: dict[str, int] = {}
    for status, _ in answers:
        by_status[str(status)] = by_status.get(str(status), 0) + 1
    seconds = [s for _, s in answers]
    return {"num_by_status": by_status, "p50_s": percentile(seconds, 50) if seconds else float("nan"),
            "p99_s": percentile(seconds, 99) if seconds else float("nan")}


def figures(window: dict[str, Any]) -> dict[str, Any]:
    wall, by_status = window["wall_s"], window["num_by_status"]
    num_admitted, num_refused = by_status.get("200", 0), by_status.get("503", 0)
    cpu = window["cpu_s"]
    n = sum(by_status.values())
    control = sum(cpu.get(role, 0.0) for role in CONTROL_PLANE)
    return {"per_s": n / wall, "admitted_per_s": num_admitted / wall, "refused_per_s": num_refused / wall,
            "other": n - num_admitted - num_refused, "n": n, "num_admitted": num_admitted,
            "p50_ms": window["p50_s"] * 1e3, "p99_ms": window["p99_s"] * 1e3,
            "calls_per_request": sum(window["registry_calls"].values()) / n if n else float("nan"),
            "control_ms_per_request": 1e3 * control / n if n else float("nan"),
            "control_ms_per_admitted": 1e3 * control / num_admitted if num_admitted else float("nan"),
            "cpu_ms_per_request": {role: 1e3 * s / n for role, s in cpu.items()} if n else {},
            "cpu_busy": sum(cpu.values()) / wall}


def _run(data: dict[str, Any], design: str, num_replicas: int) -> dict[str, Any]:
    return next(r for r in data["runs"] if r["design"] == design and r["num_replicas"] == num_replicas)


def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    replicas = sorted({r["num_replicas"] for r in data["runs"]})
    lines = [
        "# Admissions per second with 1, 2 and 4 ingress replicas: leases against the central registry", "",
        f"Command: `{data['command']}`", "",
        f"- run {data['started']}; {m['cores']} cores ({m['cpu']}), {m['mem_gib']:.1f} GiB; Python {m['python']}, "
        f"torch {m['torch']}, ray {m['ray']}; nothing else of ours running",
        f"- load average (1, 5, 15 min) before / after: {load_text(data['load_before'])} / "
        f"{load_text(data['load_after'])}",
        f"- model: preset `{data['preset']}`, {data['dtype']}; one CPU slot, one hot actor of {MAX_BATCH} rows, one "
        "torch thread; Serve's direct ingress, the client spreading its requests over the replicas' own ports; "
        f"{data['seconds']:g} s a workload; one async client (aiohttp) in this process",
        f"- dispatch-only: {MAX_BATCH} closed-loop clients of 1-token requests (all fit the batch); refusal-only: "
        f"{MAX_BATCH} long streamed requests hold every row while {NUM_PROBES} closed-loop clients' 1-token "
        "requests are refused",
        "",
    ]
    if was_busy(data["load_before"][0]):
        lines += [f"**Warning: the machine was busy (1-min load {data['load_before'][0]:.2f}).**", ""]
    for workload in WORKLOADS:
        key = "admitted_per_s" if workload == "dispatch-only" else "refused_per_s"
        lines += [f"## {workload}", "",
                  "| design | ingress replicas | answered/s (admitted / refused) | vs 1 replica | latency P50 / P99 ms | "
                  "registry calls per request | control-plane CPU ms per request | all CPU busy (cores) |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|"]
        for design in DESIGNS:
            base = figures(_run(data, design, replicas[0])[workload])[key]
            for n in replicas:
                f = figures(_run(data, design, n)[workload])
                lines.append(f"| {design} | {n} | {f['per_s']:.0f} ({f['admitted_per_s']:.0f} / "
                             f"{f['refused_per_s']:.0f}) | {f[key] / base:.2f}x | {f['p50_ms']:.1f} / "
                             f"{f['p99_ms']:.1f} | {f['calls_per_request']:.3f} | {f['control_ms_per_request']:.1f} | "
                             f"{f['cpu_busy']:.2f} |")
        lines += ["", "CPU ms per request by process role (leases / central):", "",
                  "| ingress replicas | " + " | ".join(_roles(data, workload)) + " |",
                  "|--:|" + "--:|" * len(_roles(data, workload))]
        for n in replicas:
            cells = []
            for role in _roles(data, workload):
                a, b = (figures(_run(data, d, n)[workload])["cpu_ms_per_request"].get(role, 0.0) for d in DESIGNS)
                cells.append(f"{a:.1f} / {b:.1f}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        methods = sorted({k for r in data["runs"] for k in r[workload]["registry_calls"]})
        lines += ["", "Registry calls per request by method (leases / central):", "",
                  "| ingress replicas | " + " | ".join(f"`{k}`" for k in methods) + " |",
                  "|--:|" + "--:|" * len(methods)]
        for n in replicas:
            cells = []
            for k in methods:
                windows = [_run(data, d, n)[workload] for d in DESIGNS]
                a, b = (w["registry_calls"].get(k, 0) / max(1, sum(w["num_by_status"].values())) for w in windows)
                cells.append(f"{a:.3f} / {b:.3f}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    refusal = {n: figures(_run(data, "leases", n)["refusal-only"])["refused_per_s"] for n in replicas}
    dispatch = figures(_run(data, "leases", replicas[0])["dispatch-only"])
    top = replicas[-1]
    scaling = refusal[top] / refusal[replicas[0]]
    lines += ["## Goals (leases, the default)", "", "| goal | measured | target | |", "|---|--:|--:|---|",
              f"| refusals/s, {top} ingress replicas against {replicas[0]} | {scaling:.2f}x | >= {GOAL_SCALING:g}x | "
              f"{'met' if scaling >= GOAL_SCALING else 'missed'} |",
              f"| control-plane CPU per admitted request (dispatch-only, {replicas[0]} replica) | "
              f"{dispatch['control_ms_per_admitted']:.1f} ms | <= {GOAL_CPU_MS:g} ms | "
              f"{'met' if dispatch['control_ms_per_admitted'] <= GOAL_CPU_MS else 'missed'} |"]
    busy = figures(_run(data, "leases", top)["refusal-only"])["cpu_busy"]
    lines += ["", f"With {top} replicas the refusal-only run kept {busy:.2f} of the machine's {m['cores']} cores busy "
              "(every process, this client included): more replicas than cores add processes that take turns, not "
              "capacity, so the scaling goal can only be judged where the cores allow it."]
    return "\n".join(lines) + "\n"


def _roles(data: dict[str, Any], workload: str) -> list[str]:
    seen: dict[str, float] = {}
    for r in data["runs"]:
        for role, s in r[workload]["cpu_s"].items():
            seen[role] = seen.get(role, 0.0) + s
    return [role for role, _ in sorted(seen.items(), key=lambda kv: -kv[1])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each workload")
    parser.add_argument("--warm-up-s", type=float, default=5.0)
    parser.add_argument("--cache-dir", default=".cache/bench")
    parser.add_argument("--out", default="benchmarks/results/admissions.md")
    parser.add_argument("--quick", action="store_true", help="1 and 2 replicas, 3 s a workload: checks the harness")
    parser.add_argument("--report-only", metavar="RUN_JSON", help="rewrite the report from a saved run")
    args = parser.parse_args(argv)
    args.command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_admissions",
                               *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.replicas, args.seconds, args.warm_up_s = [1, 2], 3.0, 3.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return measure_and_report(args, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
