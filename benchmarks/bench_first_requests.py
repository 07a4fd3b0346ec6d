"""A newcomer's first 200 requests after `make serve`: is any refused for the control plane's sake?

Each run starts the default app afresh exactly as `make serve` does (`serve run
configs/serve.yaml`, SmolLM2-135M-Instruct on two CPU slots), waits until `GET /v1/models`
answers, and sends what a new user tried by hand:

    150 sequential requests, alternately a streamed Messages request and a JSON chat completion
    (16 tokens each), then 50 more in bursts of 8 at once,

then stops the app. It counts every answer by status and error message, and reads the
ingress's `Server-Timing` header for the time the admission took (`admit`, the registry's
decision). The goal (the edge-admission issue): no `503` caused by the registry's deadline
("the admission registry did not answer / is unavailable") in any run.

    .venv/bin/python -m benchmarks.bench_first_requests            # 2 fresh starts, ~15 min
    .venv/bin/python -m benchmarks.bench_first_requests --runs 1   # one, ~7 min

Needs the packed default model (`make serve` fetches it once).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import load_text, machine, serve_run_command, stop_session
from benchmarks.load_stats import percentile
from benchmarks.run_files import measure_and_report

log = logging.getLogger("bench_first_requests")

MODEL = "smollm2-135m-instruct"
BASE = "http://127.0.0.1:8000"
CONFIG = "configs/serve.yaml"
NUM_SEQUENTIAL, NUM_TOTAL, BURST = 150, 200, 8
REGISTRY_REFUSAL = re.compile(r"admission registry")


async def _one(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
    content = f"Tell me one fact about the number {i}."
    t0 = time.perf_counter()
    if i % 2 == 0:
        body = {"model": MODEL, "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": content}]}
        async with client.stream("POST", f"{BASE}/v1/messages", json=body) as r:
            raw = b"".join([chunk async for chunk in r.aiter_bytes()])
    else:
        body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": content}]}
        r = await client.post(f"{BASE}/v1/chat/completions", json=body)
        raw = r.content
    seconds = time.perf_counter() - t0
    message = ""
    if r.status_code != 200:
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw[:200].decode(errors="replace")
    timing = dict(re.findall(r"(\w+);dur=([\d.]+)", r.headers.get("server-timing", "")))
    return {"i": i, "status": r.status_code, "seconds": round(seconds, 4), "message": message,
            "admit_ms": float(timing["admit"]) if "admit" in timing else None}


async def _newcomer() -> list[dict[str, Any]]:
    results = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(NUM_SEQUENTIAL):
            results.append(await _one(client, i))
        for start in range(NUM_SEQUENTIAL, NUM_TOTAL, BURST):
            results += await asyncio.gather(*(_one(client, i) for i in range(start, min(start + BURST, NUM_TOTAL))))
    return results


def _wait_ready(app: subprocess.Popen, timeout_s: float = 300) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if app.poll() is not None:
            raise RuntimeError(f"serve run exited with {app.returncode} before the app answered")
        try:
            if httpx.get(f"{BASE}/v1/models", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the app did not answer GET /v1/models within {timeout_s} s")


def _one_run(index: int, log_dir: Path) -> dict[str, Any]:
    log_path = log_dir / f"serve-{index}.log"
    with log_path.open("w") as out:
        # Its own session: the whole local cluster it starts goes when it is stopped.
        app = subprocess.Popen(serve_run_command(CONFIG), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready_s = _wait_ready(app)
        load_before = os.getloadavg()
        results = asyncio.run(_newcomer())
    finally:
        stop_session(app)
    return {"ready_s": round(ready_s, 1), "load_before": load_before, "results": results}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if not Path(CONFIG).is_file() or not Path(f".cache/models/{MODEL}.zqs").is_file():
        raise SystemExit(f"no .cache/models/{MODEL}.zqs: run `make serve` once (it fetches and packs the model)")
    log_dir = Path(".cache/bench/first_requests")
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for index in range(args.runs):
        log.info("run %d of %d: a fresh serve run", index + 1, args.runs)
        runs.append(_one_run(index, log_dir))
    return {"command": "python -m benchmarks.bench_first_requests " + shlex.join(sys.argv[1:]),
            "machine": machine("ray", "torch"), "when": time.strftime("%Y-%m-%d %H:%M"), "runs": runs}


def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "# A newcomer's first 200 requests after `make serve`", "",
        f"Command: `{data['command']}` ({data['when']}). Machine: {m['cores']} cores, {m['cpu']}, "
        f"Ray {m.get('ray')}, torch {m.get('torch')}. Each run: a fresh `serve run {CONFIG}` "
        f"({MODEL}, 2 CPU slots, 1 hot actor of 8 rows, 1 warm actor), {NUM_SEQUENTIAL} sequential requests "
        f"(streamed Messages and JSON chat completions alternately, 16 tokens) from the moment "
        f"`GET /v1/models` answers, then {NUM_TOTAL - NUM_SEQUENTIAL} in bursts of {BURST}.", "",
        "| run | ready after | load before (1/5/15 min) | served | refused by the registry's deadline "
        "| other refusals | admit P50 / P99 / max (ms) | request P50 / P99 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    num_registry = 0
    for index, run in enumerate(data["runs"], 1):
        results = run["results"]
        registry = [r for r in results if REGISTRY_REFUSAL.search(r["message"])]
        num_registry += len(registry)
        other = collections.Counter(f"{r['status']} {r['message']}" for r in results
                                    if r["status"] != 200 and r not in registry)
        admits = sorted(r["admit_ms"] for r in results if r["admit_ms"] is not None)
        admit = " / ".join(f"{percentile(admits, q):.1f}" for q in (50, 99)) + f" / {admits[-1]:.1f}" if admits else "-"
        seconds = sorted(r["seconds"] for r in results)
        lines.append(f"| {index} | {run['ready_s']} s | {load_text(run['load_before'])} "
                     f"| {sum(r['status'] == 200 for r in results)} / {len(results)} | {len(registry)} "
                     f"| {'; '.join(f'{n}× {k}' for k, n in other.items()) or 0} | {admit} "
                     f"| {percentile(seconds, 50):.2f} / {percentile(seconds, 99):.2f} |")
    verdict = "met" if num_registry == 0 else "missed"
    lines += ["", f"Goal: no refusal caused by the registry's deadline in any run: **{verdict}** "
                  f"({num_registry} in {len(data['runs'])} runs).", "",
              "`admit` is the ingress's wait for the registry's decision (Server-Timing); a request's time is "
              "the client's, to its last byte. The request P99 comes from the bursts of 8; why they take "
              "that long is not analysed here.", ""]
    if data.get("notes"):
        lines += [data["notes"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/first_requests.md")
    parser.add_argument("--report-only", default=None, help="rewrite the report from a saved run's JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    return measure_and_report(args, measure, report)


if __name__ == "__main__":
    sys.exit(main())
