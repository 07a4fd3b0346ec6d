"""What the serving path costs a request over the runtime alone: the hot path, hop by hop.

The same one-token greedy request (a short chat prompt), sent sequentially, alternately:

    http        through Serve's proxy and the ingress to a hot actor over real HTTP
                (`POST /v1/messages`, not streamed), the client's send -> the response read;
    in-process  the same prompt through the actors' `Engine` in this process, one torch
                thread, as the actor runs it: prefill and the first token.

Interleaving pairs each HTTP request with an in-process run under the same machine state;
the overhead is the difference. The ingress's `Server-Timing` header breaks its part down:
`parse` (body, validation, chat template, tokenizer), `admit` (the registry's decision),
`place` (the actor's handle, and the call), `start` (the call -> the actor's `Started`
back at the ingress), `answer` (Started -> the Completion back: the compute, plus the
actor's and the relay's own work); what the header does not cover is the proxy and the
client (`proxy`: Serve's HTTP proxy both ways, and httpx).

    .venv/bin/python -m benchmarks.bench_overhead           # ~2 min; writes benchmarks/results/overhead.md and .json
    .venv/bin/python -m benchmarks.bench_overhead --quick   # 20 pairs: checks the harness

Goal (the architecture issue): the hot path's overhead over in-process <= 10 ms at P50 and
<= 20 ms at P99, and the HTTP path's P99/P50 <= 1.15, on this machine with nothing else
running.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from actors.actor_config import ActorConfig
from actors.engine import Engine
from actors.events import FinishEvent
from actors.layer_loader import load_zqs
from actors.sampling import SamplingParams
from actors.tokenizer import Message
from benchmarks.bench_cold_start import prepare_model
from benchmarks.common import load_average, load_text, machine, was_busy
from benchmarks.load_stats import percentile
from benchmarks.run_files import measure_and_report

log = logging.getLogger("bench_overhead")

NAMESPACE = "zeroqueue-bench-overhead"
PORT = 8793
MODEL = "bench"
PROMPT = "Why do queues hurt tail latency?"
HOPS = ("proxy", "parse", "admit", "place", "start", "answer")
GOAL_P50_MS, GOAL_P99_MS, GOAL_TAIL_RATIO = 10.0, 20.0, 1.15


def _app_args(zqs: Path) -> dict[str, Any]:
    return {
        "models": [{"id": MODEL, "zqs_path": str(zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 1, "cpu_slot_bytes": 2 << 30},
        # One hot actor that stays: every measured request is a dispatch to it.
        "policy": {"max_hot_short_actors": 1, "max_hot_long_actors": 0, "max_idle_s": 3600,
                   "actor_overhead_bytes": 268435456},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "namespace": NAMESPACE,
    }


def _server_timing(header: str) -> dict[str, float]:
    """`parse;dur=1.2, admit;dur=0.8, ...` -> {"parse": 0.0012, ...} in seconds."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur) / 1e3
    return out


def _http_one(client: Any, base: str) -> dict[str, float]:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0.0, "messages": [{"role": "user", "content": PROMPT}]}
    t0 = time.perf_counter()
    r = client.post(f"{base}/v1/messages", json=body)
    total = time.perf_counter() - t0
    if r.status_code != 200 or r.headers.get("X-Request-Tier") != "hot":
        raise RuntimeError(f"expected a hot 200, got {r.status_code} {r.headers.get('X-Request-Tier')}: {r.text}")
    hops = _server_timing(r.headers["Server-Timing"])
    hops["proxy"] = total - sum(hops.values())
    return {"total": total, **hops}


def _in_process_one(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    for event in engine.generate(list(prompt), SamplingParams(max_tokens=1, temperature=0.0)):
        if isinstance(event, FinishEvent):
            break
    return time.perf_counter() - t0


def _parse_cost_s(tokenizer: Any, max_context: int, repeats: int = 500) -> float:
    """Median time the ingress's own parsing takes for this body, in-process: validation, the chat
    template and the tokenizer (`parse` minus this is reading the body into the replica)."""
    from serve_app import api
    from serve_app.prompt import prompt_for

    body = json.dumps({"model": MODEL, "max_tokens": 1, "temperature": 0.0,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        prompt_for(api.parse_messages_request(body), tokenizer, max_context)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def in_process_engine(args: argparse.Namespace) -> tuple[Path, Engine, Any, list[int]]:
    """The model's file, the in-process engine the HTTP path is paired with, its tokenizer, and PROMPT as
    the chat template renders it. One torch thread, as the actor runs."""
    zqs = prepare_model(args.preset, args.dtype, Path(args.cache_dir))
    torch.set_num_threads(1)
    # In the dtype the actor computes in (its default `compute_dtype: auto`: fp32 on a CPU without native
    # 16-bit arithmetic), or the pair compares two different computations.
    model, tokenizer = load_zqs(zqs, num_threads=1, compute_dtype=ActorConfig().compute_dtype)
    return zqs, Engine(model, tokenizer), tokenizer, tokenizer.encode_chat([Message("user", PROMPT)])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import ray
    from ray import serve

    from serve_app.app import build_app

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    zqs, engine, tokenizer, prompt = in_process_engine(args)
    parse_cost_s = _parse_cost_s(tokenizer, engine.max_context)
    load_before = load_average()
    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    base = f"http://127.0.0.1:{PORT}"
    pairs: list[dict[str, float]] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(_app_args(zqs)), name="bench-overhead", route_prefix="/")
        with httpx.Client(timeout=120) as client:
            for _ in range(args.warm_up):  # the cold start, then the hot actor's and the engine's first runs
                client.post(f"{base}/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": PROMPT}]})
                _in_process_one(engine, prompt)
            for k in range(args.pairs):
                # Alternate which goes first, so neither always runs right after the other's wake-up.
                if k % 2:
                    local = _in_process_one(engine, prompt)
                    http = _http_one(client, base)
                else:
                    http = _http_one(client, base)
                    local = _in_process_one(engine, prompt)
                pairs.append({"in_process": local, **http})
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"command": args.command, "started": started, "load_before": load_before, "load_after": load_average(),
            "machine": machine("torch", "ray"), "preset": args.preset, "dtype": args.dtype,
            "prompt_tokens": len(prompt), "parse_cost_s": parse_cost_s, "pairs": pairs}


def report(data: dict[str, Any]) -> str:
    pairs = data["pairs"]
    ms = 1e3
    total = [p["total"] for p in pairs]
    local = [p["in_process"] for p in pairs]
    overhead = [p["total"] - p["in_process"] for p in pairs]
    o50, o99 = percentile(overhead, 50) * ms, percentile(overhead, 99) * ms
    t50, t99 = percentile(total, 50), percentile(total, 99)
    tail = t99 / t50
    m = data["machine"]
    lines = [
        "# The hot path's overhead over the runtime alone",
        "",
        f"Command: `{data['command']}`",
        "",
        f"- run {data['started']}; {m['cores']} cores ({m['cpu']}), {m['mem_gib']:.1f} GiB; Python {m['python']}, "
        f"torch {m['torch']}, ray {m['ray']}",
        f"- load average (1, 5, 15 min) before / after: {load_text(data['load_before'])} / "
        f"{load_text(data['load_after'])}",
        f"- model: preset `{data['preset']}`, {data['dtype']}; prompt {data['prompt_tokens']} tokens, 1 output "
        "token, greedy; one hot actor on one CPU slot, one torch thread, as the in-process engine",
        f"- {len(pairs)} sequential pairs, HTTP and in-process alternating which goes first; nothing refused "
        "(every HTTP request was a dispatch to the hot actor)",
        "",
    ]
    if was_busy(data["load_before"][0]):
        lines += [f"**Warning: the machine was busy (1-min load {data['load_before'][0]:.2f}):** the figures "
                  "are inflated.", ""]
    lines += [
        "| path | P50 ms | P90 ms | P99 ms | max ms | P99/P50 |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for label, xs in (("HTTP, end to end", total), ("in-process engine", local), ("overhead (pairwise)", overhead)):
        p50 = percentile(xs, 50)
        lines.append(f"| {label} | {p50 * ms:.1f} | {percentile(xs, 90) * ms:.1f} | {percentile(xs, 99) * ms:.1f} | "
                     f"{max(xs) * ms:.1f} | {(percentile(xs, 99) / p50) if p50 > 0 else float('nan'):.2f} |")
    lines += ["", "Where the HTTP request's time goes (ms; `answer` holds the compute the in-process row measures):",
              "", "| hop | P50 | P99 | mean |", "|---|--:|--:|--:|"]
    for hop in HOPS:
        xs = [p[hop] for p in pairs]
        lines.append(f"| {hop} | {percentile(xs, 50) * ms:.2f} | {percentile(xs, 99) * ms:.2f} | "
                     f"{statistics.fmean(xs) * ms:.2f} |")
    answer_over = [p["answer"] - p["in_process"] for p in pairs]
    parse50 = percentile([p["parse"] for p in pairs], 50) * ms
    hop = {h: percentile([p[h] for p in pairs], 50) * ms for h in HOPS}
    lines += [
        "", f"`answer` minus the in-process run (the actor's and the relay's own work, paired): P50 "
        f"{percentile(answer_over, 50) * ms:.2f} ms, P99 {percentile(answer_over, 99) * ms:.2f} ms.", "",
        "## Reading the figures", "",
        f"- The ingress's own work is small: validating this body, rendering the chat template and "
        f"tokenizing take {data['parse_cost_s'] * ms:.3f} ms in-process (median of 500), of the `parse` hop's "
        f"{parse50:.2f} ms. The rest of `parse` is reading the body: Serve's replica fetches it from the proxy "
        "with a call of its own (ray.serve's `ASGIReceiveProxy` calls the proxy's `receive_asgi_messages`).",
        f"- What is left is message hops between processes, each a Ray call on this 2-core VM: the proxy to the "
        f"replica and back (`proxy`, {hop['proxy']:.1f} ms), the body ({parse50:.1f} ms), the registry's decision "
        f"(`admit`, {hop['admit']:.1f} ms, one call), the actor call and its first streamed item (`start`, "
        f"{hop['start']:.1f} ms), and the Completion back (within `answer`, "
        f"{percentile(answer_over, 50) * ms:.1f} ms over the compute).",
        "- The in-process run itself varies: its P99/P50 bounds how steady the HTTP path can be on this machine.",
        "",
    ]
    verdicts = [
        ("overhead P50", f"{o50:.1f} ms", f"<= {GOAL_P50_MS:g} ms", o50 <= GOAL_P50_MS),
        ("overhead P99", f"{o99:.1f} ms", f"<= {GOAL_P99_MS:g} ms", o99 <= GOAL_P99_MS),
        ("HTTP P99/P50", f"{tail:.2f}", f"<= {GOAL_TAIL_RATIO}", tail <= GOAL_TAIL_RATIO),
    ]
    lines += ["## Goals", "", "| goal | measured | target | |", "|---|--:|--:|---|"]
    lines += [f"| {g} | {v} | {t} | {'met' if ok else 'missed'} |" for g, v, t, ok in verdicts]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--warm-up", type=int, default=5)
    parser.add_argument("--cache-dir", default=".cache/bench")
    parser.add_argument("--out", default="benchmarks/results/overhead.md")
    parser.add_argument("--quick", action="store_true", help="20 pairs: checks the harness")
    parser.add_argument("--report-only", metavar="RUN_JSON", help="rewrite the report from a saved run")
    args = parser.parse_args(argv)
    args.command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_overhead",
                               *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.pairs = 20
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return measure_and_report(args, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
