"""A served request's decode against the engine's own step on the same model: what serving costs a token.

    .venv/bin/python -m benchmarks.bench_served_decode     # ~4 min; writes benchmarks/results/served_decode.md (+ .json)

`make serve`'s app (`serve run configs/serve.yaml` with the Makefile's environment: direct ingress,
HAProxy) on SmolLM2-135M-Instruct, nothing else of ours running: one kept client sends `--requests`
streamed chat completions one after another (a ~70-token prompt, `--tokens` output tokens with
`ignore_eos`, greedy), and each one's decode time a token is (last text delta - first) / the tokens
between them (the continuous usage on every chunk says how many). The same app again with its actors
on one thread (`actor.compute_threads: 1`). Beside them, in the same run, the engine alone: the same
.zqs loaded and stepped in a fresh process at the actors' priority (nice 19), one row after a 128-token
prompt (bench_engine's measure), on two threads and on one.

While each app serves the timed requests, every process's CPU time is read (cpu_share.py's roles):
what else computes on the cores, a token, while the actor steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx
import yaml

from actors.actor_config import ActorConfig
from benchmarks.bench_peer import MODEL, PEER_DIR, Server, same_config, start_server, two_slots_of_one_thread
from benchmarks.common import (
    load_average,
    machine,
    make_serve_env,
    serve_run_command,
    stop_session,
    write_report,
)
from benchmarks.cpu_share import cpu_by_role, cpu_times

log = logging.getLogger("bench_served_decode")
RESULTS = Path("benchmarks/results")
ZQS = ".cache/models/smollm2-135m-instruct.zqs"  # configs/serve.yaml's model
PROMPT = "Tell me a long story about a lighthouse keeper and the ships she guides home through the storms."
WARMUP = 3  # untimed requests first: each actor's first steps touch their buffers
PAUSE_S = 0.3  # between requests: the actors idle, as between a light load's arrivals
ENGINE_STEPS = 60


# make serve's config as it is, and on one thread whatever the node leaves free (bench_peer's 2x1 variant: its
# two slots with `compute_threads: 1`).
LAYOUTS = {"configs/serve.yaml": same_config, "one thread": two_slots_of_one_thread}


def decode_of(times: list[float], counts: list[int]) -> float | None:
    """Seconds a token between the first text delta and the last, from each delta's arrival and the completion
    tokens the usage counted by then; None with fewer than two tokens between them."""
    if len(times) < 2 or counts[-1] <= counts[0]:
        return None
    return (times[-1] - times[0]) / (counts[-1] - counts[0])


def _request(client: httpx.Client, base: str, tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    t0 = time.perf_counter()
    times, counts = [], []
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            choices = chunk.get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
                counts.append(chunk["usage"]["completion_tokens"])
    return {"ttft_s": times[0] - t0, "decode_s_per_token": decode_of(times, counts),
            "tokens": counts[-1] if counts else 0}


def serve_app(name: str, config: dict, requests: int, tokens: int) -> dict:
    """`serve run` of `config`, `requests` timed requests after the warm-up, and the CPU each role spent."""
    path = PEER_DIR / f"served-decode-{re.sub(r'[^a-z0-9]+', '-', name)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    server = Server(name, "http://127.0.0.1:8000", serve_run_command(path),
                    client_nice=ActorConfig().cpu_nice, env=make_serve_env())
    proc = start_server(server, path.with_suffix(".log"))
    try:
        with httpx.Client(timeout=120) as client:
            for _ in range(WARMUP):
                _request(client, server.base, tokens)
                time.sleep(PAUSE_S)
            before, t0 = cpu_times(), time.monotonic()
            runs = []
            for _ in range(requests):
                runs.append(_request(client, server.base, tokens))
                time.sleep(PAUSE_S)
            wall_s, by_role = time.monotonic() - t0, cpu_by_role(before, cpu_times())
            health = client.get(f"{server.base}/health", timeout=30).json()
    finally:
        stop_session(proc)
        time.sleep(5)  # its processes gone before the next one starts
    return {"runs": runs, "cpu": {"wall_s": wall_s, "by_role_s": by_role},
            "step_threads": (health.get("compute_density") or {}).get("mean_step_threads")}


def engine_alone(threads: int) -> float:
    """The engine's one-row decode step, median seconds, in a fresh process at the actors' priority."""
    from actors.compute_dtype import compute_dtype_for
    from benchmarks.bench_engine import measure_in_process

    dtype = compute_dtype_for("auto", "bfloat16", "cpu")  # as the actors compute the bf16 file here
    ctx = mp.get_context("spawn")
    with ctx.Pool(1, initializer=os.nice, initargs=(ActorConfig().cpu_nice,)) as pool:
        [out] = pool.map(measure_in_process, [(ZQS, dtype, threads, [1], ENGINE_STEPS, False, None)])
    return out["step_s"]["1"]


def summary(app: dict) -> dict:
    decode = [r["decode_s_per_token"] for r in app["runs"] if r["decode_s_per_token"]]
    num_tokens = sum(r["tokens"] for r in app["runs"])
    return {"decode_p50_s": statistics.median(decode), "decode_min_s": min(decode), "decode_max_s": max(decode),
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in app["runs"]),
            "cpu_ms_per_token": {role: 1e3 * s / num_tokens for role, s in app["cpu"]["by_role_s"].items()},
            "cores_busy": {role: s / app["cpu"]["wall_s"] for role, s in app["cpu"]["by_role_s"].items()}}


def report(data: dict) -> str:
    m = data["machine"]
    lines = ["# A served request's decode against the engine's own step", "",
             f"Command: `{data['command']}`", "",
             f"Machine: {m['cores']} cores, {m['cpu']}; torch {m.get('torch')}, Ray {m.get('ray')}; load average "
             f"{data['load_before']:.2f} at the start; {data['elapsed_s'] / 60:.1f} min. Nothing else of ours ran.",
             "",
             f"Model: SmolLM2-135M-Instruct as `make serve` packs it (bf16). Served: `make serve`'s app, one kept "
             f"client, {data['requests']} streamed chat completions one after another ({WARMUP} untimed first), "
             f"{data['tokens']} output tokens each (`ignore_eos`, greedy), {PAUSE_S:g} s apart. Alone: the engine "
             f"in a fresh process at nice {ActorConfig().cpu_nice}, one row after a 128-token prompt, the median of "
             f"{ENGINE_STEPS} steps.", "",
             "| | threads | decode a token, P50 (min–max) ms | ÷ the engine alone | TTFT P50 ms | served steps' mean "
             "threads |", "|---|---|--:|--:|--:|--:|"]
    alone = data["engine_alone_s"]
    summaries = {name: summary(app) for name, app in data["apps"].items()}
    for name, app in data["apps"].items():
        s = summaries[name]
        threads = "1" if name == "one thread" else "1–2, governed"
        ref = alone["1"] if name == "one thread" else alone["2"]
        lines.append(f"| served: {name} | {threads} | {s['decode_p50_s'] * 1e3:.1f} ({s['decode_min_s'] * 1e3:.1f}–"
                     f"{s['decode_max_s'] * 1e3:.1f}) | {s['decode_p50_s'] / ref:.2f}× | {s['ttft_p50_s'] * 1e3:.0f} | "
                     f"{app['step_threads'] or 0:.2f} |")
    for threads in ("2", "1"):
        lines.append(f"| engine alone | {threads} | {alone[threads] * 1e3:.1f} | 1.00× | | |")
    lines += ["", "## What else computed while the app served", "",
              "CPU time per role over the timed requests (cpu_share.py), a token and as a share of one core:", "",
              "| app | role: ms a token (share of a core) |", "|---|---|"]
    for name, s in summaries.items():
        cells = ", ".join(f"{role} {ms:.2f} ({s['cores_busy'][role]:.0%})"
                          for role, ms in sorted(s["cpu_ms_per_token"].items(), key=lambda kv: -kv[1]) if ms >= 0.05)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="served_decode")
    args = parser.parse_args(argv)
    t0, load = time.monotonic(), load_average()[0]
    apps = {}
    for name, change in LAYOUTS.items():
        apps[name] = serve_app(name, change(yaml.safe_load(Path("configs/serve.yaml").read_text())), args.requests,
                               args.tokens)
        log.info("%s: %s", name, {k: v for k, v in summary(apps[name]).items() if k != "cpu_ms_per_token"})
    alone = {str(threads): engine_alone(threads) for threads in (2, 1)}
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_served_decode",
                          *(sys.argv[1:] if argv is None else argv)])
    data = {"command": command, "machine": machine("torch", "ray"), "load_before": load,
            "requests": args.requests, "tokens": args.tokens, "apps": apps, "engine_alone_s": alone,
            "elapsed_s": time.monotonic() - t0}
    write_report(RESULTS, args.out, data, report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
