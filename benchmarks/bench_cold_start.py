"""Cold time to first token on request actors: layer-streamed loading against load-then-compute.

Every run spawns a fresh detached `RequestActor` (the deployment's code path) and sends
it its request at once, as the ingress does; the actor's own `Timings` give the
breakdown. Three start conditions, same process, same loader, same threads; only what
must be resident before prefill starts differs:

    streamed, derived N   first_layers=None: N from the measured load and compute rates
    streamed, N=1         prefill starts once layer 0 is resident
    load-then-compute     every group (is_load_then_compute), the baseline

Each actor then serves the same prompt again, hot (its prefill time, and hot TTFT), and
the driver runs it once more in-process on the same threads (hot TTFT's reference).
First the driver times the load in-process and one calibration actor times prefill hot,
to size the prompts: short (16 tokens, load-bound), balanced (prefill takes as long as
the load), and compute-bound (twice the balanced length).

    .venv/bin/python -m benchmarks.bench_cold_start          # ~13 min (100 actors); writes benchmarks/results/cold_start.md and .json
    .venv/bin/python -m benchmarks.bench_cold_start --quick  # bf16 only, 2 repeats, for development

This module measures; what a run records is `benchmarks.cold_start_runs`, and
`benchmarks.cold_start_report` (statistics, rows, the markdown) and `benchmarks.cold_start_goals`
turn a run's raw JSON into the report.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from actors.actor_config import ActorConfig
from actors.actor_names import new_actor_name
from actors.chat import GenerationRequest, build_prompt
from actors.cold_start import choose_first_layers, estimate_prefill_layer_seconds
from actors.engine import Engine
from actors.events import FinishEvent
from actors.heap import retain_freed_memory
from actors.layer_loader import stream_zqs
from actors.messages import ActorRequest
from actors.request_actor import spawn
from actors.sampling import SamplingParams
from actors.tokenizer import Message, Tokenizer
from benchmarks.actor_calls import consume, kill, wait_gone
from benchmarks.cold_start_report import report
from benchmarks.cold_start_runs import (
    BASELINE,
    DERIVED,
    EVICTED,
    FIRST_ONE,
    MODES,
    PAGE_CACHE,
    Calibration,
    InProcess,
    Run,
)
from benchmarks.common import load_text, machine
from benchmarks.loader_storage import evict
from weights_tool.pack import pack
from weights_tool.reader import ShardReader
from weights_tool.synth import synthesize

log = logging.getLogger("bench_cold_start")

NAMESPACE = "zeroqueue-bench-cold-start"
SHORT_TOKENS = 16
GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0)
_TEXT = ("A request is either computing within a few milliseconds of arrival, or it is refused at once. "
         "It never waits in a queue: not in the proxy, not in the scheduler, not inside an actor. ")


# ---- models and prompts -----------------------------------------------------------


def prepare_model(preset: str, dtype: str, cache: Path) -> Path:
    """Synthesise and pack `preset` once; later runs reuse the files."""
    ckpt = cache / f"{preset}-{dtype}"
    if not (ckpt / "config.json").is_file():  # written last by synthesize: present means complete
        synthesize(preset, ckpt, dtype=dtype)
    zqs = cache / "cold_start" / f"{preset}-{dtype}.zqs"
    if not zqs.is_file() or not _packed_with_defaults(zqs):  # pack writes atomically
        zqs.parent.mkdir(parents=True, exist_ok=True)
        pack(ckpt, zqs)
    return zqs.resolve()


def _packed_with_defaults(zqs: Path) -> bool:
    """A cached file from before the table was stored raw by default is packed again."""
    with ShardReader(zqs) as reader:
        return reader.header.packer.get("raw_embeddings") is True


def prompt_of_length(tokenizer: Tokenizer, max_context: int, num_tokens: int) -> tuple[int, ...]:
    """The longest chat prompt of repeated English text that has at most `num_tokens` tokens."""
    words = (_TEXT * (1 + 2 * num_tokens // len(_TEXT.split()))).split()

    def prompt(n: int) -> list[int]:
        request = GenerationRequest((Message("user", " ".join(words[:n])),), GREEDY_ONE)
        return build_prompt(tokenizer, request, max_context)

    lo, hi = 1, len(words)  # every token is at most one word here, so `words` is long enough
    if len(prompt(lo)) > num_tokens:
        raise ValueError(f"{num_tokens} tokens cannot hold even a one-word chat prompt")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(prompt(mid)) <= num_tokens else (lo, mid - 1)
    return tuple(prompt(lo))


def prefill_flops(num_layers: int, params_per_layer: int, num_heads: int, head_dim: int, prompt_tokens: int) -> float:
    """Prefill FLOPs of the decoder layers, counted as `cold_start` counts them (FLOP/s = this / seconds)."""
    return num_layers * estimate_prefill_layer_seconds(params_per_layer, num_heads, head_dim, prompt_tokens, 1.0)


def balanced_tokens(prompt_tokens: int, prefill_s: float, load_s: float, max_tokens: int) -> int:
    """The prompt length whose prefill takes `load_s`, scaled linearly from one measurement, a multiple of 16."""
    target = prompt_tokens * load_s / prefill_s
    return int(min(max(64, round(target / 16) * 16), max_tokens))


# ---- one cold actor -----------------------------------------------------------------


def run_actor(ray: Any, zqs: Path, config: ActorConfig, model: str, prompt: str, prompt_ids: tuple[int, ...],
              mode: str, storage: str, hot_repeats: int) -> Run:
    """One fresh actor: the request sent right after the spawn (cold), then again (hot) `hot_repeats` times."""
    if storage == EVICTED:
        evict(zqs)
    name = new_actor_name(model.replace(" ", "-"))
    spawned = time.time()
    actor = spawn(str(zqs), config, name)
    try:
        cold_request = ActorRequest(f"{name}-cold", prompt_ids, GREEDY_ONE, keep_hot=True)
        cold, cold_first = consume(ray, actor.generate.remote(cold_request))
        loading_at = dict(ray.get(actor.status.remote()).transitions)["LOADING"]
        hots = []
        for k in range(hot_repeats):
            hot_call = time.time()
            hot, hot_first = consume(ray, actor.generate.remote(replace(cold_request, request_id=f"{name}-hot{k}")))
            hots.append((hot.timings.first_token - hot.timings.request_arrival, hot_call, hot_first, hot))
        # The hot request with the median TTFT stands for this actor: one slow request of a
        # few (a Ray or OS hiccup on a 2-core machine) does not decide the comparison.
        _, hot_call, hot_first, hot = sorted(hots, key=lambda h: h[0])[len(hots) // 2]
        ray.get(actor.release.remote())
        wait_gone(ray, name, NAMESPACE)
    finally:
        kill(ray, actor)
    return Run(model, prompt, len(prompt_ids), mode, storage, cold.first_layers, spawned, loading_at, cold_first,
               cold.timings, hot_call, hot_first, hot.timings)


def actor_config(args: argparse.Namespace, cal: Calibration, mode: str) -> ActorConfig:
    first_layers = {DERIVED: None, FIRST_ONE: 1, BASELINE: cal.num_layers}[mode]
    return ActorConfig(
        namespace=NAMESPACE, num_cpus=1, load_threads=args.load_threads, compute_threads=args.compute_threads,
        first_layers=first_layers, is_load_then_compute=mode == BASELINE, prefill_flops_per_s=cal.prefill_flops_per_s,
        initial_load_bytes_per_s=cal.load_bytes_per_s, cpu_nice=args.cpu_nice,
    )


def schedule(prompts: list[str], repeats: int, evicted_repeats: int) -> list[tuple[str, str, tuple[str, ...]]]:
    """Blocks of (prompt, storage, modes): the modes' order rotates each repeat, so drift slows each alike."""
    blocks = [(prompt, PAGE_CACHE, MODES[rep % 3:] + MODES[:rep % 3]) for rep in range(repeats) for prompt in prompts]
    if "balanced" in prompts:
        pair = (DERIVED, BASELINE)
        blocks += [("balanced", EVICTED, pair[rep % 2:] + pair[:rep % 2]) for rep in range(evicted_repeats)]
    return blocks


# ---- calibration --------------------------------------------------------------------


@dataclass(frozen=True)
class LoadProbe:
    engine: Engine  # the last loaded model, kept for the in-process hot TTFT
    load_s: float
    init_s: float
    load_bytes_per_s: float


def _in_process_ttft(engine: Engine, prompt: tuple[int, ...]) -> tuple[float, float]:
    """(generate() called -> first token, compute start -> first token) for one greedy token.

    Run back to back like an actor's hot requests, well within its idle_trim_after_s: no trim between.
    """
    t0 = time.time()
    finish = [e for e in engine.generate(list(prompt), GREEDY_ONE) if isinstance(e, FinishEvent)][0]
    return finish.first_token_time - t0, finish.first_token_time - finish.compute_start


def probe_load(zqs: Path, args: argparse.Namespace) -> LoadProbe:
    """The load in-process, on the actors' loader threads, before Ray starts its processes."""
    loads, inits, rates = [], [], []
    for _ in range(args.calibration_repeats):
        t0 = time.perf_counter()
        streamed = stream_zqs(zqs, num_threads=args.load_threads)
        t1 = time.perf_counter()
        streamed.wait_all()
        loads.append(time.perf_counter() - t0)
        inits.append(t1 - t0)
        rates.append(streamed.stream.throughput())
        streamed.close()
    engine = Engine(streamed.model, streamed.tokenizer)
    return LoadProbe(engine, statistics.median(loads), statistics.median(inits), statistics.median(rates))


def calibrate(ray: Any, zqs: Path, preset: str, dtype: str, probe: LoadProbe, args: argparse.Namespace) -> Calibration:
    """Prefill timed on a hot actor (the actors' own process and memory), prompts sized to the load.

    The driver's own prefill can run at another speed than an actor's (its model's memory
    has another history), so only the actors' is trusted for sizing. This actor is also
    the run's warm-up: Ray's worker pool, the page cache.
    """
    engine, config = probe.engine, probe.engine.model.config
    actor_cfg = ActorConfig(namespace=NAMESPACE, num_cpus=1, load_threads=args.load_threads,
                            compute_threads=args.compute_threads, first_layers=config.num_layers,
                            is_load_then_compute=True, cpu_nice=args.cpu_nice)
    name = new_actor_name(f"{preset}-calibration")
    actor = spawn(str(zqs), actor_cfg, name)

    def prefill(tokens: int, repeats: int) -> float:
        prompt = prompt_of_length(engine.tokenizer, engine.max_context, tokens)
        seconds = []
        for k in range(repeats):
            request = ActorRequest(f"{name}-{tokens}-{k}", prompt, GREEDY_ONE, keep_hot=True)
            t = consume(ray, actor.generate.remote(request))[0].timings
            seconds.append(t.first_token - t.compute_start)
        return statistics.median(seconds)

    try:
        prefill(SHORT_TOKENS, 1)  # the cold request: it waits for the load
        max_tokens = min(args.max_prompt_tokens, engine.max_context - 8) // 2
        tokens, seconds = 512, prefill(512, args.calibration_repeats)
        for _ in range(2):  # prefill is nearly linear in the prompt at these lengths: two steps suffice
            tokens = balanced_tokens(tokens, seconds, probe.load_s, max_tokens)
            seconds = prefill(tokens, args.calibration_repeats)
        prompts = {"short": SHORT_TOKENS, "balanced": tokens, "compute-bound": 2 * tokens}
        prompts = {k: v for k, v in prompts.items() if k in args.prompts}
        prefill_s = {k: seconds if k == "balanced" else prefill(v, args.calibration_repeats)
                     for k, v in prompts.items()}
        ray.get(actor.release.remote())
        wait_gone(ray, name, NAMESPACE)
    finally:
        kill(ray, actor)

    layer = engine.model.group_parameters(0).values()
    params_per_layer = sum(p.numel() for p in layer)
    layer_bytes = sum(p.numel() * p.element_size() for p in layer)
    flops_per_s = prefill_flops(config.num_layers, params_per_layer, config.num_heads, config.head_dim,
                                tokens) / seconds
    expected_n = {
        k: choose_first_layers(config.num_layers, layer_bytes / probe.load_bytes_per_s, estimate_prefill_layer_seconds(
            params_per_layer, config.num_heads, config.head_dim, v, flops_per_s))
        for k, v in prompts.items()
    }
    cal = Calibration(
        model=preset, dtype=dtype, num_layers=config.num_layers, num_params=config.num_params(),
        weight_bytes=sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        file_bytes=zqs.stat().st_size, load_s=probe.load_s, init_s=probe.init_s,
        load_bytes_per_s=probe.load_bytes_per_s, prompts=prompts, prefill_s=prefill_s,
        prefill_flops_per_s=flops_per_s, expected_n=expected_n,
    )
    log.info("calibrated %s %s: %s", preset, dtype, cal)
    return cal


# ---- main ---------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    started, t0, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter(), load_text()
    torch.set_num_threads(args.compute_threads)
    # The driver's in-process reference runs with the heap the actors use (ActorConfig's default).
    is_retained = ActorConfig().is_freed_memory_retained and retain_freed_memory()
    models = []
    for spec in args.models.split(","):
        preset, dtype = spec.split(":")
        zqs = prepare_model(preset, dtype, Path(args.cache_dir))
        models.append((preset, dtype, zqs, probe_load(zqs, args)))  # before Ray starts its processes
    runs: list[Run] = []
    in_process: list[InProcess] = []
    calibrations: list[Calibration] = []
    ray.init(num_cpus=4, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        for preset, dtype, zqs, probe in models:
            cal = calibrate(ray, zqs, preset, dtype, probe, args)
            calibrations.append(cal)
            label, engine = f"{preset} {dtype}", probe.engine
            prompts = {k: prompt_of_length(engine.tokenizer, engine.max_context, n) for k, n in cal.prompts.items()}
            blocks = schedule(list(prompts), args.repeats, args.evicted_repeats)
            for k, (prompt, storage, modes) in enumerate(blocks):
                for mode in modes:
                    run = run_actor(ray, zqs, actor_config(args, cal, mode), label, prompt, prompts[prompt], mode,
                                    storage, args.hot_repeats)
                    runs.append(run)
                    log.info("%s, block %d/%d: %s %s %s, N=%d: cold TTFT %.3f s", label, k + 1, len(blocks), prompt,
                             storage, mode, run.first_layers, run.cold.first_token - run.cold.actor_start)
                if storage == PAGE_CACHE:
                    _in_process_ttft(engine, prompts[prompt])  # warm-up: the driver's model sat idle
                    in_process += [InProcess(label, prompt, *_in_process_ttft(engine, prompts[prompt]))
                                   for _ in range(args.hot_repeats)]
    finally:
        ray.shutdown()
    meta = {"command": args.command, "started": started, "elapsed_s": time.perf_counter() - t0,
            "load_before": load_before, "load_after": load_text(), "load_threads": args.load_threads,
            "compute_threads": args.compute_threads, "cpu_nice": args.cpu_nice, "repeats": args.repeats,
            "hot_repeats": args.hot_repeats, "is_freed_memory_retained": is_retained,
            "raw_embeddings": all(_packed_with_defaults(zqs) for _, _, zqs, _ in models), **machine("torch", "ray")}
    return {"meta": meta, "calibrations": [asdict(c) for c in calibrations], "runs": [asdict(r) for r in runs],
            "in_process": [asdict(p) for p in in_process]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small:bfloat16,small:float32", help="preset:dtype, comma-separated")
    parser.add_argument("--prompts", default="short,balanced,compute-bound")
    parser.add_argument("--repeats", type=int, default=5, help="cold actors per mode and prompt")
    parser.add_argument("--evicted-repeats", type=int, default=2, help="balanced-prompt runs after evicting the file")
    parser.add_argument("--calibration-repeats", type=int, default=3)
    parser.add_argument("--hot-repeats", type=int, default=3,
                        help="hot requests per actor (the median stands for it), in-process runs per block")
    parser.add_argument("--load-threads", type=int, default=1)
    parser.add_argument("--compute-threads", type=int, default=1)
    parser.add_argument("--cpu-nice", type=int, default=0, help="the actors' nice (the driver runs at 0)")
    parser.add_argument("--max-prompt-tokens", type=int, default=4096)
    parser.add_argument("--cache-dir", default=".cache/bench")
    parser.add_argument("--out", default="benchmarks/results/cold_start.md")
    parser.add_argument("--quick", action="store_true", help="bf16 only, short and balanced prompts, 2 repeats")
    parser.add_argument("--report-only", metavar="RUN_JSON", help="rewrite the report from a saved run")
    args = parser.parse_args(argv)
    args.command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_cold_start",
                               *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.models, args.prompts, args.repeats, args.evicted_repeats, args.calibration_repeats = (
            "small:bfloat16", "short,balanced", 2, 1, 2)
    args.prompts = args.prompts.split(",")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    if args.report_only:
        data = json.loads(Path(args.report_only).read_text())
    else:
        data = measure(args)
        # Beside the report, so the figures can be checked and re-reported; and kept per run.
        raw = Path(args.cache_dir) / "cold_start" / f"run-{time.strftime('%Y%m%d-%H%M%S')}.json"
        raw.write_text(json.dumps(data, indent=1))
        Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1))
        log.info("raw results: %s", raw)
    text = report(data)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
