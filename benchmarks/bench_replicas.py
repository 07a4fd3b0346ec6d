"""Two ingress replicas sharing one hot batch at 0.6x its capacity: refusals, false refusals, registry calls.

In-process (serve_app/asgi.py's `Replicas` over one `LocalNode`: the real registry state, the
real engine, no Ray), one CPU slot whose hot actor runs `max_batch` 8 rows. Open-loop Poisson
arrivals at 0.6x the batch's capacity (8 / the measured mean service time), each request dealt
to one of the two replicas at random, as Serve's router would; one run with leases (the
default) and one with the central registry (`leases.is_enabled: false`), alternating blocks.

A refusal is *false* when, at the moment the registry refused it, the other replica held a free
leased row its request would have fitted: capacity sat unused in a lease. The slow path takes
such rows back before it refuses (registry_leases.recall_free_row), so the count should be 0;
the run checks that under real interleavings. The Erlang-B floor for 8 places is printed beside
every refusal rate.

    .venv/bin/python -m benchmarks.bench_replicas          # ~6 min; writes benchmarks/results/replicas.md and .json
    .venv/bin/python -m benchmarks.bench_replicas --quick  # a short run: checks the harness

Goal (the edge-admission issue): false refusals <= 1% of requests at 0.6x.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_cold_start import prepare_model
from benchmarks.common import load_average, load_text, machine, was_busy
from benchmarks.erlang import erlang_b
from benchmarks.run_files import measure_and_report

log = logging.getLogger("bench_replicas")

MODEL = "bench"
MAX_BATCH = 8
LOAD = 0.6
GOAL_FALSE = 0.01
PROMPT = "Why do queues hurt tail latency?"


def _args(zqs: Path, is_leased: bool) -> dict[str, Any]:
    return {
        "models": [{"id": MODEL, "zqs_path": str(zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 2 << 30},
        "policy": {"max_hot_short_actors": 1, "max_hot_long_actors": 0, "max_idle_s": 3600, "max_batch": MAX_BATCH,
                   "num_warm_short_actors": 0, "num_warm_long_actors": 0, "actor_overhead_bytes": 268435456},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "leases": {"is_enabled": is_leased},
    }


class _Watch:
    """Wraps each replica's admission: at every registry refusal, did the other replica hold a free fitting row?"""

    def __init__(self, admissions: list) -> None:
        self.admissions, self.num_false = admissions, 0
        for i, admission in enumerate(admissions):
            admission._admit = self._wrap(admission._admit, i)

    def _wrap(self, admit, i: int):
        async def watched(features, spawn_name, request_id):
            decision = await admit(features, spawn_name, request_id)
            if getattr(decision, "reason", None) == "no_capacity":
                others = [a for j, a in enumerate(self.admissions) if j != i]
                self.num_false += any(a.leases.view(features) is not None for a in others)
            return decision

        return watched


async def _run(zqs: Path, is_leased: bool, num_requests: int, max_tokens: int, service_s: float | None,
               seed: int) -> dict[str, Any]:
    from serve_app.asgi import IngressApp, Replicas
    from serve_app.config import AppArgs, ingress_config
    from serve_app.local_cluster import LocalClusterSpec, LocalNode

    config = ingress_config(AppArgs.model_validate(_args(zqs, is_leased)))
    spec = dataclasses.replace(LocalClusterSpec(), node=LocalNode())
    apps = [IngressApp(config, spec) for _ in range(2)]
    for app in apps:
        await app.startup()
    replicas = Replicas(apps)
    admissions = [app.ingress.admission for app in apps]
    watch = _Watch(admissions)
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": PROMPT}]}
    transport = httpx.ASGITransport(app=replicas)
    results: list[tuple[int, float]] = []
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://zq", timeout=300) as client:
            async def one(replica: int) -> tuple[int, float]:
                t0 = time.perf_counter()
                r = await client.post("/v1/messages", json=body, headers={"x-zq-replica": str(replica)})
                return r.status_code, time.perf_counter() - t0

            for i in range(4):  # the cold start, then rows on the hot actor through both replicas
                await one(i % 2)
            if service_s is None:  # the mean service time of one request alone, the load's unit
                service_s = statistics.fmean([(await one(i % 2))[1] for i in range(6)])
            rate = LOAD * MAX_BATCH / service_s
            rng = random.Random(seed)
            calls_before = sum(admissions[0].cluster.calls.values())  # both replicas share the count
            tasks = []
            for _ in range(num_requests):
                tasks.append(asyncio.ensure_future(one(rng.randrange(2))))
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
            calls = dict(admissions[0].cluster.calls)
            num_calls = sum(calls.values()) - calls_before
    finally:
        for app in apps:
            await app.shutdown()
    admitted = sum(1 for status, _ in results if status == 200)
    refused = sum(1 for status, _ in results if status == 503)
    return {"design": "leases" if is_leased else "central", "service_s": service_s, "rate": rate,
            "num_requests": len(results), "admitted": admitted, "refused": refused,
            "other": len(results) - admitted - refused, "false_refusals": watch.num_false,
            "registry_calls": num_calls, "calls_by_method": calls}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    zqs = prepare_model(args.preset, args.dtype, Path(args.cache_dir))
    load_before = load_average()
    runs, service_s = [], None
    for block in range(args.blocks):
        for is_leased in (True, False) if block % 2 == 0 else (False, True):
            log.info("block %d: %s", block, "leases" if is_leased else "central")
            run = asyncio.run(_run(zqs, is_leased, args.requests, args.max_tokens, service_s, seed=block))
            service_s = run["service_s"]  # every run offers the same rate
            runs.append(run)
    return {"command": args.command, "started": started, "load_before": load_before, "load_after": load_average(),
            "machine": machine("torch"), "preset": args.preset, "dtype": args.dtype, "max_tokens": args.max_tokens,
            "runs": runs}


def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    service_s, rate = data["runs"][0]["service_s"], data["runs"][0]["rate"]
    floor = erlang_b(MAX_BATCH, rate * service_s)
    lines = [
        "# Two ingress replicas sharing one hot batch at 0.6x its capacity", "",
        f"Command: `{data['command']}`", "",
        f"- run {data['started']}; {m['cores']} cores ({m['cpu']}), {m['mem_gib']:.1f} GiB; Python {m['python']}, "
        f"torch {m['torch']}; nothing else of ours running",
        f"- load average (1, 5, 15 min) before / after: {load_text(data['load_before'])} / "
        f"{load_text(data['load_after'])}",
        f"- in-process (the real registry state and engine, no Ray): two ingress replicas on one cluster, one CPU "
        f"slot, one hot actor of {MAX_BATCH} rows; model `{data['preset']}`, {data['dtype']}; {data['max_tokens']} "
        f"output tokens at most a request (greedy)",
        f"- Poisson arrivals at {rate:.2f} req/s = 0.6 x {MAX_BATCH} rows / {service_s:.2f} s (one request's mean "
        f"time alone), each dealt to a replica at random; Erlang-B floor for {MAX_BATCH} places: "
        f"{100 * floor:.1f}%", "",
    ]
    if was_busy(data["load_before"][0]):
        lines += [f"**Warning: the machine was busy (1-min load {data['load_before'][0]:.2f}).**", ""]
    lines += ["| design | requests | admitted | refused | false refusals | registry calls per request |",
              "|---|--:|--:|--:|--:|--:|"]
    totals: dict[str, dict[str, int]] = {}
    for r in data["runs"]:
        t = totals.setdefault(r["design"], {"n": 0, "refused": 0, "false": 0, "calls": 0, "admitted": 0})
        t["n"] += r["num_requests"]
        t["refused"] += r["refused"]
        t["false"] += r["false_refusals"]
        t["calls"] += r["registry_calls"]
        t["admitted"] += r["admitted"]
    for design, t in totals.items():
        lines.append(f"| {design} | {t['n']} | {t['admitted']} | {t['refused']} ({100 * t['refused'] / t['n']:.1f}%) | "
                     f"{t['false']} ({100 * t['false'] / t['n']:.1f}%) | {t['calls'] / t['n']:.2f} |")
    false_rate = totals["leases"]["false"] / totals["leases"]["n"]
    lines += ["", "## Goal", "", "| goal | measured | target | |", "|---|--:|--:|---|",
              f"| false refusals at 0.6x, 2 replicas | {100 * false_rate:.1f}% | <= {100 * GOAL_FALSE:g}% | "
              f"{'met' if false_rate <= GOAL_FALSE else 'missed'} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--blocks", type=int, default=2, help="runs per design, alternating")
    parser.add_argument("--requests", type=int, default=200, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--cache-dir", default=".cache/bench")
    parser.add_argument("--out", default="benchmarks/results/replicas.md")
    parser.add_argument("--quick", action="store_true", help="one short run per design: checks the harness")
    parser.add_argument("--report-only", metavar="RUN_JSON", help="rewrite the report from a saved run")
    args = parser.parse_args(argv)
    args.command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_replicas",
                               *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.blocks, args.requests = 1, 30
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return measure_and_report(args, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
