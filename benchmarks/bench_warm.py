"""Warm actors against fresh spawns: time to first token, and what each preloaded layer costs.

A fresh spawn starts a Ray worker, imports torch, allocates the model and streams it in
before its request's first token; a warm actor (actors/request_actor.py, `warm_layers=N`)
did all of that ahead of the request, up to its first N layers, and streams the rest once
bound. Two parts, one run, one model (`small`, bf16 by default):

    actors   the caller of the actor (where the ingress stands) times call -> first token:
             a fresh spawn (the request sent right after the spawn call, as the ingress
             does) and warm actors for N from 1 to all layers, each request sent once
             ready() answered; a warm actor's resident set (VmRSS) is read when ready.
             A short prompt (16 tokens) and a balanced one (its prefill takes about as
             long as the load), configurations in rotation.
    http     the app itself, streamed over HTTP: the client's send -> its first text
             delta, with a warm pool of one actor (the policy's N) against none (every
             request a fresh spawn); `X-Request-Tier` says where each ran. Requests
             alternate between one kept client (its connection kept alive, as the SDKs
             keep theirs) and a client built for the request, as every run before
             2026-12-06 timed it: httpx builds an SSL context with each client, even
             for plain HTTP, and that start is counted in its TTFT.

    .venv/bin/python -m benchmarks.bench_warm          # ~6 min; writes benchmarks/results/warm_start.md and .json
    .venv/bin/python -m benchmarks.bench_warm --quick  # 1 repeat, N in {1, all}: checks the harness
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from actors.actor_config import ActorConfig
from actors.actor_names import new_actor_name
from actors.cold_start import warm_layers
from actors.engine import Engine
from actors.events import FinishEvent
from actors.layer_loader import load_zqs
from actors.messages import ActorRequest
from actors.request_actor import spawn
from actors.sampling import SamplingParams
from actors.shard_header import open_zqs
from benchmarks.actor_calls import first_token, wait_gone
from benchmarks.bench_cold_start import balanced_tokens, prepare_model, prompt_of_length
from benchmarks.common import cores, load_average, versions
from benchmarks.run_files import measure_and_report
from benchmarks.warm_report import FRESH, KEPT_CLIENT, NEW_CLIENT, report

log = logging.getLogger("bench_warm")

NAMESPACE = "zeroqueue-bench-warm"
SHORT_TOKENS = 16
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class ActorRun:
    prompt: str
    prompt_tokens: int
    config: str  # FRESH or "warm, N=k"
    warm_layers: int | None
    ttft_s: float  # the caller's call -> the first token reaching it
    ready_s: float | None  # warm: spawn -> ready() answered
    rss_bytes: int | None  # warm: the process's resident set once ready


@dataclass(frozen=True)
class HttpRun:
    pool: str  # "warm pool" | "no pool"
    tier: str  # the X-Request-Tier the app answered
    ttft_s: float  # the client's send -> its first text delta
    client: str = NEW_CLIENT  # KEPT_CLIENT or NEW_CLIENT (runs before 2026-12-06 built one per request)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def run_actor(ray: Any, zqs: Path, config: ActorConfig, prompt: str, prompt_ids: tuple[int, ...],
              num_warm: int | None) -> ActorRun:
    name = new_actor_name("bench-warm")
    spawned = time.time()
    actor = spawn(str(zqs), config, name, warm_layers=num_warm)
    ready_s = rss = None
    if num_warm is not None:
        status = ray.get(actor.ready.remote(120.0), timeout=180)
        ready_s, rss = time.time() - spawned, _rss_bytes(status.pid)
        time.sleep(0.3)  # a request arrives later than the pool filled: nothing of the start is still running
    call = time.time()
    first = first_token(ray, actor.generate.remote(ActorRequest(name, prompt_ids, ONE_TOKEN)))
    wait_gone(ray, name, NAMESPACE)  # not kept hot: it exits after its one request, as a bound or spawned actor does
    label = FRESH if num_warm is None else f"warm, N={num_warm}"
    return ActorRun(prompt, len(prompt_ids), label, num_warm, first - call, ready_s, rss)


def measure_actors(ray: Any, zqs: Path, args: argparse.Namespace, prompts: dict[str, tuple[int, ...]],
                   num_layers: int) -> list[ActorRun]:
    config = ActorConfig(namespace=NAMESPACE, num_cpus=1, load_threads=1, compute_threads=1)
    sweep = [1, num_layers] if args.quick else sorted({1, *range(3, num_layers, 3), num_layers})
    configs: list[int | None] = [None, *sweep]
    runs = []
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]  # drift slows each alike
        for prompt, ids in prompts.items():
            for num_warm in order:
                run = run_actor(ray, zqs, config, prompt, ids, num_warm)
                runs.append(run)
                log.info("repeat %d, %s prompt, %s: TTFT %.3f s", rep + 1, prompt, run.config, run.ttft_s)
    return runs


# ---- the app over HTTP -------------------------------------------------------------


def _app_args(zqs: Path, pool: int, port: int) -> dict:
    return {
        "models": [{"id": "bench", "zqs_path": str(zqs)}],
        "slots": {"kind": "cpu", "num_cpu_slots": 2, "cpu_slot_bytes": 2 << 30},
        # No hot actors: every request is served by a warm actor (bound) or a fresh one, then it exits.
        "policy": {"max_hot_short_actors": 0, "max_hot_long_actors": 0, "num_warm_short_actors": pool,
                   "actor_overhead_bytes": 268435456},
        "actor": {"num_cpus": 1, "load_threads": 1, "compute_threads": 1},
        "namespace": NAMESPACE,
        "warm_refresh_s": 0.2,
    }


def _stream_ttft(client: Any, base: str, prompt_text: str) -> tuple[float, str]:
    """Send -> first text delta on `client` (an httpx.Client); None: a client built for this request, timed."""
    import httpx

    body = {"model": "bench", "max_tokens": 1, "temperature": 0.0, "stream": True,
            "messages": [{"role": "user", "content": prompt_text}]}
    sent = time.time()
    if client is None:
        with httpx.Client(timeout=120) as fresh:  # built after `sent`: its SSL context is counted
            return _first_delta(fresh, base, body, sent)
    return _first_delta(client, base, body, sent)


def _first_delta(client: Any, base: str, body: dict, sent: float) -> tuple[float, str]:
    with client.stream("POST", f"{base}/v1/messages", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                return time.time() - sent, r.headers["X-Request-Tier"]
    raise RuntimeError("the stream ended without a text delta")


def measure_http(ray: Any, zqs: Path, args: argparse.Namespace, prompt_text: str) -> list[HttpRun]:
    import httpx
    from ray import serve

    from serve_app.app import build_app

    port = 8791
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    runs = []
    try:
        for pool, label in ((1, "warm pool"), (0, "no pool")):
            serve.run(build_app(_app_args(zqs, pool, port)), name="bench-warm", route_prefix="/")
            registry = ray.get_actor("zq-registry", namespace=NAMESPACE)
            with httpx.Client(timeout=120) as kept:
                _stream_ttft(kept, base, prompt_text)  # warm-up: the proxy, the ingress, the first actor's page cache
                for k in range(args.repeats * 4):
                    _wait_idle(ray, registry, pool)
                    which = KEPT_CLIENT if k % 2 == 0 else NEW_CLIENT
                    ttft, tier = _stream_ttft(kept if which == KEPT_CLIENT else None, base, prompt_text)
                    runs.append(HttpRun(label, tier, ttft, which))
                    log.info("http, %s, request %d, %s: %s, TTFT %.3f s", label, k + 1, which, tier, ttft)
            serve.delete("bench-warm")
    finally:
        serve.shutdown()
    return runs


def _wait_idle(ray: Any, registry: Any, pool: int, timeout: float = 120.0) -> None:
    """Until the last request's actor is gone and the pool is full (warm, not warming): a quiet start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        actors = ray.get(registry.snapshot.remote()).actors
        if all(a.state == "warm" for a in actors) and len(actors) == pool:
            time.sleep(0.3)
            return
        time.sleep(0.05)
    raise TimeoutError("the app did not settle")


# ---- the run ---------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    import ray

    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    zqs = prepare_model(args.preset, args.dtype, Path(args.cache_dir))
    reader, mconfig, tokenizer = open_zqs(zqs)
    reader.close()
    max_context = mconfig.max_position_embeddings
    # The balanced prompt: prefill ~ the load, both timed in-process on one thread.
    torch.set_num_threads(1)
    t_load = time.perf_counter()
    model, _ = load_zqs(zqs, num_threads=1)
    load_s = time.perf_counter() - t_load
    engine = Engine(model, tokenizer)
    probe = prompt_of_length(tokenizer, max_context, 256)
    for _ in range(2):  # the second is timed: the first pays the kernels' first use
        finish = [e for e in engine.generate(list(probe), ONE_TOKEN) if isinstance(e, FinishEvent)][0]
    prefill_s = finish.first_token_time - finish.compute_start
    balanced = balanced_tokens(len(probe), prefill_s, load_s, 2048)
    prompts = {"short": prompt_of_length(tokenizer, max_context, SHORT_TOKENS),
               "balanced": prompt_of_length(tokenizer, max_context, balanced)}
    del engine, model
    policy_n = {label: warm_layers(mconfig, ActorConfig().initial_load_bytes_per_s,
                                   ActorConfig().prefill_flops_per_s, len(ids)) for label, ids in prompts.items()}
    load_before = load_average()
    ray.init(num_cpus=4, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        actor_runs = measure_actors(ray, zqs, args, prompts, mconfig.num_layers)
        short_text = tokenizer.decode(list(prompts["short"]))
        http_runs = [] if args.no_http else measure_http(ray, zqs, args, short_text)
    finally:
        ray.shutdown()
    meta = {"command": args.command, "started": started, "elapsed_s": time.perf_counter() - t0,
            "load_before": load_before, "load_after": load_average(), "cores": cores(), **versions("torch"),
            "preset": args.preset,
            "dtype": args.dtype, "num_layers": mconfig.num_layers, "weight_bytes": mconfig.weight_bytes(),
            "load_s": load_s, "prefill_256_s": prefill_s, "prompt_tokens": {k: len(v) for k, v in prompts.items()},
            "policy_n": policy_n, "repeats": args.repeats}
    return {"meta": meta, "actors": [asdict(r) for r in actor_runs], "http": [asdict(r) for r in http_runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-http", action="store_true", help="the actors part only")
    parser.add_argument("--cache-dir", default=".cache/bench")
    parser.add_argument("--out", default="benchmarks/results/warm_start.md")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--report-only", metavar="RUN_JSON", help="rewrite the report from a saved run")
    args = parser.parse_args(argv)
    args.command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_warm",
                               *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.repeats = 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return measure_and_report(args, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
