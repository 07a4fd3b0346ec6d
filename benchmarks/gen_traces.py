"""Record request traces from the real system, for training the scorer.

    .venv/bin/python -m benchmarks.gen_traces --name cpu-small --minutes 4.5 --seed 0

Starts a local Ray cluster and the real Serve app with `configs/serve.yaml`'s arguments
(the demo `small` model on CPU slots) with traces switched on and the rule scorer
deciding, then drives it over HTTP with closed-loop clients in phases of 1 to 6 (see
`drive`): input ~8 to ~1000 tokens and max_tokens 1 to 200 (log-uniform), greedy or
sampled, with or without top_k / top_p. A short request runs alone on the short lane's
idle hot actor, or joins its batch as one more row while it is busy (the higher phases
trace batches of several rows, so the scorer's batch features vary); warm binds and cold
starts come from long-lane prompts (over 512 tokens) and from phases that start by
retiring every actor (the warm pool's refill races the first requests, so some bind a
warm actor and some start cold); when both slots are taken some requests are refused, and
the refusals are traced too. Writes `benchmarks/traces/<name>.jsonl` (schema zq-trace/3,
serve_app/traces.py) and prints how many requests each decision kind took.

Shapes are seeded; the timings are this machine's, whatever else it is doing.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "zq-gen-traces"
PORT = 8799
PHASES = (1, 2, 1, 3, 1, 6)  # concurrency of successive phases
PHASE_S = 20.0
WORDS = ("queue", "latency", "actor", "token", "slot", "memory", "layer", "stream", "decode", "prefill",
         "tail", "burst", "ray", "serve", "model", "weights")

log = logging.getLogger("gen_traces")


def app_args(trace_path: Path, config: Path) -> dict:
    """`configs/serve.yaml`'s app args, with traces on and this run's own namespace."""
    spec = yaml.safe_load(config.read_text())
    args = dict(spec["applications"][0]["args"])
    for model in args["models"]:
        if "demo_dir" in model:
            model["demo_dir"] = str(ROOT / model["demo_dir"])
    args["scorer_path"] = None  # the rule decides while we measure
    args["namespace"] = NAMESPACE
    args["traces"] = {"enabled": True, "path": str(trace_path), "max_bytes": 8 << 20}
    return args


def prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def request_body(rng: random.Random, model: str, tokens_per_word: float) -> dict:
    num_words = max(1, round(log_uniform(rng, 8, 1000) / tokens_per_word))
    body = {"model": model, "max_tokens": round(log_uniform(rng, 1, 200)),
            "messages": [{"role": "user", "content": prompt(rng, num_words)}],
            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["top_p"] = 0.9
    if rng.random() < 0.3:
        body["top_k"] = 40
    return body


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def request_actors(ray) -> list[str]:
    from serve_app.registry import is_request_actor_name

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and is_request_actor_name(a["name"])]


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def retire_hot_actors(ray, client, base: str) -> None:
    """Kill the idle actors (warm ones too), and wait until the registry has forgotten the hot ones."""
    for name in request_actors(ray):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass

    def free() -> bool:
        h = client.get(f"{base}/health").json()  # warm actors of the refilled pool may be there already
        return not any(h["actors"].get(state) for state in ("starting", "busy", "idle"))

    # The registry forgets a vanished actor once its spawn grace (10 s) is over.
    wait_until(free, 30)


def tokens_per_word(client, base: str, model: str) -> float:
    """Prompt tokens per word of `prompt()` (chat template included), from count_tokens."""
    rng = random.Random(1)
    counts = []
    for num_words in (10, 400):
        r = client.post(f"{base}/v1/messages/count_tokens",
                        json={"model": model, "messages": [{"role": "user", "content": prompt(rng, num_words)}]})
        counts.append(r.json()["input_tokens"])
    return (counts[1] - counts[0]) / 390


def drive(base: str, model: str, ray, minutes: float, seed: int, max_bytes: int, trace_path: Path) -> Counter:
    """Phases of `concurrency` closed-loop clients (`PHASES`, repeated), each `PHASE_S` long.

    Each phase at concurrency 1 starts by retiring the hot actor, so its first request is
    cold. A refused client waits out its retry-after before sending again.
    """
    import httpx

    counts: Counter = Counter()
    deadline = time.monotonic() + minutes * 60
    client = httpx.Client(timeout=120)
    ratio = tokens_per_word(client, base, model)
    log.info("%.2f prompt tokens per word", ratio)
    lock = threading.Lock()
    for phase in range(10_000):
        now = time.monotonic()
        if now >= deadline or _size(trace_path) >= max_bytes:
            break
        concurrency = PHASES[phase % len(PHASES)]
        if concurrency == 1:
            retire_hot_actors(ray, client, base)
            counts["retirements"] += 1
        phase_end = min(deadline, time.monotonic() + PHASE_S)

        def client_loop(worker: int, phase=phase, phase_end=phase_end) -> None:
            rng = random.Random(f"{seed}/{phase}/{worker}")
            while time.monotonic() < phase_end:
                try:
                    r = client.post(f"{base}/v1/messages", json=request_body(rng, model, ratio))
                    status, retry_after = r.status_code, float(r.headers.get("retry-after", 0) or 0)
                except httpx.HTTPError:
                    status, retry_after = 0, 1.0
                with lock:
                    counts[f"http_{status}"] += 1
                if status != 200:
                    time.sleep(min(retry_after, 2.0) or 0.5)

        threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counts[f"phases_at_{concurrency}"] += 1
    return counts


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _lines(path: Path) -> int:
    return sum(1 for _ in open(path)) if path.exists() else 0


def decision_kinds(path: Path) -> Counter:
    """Requests per decision kind (dispatch, join, bind, spawn, reject) in a trace file."""
    from serve_app.traces import read_traces

    return Counter((r.get("decision") or {}).get("kind") for r in read_traces([path]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="cpu-small")
    parser.add_argument("--minutes", type=float, default=4.5, help="time spent sending requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-kb", type=int, default=400, help="stop once the trace file is this large")
    parser.add_argument("--config", default=str(ROOT / "configs" / "serve.yaml"))
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "traces"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import httpx
    import ray
    from ray import serve

    from serve_app.app import build_app

    work = Path(tempfile.mkdtemp(prefix="zq-traces-"))
    trace_path = work / "traces.jsonl"
    args_dict = app_args(trace_path, Path(args.config))
    model = args_dict["models"][0]["id"]
    started = time.monotonic()
    ray.init(num_cpus=8, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(args_dict), name="zeroqueue", route_prefix="/")
        base = f"http://127.0.0.1:{PORT}"
        log.info("app up after %.0f s; driving for %.1f min", time.monotonic() - started, args.minutes)
        counts = drive(base, model, ray, args.minutes, args.seed, args.max_kb * 1024, trace_path)
        sent = sum(v for k, v in counts.items() if k.startswith("http_"))
        # Every request leaves one line, written by the ingress's writer thread just after it ends.
        if not wait_until(lambda: _lines(trace_path) >= sent, 30):
            log.warning("%d requests sent but %d trace lines written", sent, _lines(trace_path))
        health = httpx.get(f"{base}/health", timeout=10).json()
        log.info("dispatch latency µs: %s", health["dispatch_latency_us"])
        serve.delete("zeroqueue")
        serve.shutdown()
        for name in request_actors(ray):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    finally:
        ray.shutdown()
    out = Path(args.out_dir) / f"{args.name}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trace_path, out)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}: {_lines(out)} lines, "
          f"{_size(out) // 1024} KB, {time.monotonic() - started:.0f} s; {dict(sorted(counts.items()))}; "
          f"decisions {dict(sorted(decision_kinds(out).items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
