"""Admission at the edge: leases against the central registry, side by side in one run.

The same app (one CPU slot, one hot actor of `max_batch` 8 rows, no warm pool) is deployed twice
on one Ray cluster, alternately, in blocks: `leases` (the default: each replica decides on rows
it leases) and `central` (`leases.is_enabled: false`: every admission and every row's end is a
registry call, the design before leases). Each block measures:

    hot path     one-token greedy requests, sequential, each sent through Serve's proxy and straight
                 to the ingress replica's own port (Serve's direct ingress, on in this run), each
                 beside the same prompt run in-process (the runtime alone): the overhead is the
                 difference (as bench_overhead);
    steady load  4 closed-loop clients of 8-token requests: registry calls per admitted request,
                 counted by the registry actor itself (`calls()`) and by Ray's task summary (the
                 state API, from the dashboard), which must agree;
    bursts       48 and then 300 long streamed requests opened at once by one async client: how many
                 are admitted, how many refused, and how long a refusal takes (send -> 503).

    .venv/bin/python -m benchmarks.bench_edge           # ~6 min; writes benchmarks/results/edge.md and .json
    .venv/bin/python -m benchmarks.bench_edge --quick   # a short run: checks the harness

Goals (the edge-admission issue, ratios from one run on this machine): hot-path overhead <= 10 ms P50
and <= 15 ms P99; registry calls per admitted request <= 0.05; refusals in a 48 burst P99 <= 100 ms,
in a 300 burst <= 250 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from actors.engine import Engine
from benchmarks.bench_overhead import PROMPT, _http_one, _in_process_one, in_process_engine
from benchmarks.common import (
    direct_ingress_bases,
    load_average,
    load_text,
    machine,
    start_serve_direct,
    was_busy,
)
from benchmarks.load_stats import percentile
from benchmarks.run_files import measure_and_report

log = logging.getLogger("bench_edge")

PORT = 8793
MODEL = "bench"
DESIGNS = ("leases", "central")
# The registry's calls a request makes itself; the rest (attach, exchange_leases, ...) are heartbeats.
PER_REQUEST = frozenset({"admit", "finish", "abandon", "actor_started", "give_back"})
GOALS = {"overhead_p50_ms": 10.0, "overhead_p99_ms": 15.0, "calls_per_admitted": 0.05,
         "burst48_p99_ms": 100.0, "burst300_p99_ms": 250.0}


def _namespace(design: str) -> str:
    return f"zeroqueue-bench-edge-{design}"


def _app_args(zqs: Path, design: str) -> dict[str, Any]:
    return {
        "models": [{"id": MODEL, "zqs_path": str(zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 2 << 30},
        "policy": {"max_hot_short_actors": 1, "max_hot_long_actors": 0, "max_idle_s": 3600, "max_batch": 8,
                   "num_warm_short_actors": 0, "num_warm_long_actors": 0, "actor_overhead_bytes": 268435456},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "leases": {"is_enabled": design == "leases"},
        "namespace": _namespace(design),
    }


def _registry_calls(ray: Any, design: str) -> dict[str, int]:
    return ray.get(ray.get_actor("zq-registry", namespace=_namespace(design)).calls.remote())


def _task_summary_calls() -> dict[str, int]:
    """RegistryActor tasks by method, as Ray's state API counts them (every registry on the cluster)."""
    from ray.util.state import summarize_tasks

    summary = summarize_tasks(raise_on_missing_output=False)["cluster"]["summary"]
    out: dict[str, int] = {}
    for name, entry in summary.items():
        if name.startswith("RegistryActor."):
            out[name.split(".", 1)[1]] = sum(entry["state_counts"].values())
    return out


def _steady(base: str, seconds: float, num_clients: int = 4) -> int:
    """Closed-loop clients of 8-token requests for `seconds`; returns how many were answered 200."""
    import httpx

    body = {"model": MODEL, "max_tokens": 8, "temperature": 0.0, "messages": [{"role": "user", "content": PROMPT}]}
    done = [0] * num_clients
    until = time.monotonic() + seconds

    def client(i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < until:
                done[i] += c.post(f"{base}/v1/messages", json=body).status_code == 200

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)


async def _burst(base: str, n: int, max_tokens: int) -> list[tuple[int, float]]:
    """`n` streamed requests opened at once; each one's status and the seconds to its status line."""
    import httpx

    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one() -> tuple[int, float]:
            t0 = time.perf_counter()
            async with client.stream("POST", f"{base}/v1/messages", json=body) as r:
                status, seconds = r.status_code, time.perf_counter() - t0
                await r.aread()
            return status, seconds

        return await asyncio.gather(*(one() for _ in range(n)))


def _block(ray: Any, serve: Any, build_app: Any, zqs: Path, design: str, engine: Engine, prompt: list[int],
           args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    base = f"http://127.0.0.1:{PORT}"
    serve.run(build_app(_app_args(zqs, design)), name=f"bench-edge-{design}", route_prefix="/")
    try:
        (direct_base,) = direct_ingress_bases()
        with httpx.Client(timeout=120) as client:
            for _ in range(args.warm_up):  # the cold start, then the hot actor's rows (and leases)
                client.post(f"{base}/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": PROMPT}]})
                _in_process_one(engine, prompt)
            time.sleep(2)  # a heartbeat or two: the leases renewed
            pairs = []
            for k in range(args.pairs):
                if k % 2:
                    local, http = _in_process_one(engine, prompt), _http_one(client, base)
                else:
                    http, local = _http_one(client, base), _in_process_one(engine, prompt)
                direct = _http_one(client, direct_base)
                pairs.append({"in_process": local, **http, "direct": direct["total"]})
        calls_before, summary_before = _registry_calls(ray, design), _task_summary_calls()
        admitted = _steady(base, args.steady_s)
        calls_after, summary_after = _registry_calls(ray, design), _task_summary_calls()
        bursts = {n: asyncio.run(_burst(base, n, args.burst_tokens)) for n in (48, 300)}
    finally:
        serve.delete(f"bench-edge-{design}")
        time.sleep(3)  # the last replica's detach takes every actor with it
    return {"design": design, "pairs": pairs, "steady_admitted": admitted, "steady_s": args.steady_s,
            "registry_calls": {k: calls_after.get(k, 0) - calls_before.get(k, 0) for k in calls_after},
            "task_summary_calls": {k: summary_after.get(k, 0) - summary_before.get(k, 0) for k in summary_after},
            "bursts": {str(n): b for n, b in bursts.items()}}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from serve_app.app import build_app

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    zqs, engine, _, prompt = in_process_engine(args)
    load_before = load_average()
    # The proxy (or HAProxy) serves PORT, and each ingress replica its own port too.
    start_serve_direct(PORT, is_haproxy=args.haproxy, include_dashboard=True)
    blocks = []
    try:
        for i in range(args.blocks):
            for design in DESIGNS if i % 2 == 0 else reversed(DESIGNS):
                log.info("block %d: %s", i, design)
                blocks.append(_block(ray, serve, build_app, zqs, design, engine, prompt, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"command": args.command, "started": started, "load_before": load_before, "load_after": load_average(),
            "machine": machine("torch", "ray"), "preset": args.preset, "dtype": args.dtype,
            "front": "HAProxy" if args.haproxy else "Serve's proxy",
            "prompt_tokens": len(prompt), "steady_s": args.steady_s, "burst_tokens": args.burst_tokens,
            "blocks": blocks}


def _of(data: dict[str, Any], design: str) -> list[dict[str, Any]]:
    return [b for b in data["blocks"] if b["design"] == design]


def _figures(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = [p for b in blocks for p in b["pairs"]]
    overhead = [p["total"] - p["in_process"] for p in pairs]
    admitted = sum(b["steady_admitted"] for b in blocks)
    calls = sum(sum(b["registry_calls"].values()) for b in blocks)
    tasks = sum(sum(b["task_summary_calls"].values()) for b in blocks)
    by_method: dict[str, int] = {}
    for b in blocks:
        for k, n in b["registry_calls"].items():
            by_method[k] = by_method.get(k, 0) + n
    per_request = sum(n for k, n in by_method.items() if k in PER_REQUEST)
    seconds = sum(b["steady_s"] for b in blocks)
    direct_overhead = [p["direct"] - p["in_process"] for p in pairs]
    out = {"num_pairs": len(pairs), "direct_overhead_p50_ms": percentile(direct_overhead, 50) * 1e3,
           "direct_overhead_p99_ms": percentile(direct_overhead, 99) * 1e3,
           "direct_p50_ms": percentile([p["direct"] for p in pairs], 50) * 1e3,
           "direct_p99_ms": percentile([p["direct"] for p in pairs], 99) * 1e3, "per_request_calls": per_request,
           "per_request_per_admitted": per_request / admitted if admitted else float("nan"),
           "heartbeat_calls_per_s": (calls - per_request) / seconds if seconds else float("nan"), "overhead_p50_ms": percentile(overhead, 50) * 1e3,
           "overhead_p99_ms": percentile(overhead, 99) * 1e3,
           "http_p50_ms": percentile([p["total"] for p in pairs], 50) * 1e3,
           "http_p99_ms": percentile([p["total"] for p in pairs], 99) * 1e3,
           "admit_p50_ms": percentile([p["admit"] for p in pairs], 50) * 1e3,
           "steady_admitted": admitted, "registry_calls": calls, "task_summary_calls": tasks,
           "calls_per_admitted": calls / admitted if admitted else float("nan"), "calls_by_method": by_method}
    for n in ("48", "300"):
        results = [r for b in blocks for r in b["bursts"][n]]
        refused = [s for status, s in results if status == 503]
        out[f"burst{n}_admitted"] = sum(1 for status, _ in results if status == 200)
        out[f"burst{n}_refused"] = len(refused)
        out[f"burst{n}_other"] = len(results) - out[f"burst{n}_admitted"] - len(refused)
        out[f"burst{n}_p50_ms"] = percentile(refused, 50) * 1e3 if refused else float("nan")
        out[f"burst{n}_p99_ms"] = percentile(refused, 99) * 1e3 if refused else float("nan")
    return out


def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    fig = {d: _figures(_of(data, d)) for d in DESIGNS}
    front = data.get("front", "Serve's proxy")  # runs before --haproxy had only the proxy
    lines = [
        "# Admission at the edge: leases against the central registry", "",
        f"Command: `{data['command']}`", "",
        f"- run {data['started']}; {m['cores']} cores ({m['cpu']}), {m['mem_gib']:.1f} GiB; Python {m['python']}, "
        f"torch {m['torch']}, ray {m['ray']}; nothing else of ours running",
        f"- load average (1, 5, 15 min) before / after: {load_text(data['load_before'])} / "
        f"{load_text(data['load_after'])}",
        f"- model: preset `{data['preset']}`, {data['dtype']}, prompt {data['prompt_tokens']} tokens; one CPU slot, "
        f"one hot actor of 8 rows, one torch thread, one ingress replica, {front} in front on the HTTP port",
        f"- {len(data['blocks'])} blocks, the two designs alternating; each: sequential 1-token pairs (HTTP and "
        f"in-process), {data['steady_s']:g} s of 4 closed-loop clients (8 tokens), then bursts of 48 and 300 "
        f"streamed requests of {data['burst_tokens']} tokens from one async client",
        "",
    ]
    if was_busy(data["load_before"][0]):
        lines += [f"**Warning: the machine was busy (1-min load {data['load_before'][0]:.2f}).**", ""]
    rows = [
        ("hot path: HTTP P50 / P99 ms", lambda f: f"{f['http_p50_ms']:.1f} / {f['http_p99_ms']:.1f}"),
        ("hot path: overhead over in-process P50 / P99 ms",
         lambda f: f"{f['overhead_p50_ms']:.1f} / {f['overhead_p99_ms']:.1f}"),
        ("hot path: `admit` hop P50 ms", lambda f: f"{f['admit_p50_ms']:.2f}"),
        ("hot path, direct ingress: HTTP P50 / P99 ms", lambda f: f"{f['direct_p50_ms']:.1f} / {f['direct_p99_ms']:.1f}"),
        ("hot path, direct ingress: overhead P50 / P99 ms",
         lambda f: f"{f['direct_overhead_p50_ms']:.1f} / {f['direct_overhead_p99_ms']:.1f}"),
        ("steady load: requests admitted", lambda f: f"{f['steady_admitted']}"),
        ("steady load: registry calls (own count / Ray's task summary)",
         lambda f: f"{f['registry_calls']} / {f['task_summary_calls']}"),
        ("steady load: registry calls per admitted request", lambda f: f"{f['calls_per_admitted']:.3f}"),
        ("steady load: of which the requests' own (admit, finish, ...) per admitted request",
         lambda f: f"{f['per_request_per_admitted']:.3f}"),
        ("steady load: heartbeat calls per second (one replica)", lambda f: f"{f['heartbeat_calls_per_s']:.2f}"),
        ("burst of 48: admitted / refused / other", lambda f: f"{f['burst48_admitted']} / {f['burst48_refused']} / "
                                                              f"{f['burst48_other']}"),
        ("burst of 48: refusal P50 / P99 ms", lambda f: f"{f['burst48_p50_ms']:.0f} / {f['burst48_p99_ms']:.0f}"),
        ("burst of 300: admitted / refused / other",
         lambda f: f"{f['burst300_admitted']} / {f['burst300_refused']} / {f['burst300_other']}"),
        ("burst of 300: refusal P50 / P99 ms", lambda f: f"{f['burst300_p50_ms']:.0f} / {f['burst300_p99_ms']:.0f}"),
    ]
    lines += ["| | leases | central | leases / central |", "|---|--:|--:|--:|"]
    ratio_keys = {0: "http_p50_ms", 1: "overhead_p50_ms", 3: "direct_p50_ms", 4: "direct_overhead_p50_ms",
                  7: "calls_per_admitted", 11: "burst48_p99_ms", 13: "burst300_p99_ms"}
    for i, (label, cell) in enumerate(rows):
        key = ratio_keys.get(i)
        ratio = (f"{fig['leases'][key] / fig['central'][key]:.2f}" if key and fig["central"][key] else "")
        lines.append(f"| {label} | {cell(fig['leases'])} | {cell(fig['central'])} | {ratio} |")
    lines += ["", "Registry calls during the steady load, by method (own count):", "",
              "| method | leases | central |", "|---|--:|--:|"]
    for k in sorted(set(fig["leases"]["calls_by_method"]) | set(fig["central"]["calls_by_method"])):
        lines.append(f"| {k} | {fig['leases']['calls_by_method'].get(k, 0)} | "
                     f"{fig['central']['calls_by_method'].get(k, 0)} |")
    f = fig["leases"]
    verdicts = [
        ("hot-path overhead P50, proxy / direct", f"{f['overhead_p50_ms']:.1f} / {f['direct_overhead_p50_ms']:.1f} ms",
         f"<= {GOALS['overhead_p50_ms']:g} ms", f["direct_overhead_p50_ms"] <= GOALS["overhead_p50_ms"]),
        ("hot-path overhead P99, proxy / direct", f"{f['overhead_p99_ms']:.1f} / {f['direct_overhead_p99_ms']:.1f} ms",
         f"<= {GOALS['overhead_p99_ms']:g} ms", f["direct_overhead_p99_ms"] <= GOALS["overhead_p99_ms"]),
        ("registry calls per admitted request", f"{f['calls_per_admitted']:.3f}",
         f"<= {GOALS['calls_per_admitted']:g}", f["calls_per_admitted"] <= GOALS["calls_per_admitted"]),
        ("refusal P99, burst of 48", f"{f['burst48_p99_ms']:.0f} ms", f"<= {GOALS['burst48_p99_ms']:g} ms",
         f["burst48_p99_ms"] <= GOALS["burst48_p99_ms"]),
        ("refusal P99, burst of 300", f"{f['burst300_p99_ms']:.0f} ms", f"<= {GOALS['burst300_p99_ms']:g} ms",
         f["burst300_p99_ms"] <= GOALS["burst300_p99_ms"]),
    ]
    lines += ["", "## Goals (leases, the default)", "", "| goal | measured | target | |", "|---|--:|--:|---|"]
    lines += [f"| {g} | {v} | {t} | {'met' if ok else 'missed'} |" for g, v, t, ok in verdicts]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per design, alternating")
    parser.add_argument("--pairs", type=int, default=100, help="hot-path pairs per block")
    parser.add_argument("--steady-s", type=float, default=30.0)
    parser.add_argument("--burst-tokens", type=int, default=64)
    parser.add_argument("--warm-up", type=int, default=5)
    parser.add_argument("--cache-dir", default=".cache/bench")
    parser.add_argument("--out", default="benchmarks/results/edge.md")
    parser.add_argument("--haproxy", action="store_true",
                        help="Serve's HAProxy in front of the replicas on the HTTP port, instead of Serve's proxy")
    parser.add_argument("--quick", action="store_true", help="one short block per design: checks the harness")
    parser.add_argument("--report-only", metavar="RUN_JSON", help="rewrite the report from a saved run")
    args = parser.parse_args(argv)
    args.command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_edge",
                               *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.blocks, args.pairs, args.steady_s = 1, 10, 3.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return measure_and_report(args, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
