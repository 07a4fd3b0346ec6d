"""Cold time to first token on request actors: layer-streamed loading against load-then-compute.

Every run spawns a fresh detached `RequestActor` (the deployment's code path) and sends
it its request at once, as the ingress does; the actor's own `Timings` give the
breakdown. Three start conditions, same process, same loader, same threads; only the
number N of layers resident before prefill starts differs:

    streamed, derived N   first_layers=None: N from the measured load and compute rates
    streamed, N=1         prefill starts once layer 0 is resident
    load-then-compute     N = num_layers, the baseline

Each actor then serves the same prompt again, hot (its prefill time, and hot TTFT), and
the driver runs it once more in-process on the same threads (hot TTFT's reference).
First the driver times the load in-process and one calibration actor times prefill hot,
to size the prompts: short (16 tokens, load-bound), balanced (prefill takes as long as
the load), and compute-bound (twice the balanced length).

    .venv/bin/python -m benchmarks.bench_cold_start          # ~12 min (100 actors); writes benchmarks/results/cold_start.md
    .venv/bin/python -m benchmarks.bench_cold_start --quick  # bf16 only, 2 repeats, for development
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from actors.cold_start import choose_first_layers, estimate_prefill_layer_seconds
from actors.engine import Engine, FinishEvent, GenerationRequest, Message, build_prompt
from actors.layer_loader import stream_zqs
from actors.request_actor import (
    ActorConfig,
    ActorRequest,
    Completion,
    TextChunk,
    Timings,
    new_actor_name,
    spawn,
)
from actors.sampling import SamplingParams
from actors.tokenizer import Tokenizer
from benchmarks.loader_storage import evict
from weights_tool.pack import pack
from weights_tool.synth import synthesize

log = logging.getLogger("bench_cold_start")

NAMESPACE = "zeroqueue-bench-cold-start"
DERIVED, FIRST_ONE, BASELINE = "streamed, derived N", "streamed, N=1", "load-then-compute"
MODES = (DERIVED, FIRST_ONE, BASELINE)
PAGE_CACHE, EVICTED = "page cache", "evicted"
SHORT_TOKENS = 16
BALANCED_WITHIN = 1.5  # load and prefill within this factor of each other: "balanced"
GOAL_OVERLAP = 1.2
GOAL_VS_BASELINE = 0.6
GOAL_HOT = 1.10
# Clock check: without an offset, layer 0's compute starts within a millisecond or two of
# the last layer becoming resident when N = num_layers; anything above this is a clock offset.
MAX_CLOCK_SKEW_S = 0.02
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
    if not zqs.is_file():  # pack writes atomically
        zqs.parent.mkdir(parents=True, exist_ok=True)
        pack(ckpt, zqs)
    return zqs.resolve()


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


@dataclass(frozen=True)
class Run:
    model: str
    prompt: str  # "short" | "balanced" | "compute-bound"
    prompt_tokens: int
    mode: str
    storage: str
    first_layers: int  # N the actor used
    spawn: float  # epoch seconds of the spawn call (the request was sent right after)
    loading_at: float  # the actor's LOADING transition: the stream has started
    client_first_chunk: float  # the first token reached the driver
    cold: Timings
    hot_call: float
    hot_client_first_chunk: float
    hot: Timings


@dataclass(frozen=True)
class InProcess:
    """Hot TTFT's reference: the driver's own `Engine`, same prompt and threads, after a warm-up."""

    model: str
    prompt: str
    ttft: float  # generate() called -> first token
    prefill: float  # compute start -> first token


def _consume(ray: Any, gen: Any) -> tuple[Completion, float]:
    """Drain one actor stream; (its Completion, when the first TextChunk reached the driver)."""
    first_chunk, completion = None, None
    for ref in gen:
        item = ray.get(ref)
        if isinstance(item, TextChunk) and first_chunk is None:
            first_chunk = time.time()
        elif isinstance(item, Completion):
            completion = item
    if completion is None or first_chunk is None:
        raise RuntimeError("the actor's stream ended without a token and a Completion")
    return completion, first_chunk


def _wait_gone(ray: Any, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"actor {name} still alive {timeout} s after its release")


def _kill(ray: Any, actor: Any) -> None:
    try:
        ray.kill(actor)
    except Exception:  # already gone: the normal case
        pass


def run_actor(ray: Any, zqs: Path, config: ActorConfig, model: str, prompt: str, prompt_ids: tuple[int, ...],
              mode: str, storage: str) -> Run:
    """One fresh actor: the request sent right after the spawn (cold), then again (hot), then released."""
    if storage == EVICTED:
        evict(zqs)
    name = new_actor_name(model.replace(" ", "-"))
    spawned = time.time()
    actor = spawn(str(zqs), config, name)
    try:
        cold_request = ActorRequest(f"{name}-cold", prompt_ids, GREEDY_ONE, keep_hot=True)
        cold, cold_first = _consume(ray, actor.generate.remote(cold_request))
        loading_at = dict(ray.get(actor.status.remote()).transitions)["LOADING"]
        hot_call = time.time()
        hot, hot_first = _consume(ray, actor.generate.remote(replace(cold_request, request_id=f"{name}-hot")))
        ray.get(actor.release.remote())
        _wait_gone(ray, name)
    finally:
        _kill(ray, actor)
    return Run(model, prompt, len(prompt_ids), mode, storage, cold.first_layers, spawned, loading_at, cold_first,
               cold.timings, hot_call, hot_first, hot.timings)


def actor_config(args: argparse.Namespace, cal: Calibration, mode: str) -> ActorConfig:
    first_layers = {DERIVED: None, FIRST_ONE: 1, BASELINE: cal.num_layers}[mode]
    return ActorConfig(
        namespace=NAMESPACE, num_cpus=1, load_threads=args.load_threads, compute_threads=args.compute_threads,
        first_layers=first_layers, prefill_flops_per_s=cal.prefill_flops_per_s,
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
class Calibration:
    """What sizes the prompts and feeds the derived N: the load in-process, prefill on a hot actor."""

    model: str
    dtype: str
    num_layers: int
    num_params: int
    weight_bytes: int
    file_bytes: int
    load_s: float  # in-process: stream_zqs called -> every group resident, load_threads threads
    init_s: float  # of which: header, tokenizer, allocation, threads started
    load_bytes_per_s: float  # LayerStream.throughput(): weight bytes / streaming seconds
    prompts: dict[str, int]  # label -> tokens
    prefill_s: dict[str, float]  # label -> prefill seconds on the hot calibration actor
    prefill_flops_per_s: float
    expected_n: dict[str, int]  # label -> choose_first_layers with the rates above


@dataclass(frozen=True)
class LoadProbe:
    engine: Engine  # the last loaded model, kept for the in-process hot TTFT
    load_s: float
    init_s: float
    load_bytes_per_s: float


def _in_process_ttft(engine: Engine, prompt: tuple[int, ...]) -> tuple[float, float]:
    """(generate() called -> first token, compute start -> first token) for one greedy token."""
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
                            cpu_nice=args.cpu_nice)
    name = new_actor_name(f"{preset}-calibration")
    actor = spawn(str(zqs), actor_cfg, name)

    def prefill(tokens: int, repeats: int) -> float:
        prompt = prompt_of_length(engine.tokenizer, engine.max_context, tokens)
        seconds = []
        for k in range(repeats):
            request = ActorRequest(f"{name}-{tokens}-{k}", prompt, GREEDY_ONE, keep_hot=True)
            t = _consume(ray, actor.generate.remote(request))[0].timings
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
        _wait_gone(ray, name)
    finally:
        _kill(ray, actor)

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


# ---- arithmetic ---------------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.3f} ({self.low:.3f}–{self.high:.3f})"


def summarize(values: Iterable[float]) -> Stat:
    values = list(values)
    if not values:
        raise ValueError("no values to summarize")
    return Stat(statistics.median(values), min(values), max(values))


def overlap_efficiency(cold_ttft_s: float, load_s: float, prefill_s: float) -> float:
    """Cold TTFT over its lower bound: neither loading nor prefill can finish sooner on their own."""
    bound = max(load_s, prefill_s)
    if bound <= 0:
        raise ValueError(f"load ({load_s}) or prefill ({prefill_s}) must take some time")
    return cold_ttft_s / bound


def regime(load_s: float, prefill_s: float, within: float = BALANCED_WITHIN) -> str:
    if load_s > within * prefill_s:
        return "load-bound"
    if prefill_s > within * load_s:
        return "compute-bound"
    return "balanced"


def stream_clock_offset(runs: Iterable[Run]) -> float:
    """Median of (layer-0 compute start - last layer resident) over load-then-compute runs.

    With N = num_layers compute waits for the last layer, so this is ~0 when the actor's
    resident times share its clock; a positive value is an offset of its stream clock.
    """
    gaps = [r.cold.first_layer_compute_start - r.cold.all_layers_resident for r in runs if r.mode == BASELINE]
    return statistics.median(gaps) if gaps else 0.0


def metrics(run: Run, shift: float) -> dict[str, float]:
    """Seconds per phase of one run; `shift` is added to the actor's resident times (clock fix)."""
    c, h = run.cold, run.hot
    return {
        "process_start": c.actor_start - run.spawn,
        "init": run.loading_at - c.actor_start,
        "first_layer": c.first_layer_resident + shift - c.actor_start,
        "load": c.all_layers_resident + shift - c.actor_start,
        "compute_start": c.first_layer_compute_start - c.actor_start,
        "ttft": c.first_token - c.actor_start,
        "cold_prefill": c.first_token - c.first_layer_compute_start,
        "client_ttft": run.client_first_chunk - run.spawn,
        "hot_prefill": h.first_token - h.compute_start,
        "hot_before_compute": h.compute_start - h.request_arrival,
        "hot_actor": h.first_token - h.request_arrival,
        "hot_client": run.hot_client_first_chunk - run.hot_call,
    }


@dataclass(frozen=True)
class Row:
    model: str
    prompt: str
    prompt_tokens: int
    storage: str
    mode: str
    regime: str
    first_layers: tuple[int, ...]
    stats: dict[str, Stat]
    load_ref: float  # median load of the group's load-then-compute runs
    prefill_ref: float  # median hot prefill of the group
    efficiency: float
    vs_baseline: float


def rows(runs: list[Run], shift_by_run: dict[int, float]) -> list[Row]:
    """One row per (model, prompt, storage, mode), with the group's references beside it."""
    measured = [(r, metrics(r, shift_by_run[i])) for i, r in enumerate(runs)]
    out = []
    groups = dict.fromkeys((r.model, r.prompt, r.storage) for r in runs)
    for model, prompt, storage in groups:
        group = [(r, m) for r, m in measured if (r.model, r.prompt, r.storage) == (model, prompt, storage)]
        baseline = [m for r, m in group if r.mode == BASELINE]
        load_ref = statistics.median(m["load"] for m in baseline)
        prefill_ref = statistics.median(m["hot_prefill"] for _, m in group)
        base_ttft = statistics.median(m["ttft"] for m in baseline)
        for mode in MODES:
            ms = [m for r, m in group if r.mode == mode]
            if not ms:
                continue
            stats = {k: summarize(m[k] for m in ms) for k in ms[0]}
            out.append(Row(model, prompt, group[0][0].prompt_tokens, storage, mode, regime(load_ref, prefill_ref),
                           tuple(sorted({r.first_layers for r, _ in group if r.mode == mode})), stats, load_ref,
                           prefill_ref, overlap_efficiency(stats["ttft"].median, load_ref, prefill_ref),
                           stats["ttft"].median / base_ttft))
    return out


def clock_shifts(runs: list[Run]) -> tuple[float, dict[int, float]]:
    """(the detected offset, the shift per run) that puts resident times on the actor's clock.

    The actor maps its stream's times to epoch seconds from a clock read before it opens
    the file, so they come out early by the runtime init (header, tokenizer, allocation);
    when the clock check finds that offset, each run is shifted by its own init.
    """
    offset = stream_clock_offset(r for r in runs if r.storage == PAGE_CACHE)
    if offset <= MAX_CLOCK_SKEW_S:
        return offset, dict.fromkeys(range(len(runs)), 0.0)
    return offset, {i: r.loading_at - r.cold.actor_start for i, r in enumerate(runs)}


# ---- the report -------------------------------------------------------------------


def _busy_warning(meta: dict[str, Any]) -> str:
    # At the end the run's own actors count (up to 2); before it, the load is everyone else's.
    before = float(meta["load_before"].split(" / ")[0])
    if before < 0.5:
        return ""
    return (f". **Other jobs were using this machine** (1-minute load {before:.2f} before the run, on "
            f"{meta['cores']} cores): every figure is noisier, and the streamed modes, which need both cores at once, "
            "suffer most")


def _verdict(value: float, goal: float) -> str:
    if value <= goal:
        return f"**met** ({value:.3f} ≤ {goal})"
    return f"**missed** by {value / goal - 1:.1%} ({value:.3f} > {goal})"


def _why_overlap_missed(row: Row) -> str:
    s = {k: v.median for k, v in row.stats.items()}
    bound = max(row.load_ref, row.prefill_ref)
    return (f"cold TTFT {s['ttft']:.3f} s against max(load {row.load_ref:.3f}, prefill {row.prefill_ref:.3f}) = "
            f"{bound:.3f} s: layer-0 compute started {s['compute_start']:.3f} s after process start (init "
            f"{s['init']:.3f} s, then the embeddings and the first {'/'.join(map(str, row.first_layers))} layer(s)); "
            f"the cold prefill took {s['cold_prefill']:.3f} s against {row.prefill_ref:.3f} s hot (the difference is "
            f"waiting on layers and sharing the memory bus with decompression); the last layer was resident at "
            f"{s['load']:.3f} s, {s['ttft'] - s['load']:.3f} s before the first token")


def report(data: dict[str, Any]) -> str:
    meta = data["meta"]
    cals = [Calibration(**c) for c in data["calibrations"]]
    runs = [_run_from_dict(r) for r in data["runs"]]
    offset, shifts = clock_shifts(runs)
    table = rows(runs, shifts)
    lines = [
        "# Cold start: layer-streamed loading against load-then-compute",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Run {meta['started']}, {meta['elapsed_s'] / 60:.1f} minutes in all.",
        "",
        "## Machine and setup",
        "",
        f"- {meta['cores']} cores ({meta['cpu']}), {meta['mem_gib']:.1f} GiB RAM; Python {meta['python']}, "
        f"torch {meta['torch']}, Ray {meta['ray']}",
        f"- load average (1/5/15 min): {meta['load_before']} at the start, {meta['load_after']} at the end"
        + _busy_warning(meta),
        f"- threads: each actor (and the driver's in-process runs) streams with {meta['load_threads']} loader "
        f"thread(s) and computes with {meta['compute_threads']} torch thread(s): loading and prefill each get "
        f"their share of the {meta['cores']} cores, as they would on a CPU slot; actors run at nice "
        f"{meta['cpu_nice']}",
        f"- Ray: one local cluster (`ray.init(num_cpus=4)`), one fresh detached `RequestActor` per run "
        f"(num_cpus=1), sent its request right after the spawn call, as the ingress does; {meta['repeats']} "
        f"runs per mode and prompt, the modes' order rotated each repeat, after one calibration actor per model",
        "- requests: a chat prompt of repeated English text, greedy, max_tokens=1; then the same request again on "
        "the now hot actor (keep_hot); and, once per prompt and repeat, in the driver on its own `Engine` "
        "(same threads, after a warm-up)",
        "- storage: after the first read the `.zqs` file sits in the page cache, so 'page cache' rows measure "
        "decompression, not the disk; 'evicted' rows drop the file from the page cache (posix_fadvise "
        "DONTNEED) before the spawn (the Python and torch files stay cached)",
        "",
        "| model | dtype | params | layers | weights | `.zqs` file |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for c in cals:
        lines.append(f"| {c.model} | {c.dtype} | {c.num_params / 1e6:.1f} M | {c.num_layers} | "
                     f"{c.weight_bytes / 1e6:.0f} MB | {c.file_bytes / 1e6:.0f} MB |")
    lines += [
        "",
        "## Calibration (before the measured actors, same threads)",
        "",
        "Load: in the driver before Ray starts, `stream_zqs` called → every group resident (init: header, "
        "tokenizer, allocation). Prefill: on one hot calibration actor (load-then-compute, also the run's "
        "warm-up), compute start → first token, so that prompts are sized by the actors' own speed. The "
        "balanced prompt is the length whose prefill takes as long as the load. N: `choose_first_layers` "
        "with these rates, which are also the measured actors' `initial_load_bytes_per_s` and "
        "`prefill_flops_per_s`.",
        "",
        "| model | load s | of which init s | stream GB/s | prefill GFLOP/s | prompt | tokens | prefill s | regime | N |",
        "|---|--:|--:|--:|--:|---|--:|--:|---|--:|",
    ]
    for c in cals:
        for k, tokens in c.prompts.items():
            lines.append(f"| {c.model} {c.dtype} | {c.load_s:.3f} | {c.init_s:.3f} | {c.load_bytes_per_s / 1e9:.2f} | "
                         f"{c.prefill_flops_per_s / 1e9:.1f} | {k} | {tokens} | {c.prefill_s[k]:.3f} | "
                         f"{regime(c.load_s, c.prefill_s[k])} | {c.expected_n[k]} |")
    lines += [
        "",
        "## Cold TTFT, broken down",
        "",
        "Seconds from the actor's process start (`actor_start`: its `__init__` began, after Ray started the "
        "worker and it imported torch), median (min–max) over the runs; spawn → start is the Ray process "
        "start itself, reported apart. Layer 0 resident comes after the embeddings (the first group).",
        "",
        "| model | prompt | storage | mode | N | spawn → start | init | layer 0 resident | all resident | "
        "layer-0 compute | first token |",
        "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in table:
        s = r.stats
        lines.append(f"| {r.model} | {r.prompt} | {r.storage} | {r.mode} | {'/'.join(map(str, r.first_layers))} | "
                     f"{s['process_start']} | {s['init']} | {s['first_layer']} | {s['load']} | "
                     f"{s['compute_start']} | {s['ttft']} |")
    lines += [
        "",
        "## Overlap",
        "",
        "Cold TTFT = first token − process start. Load = all resident − process start, the median of the "
        "load-then-compute runs (nothing computes while they load); prefill = the hot request's compute start "
        "→ first token, median over the group. Overlap efficiency = cold TTFT ÷ max(load, prefill); 1.0 is "
        "perfect overlap. The last column is what the client saw: spawn call → first token received.",
        "",
        "| model | prompt (tokens) | regime | storage | mode | cold TTFT | load | prefill (hot) | overlap "
        "efficiency | ÷ load-then-compute | spawn → first token at client |",
        "|---|---|---|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in table:
        lines.append(f"| {r.model} | {r.prompt} ({r.prompt_tokens}) | {r.regime} | {r.storage} | {r.mode} | "
                     f"{r.stats['ttft'].median:.3f} | {r.load_ref:.3f} | {r.prefill_ref:.3f} | "
                     f"**{r.efficiency:.2f}** | **{r.vs_baseline:.2f}** | {r.stats['client_ttft']} |")
    lines += [
        "",
        "## Hot TTFT",
        "",
        "The same request on the hot actor (its weights resident): the actor's request arrival → first token, "
        "and the client's call → first token received; in-process: the driver's `Engine.generate()` call → "
        "first token, after a warm-up, once per prompt and repeat (after that repeat's actors). The ratio is "
        "of the medians.",
        "",
        "| model | prompt (tokens) | actor: arrival → first token | of which arrival → compute start | "
        "client: call → first token | in-process: call → first token | actor ÷ in-process |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    hot = hot_rows(runs, [InProcess(**p) for p in data["in_process"]])
    for h in hot:
        lines.append(f"| {h.model} | {h.prompt} ({h.prompt_tokens}) | {h.actor} | {h.actor_before_compute} | "
                     f"{h.client} | {h.in_process} | **{h.ratio:.3f}** |")
    lines += ["", *_goals(table, hot), "", *_accelerator(cals), "", "## Notes", ""]
    if offset > MAX_CLOCK_SKEW_S:
        mean_shift = statistics.mean(shifts.values())
        lines.append(
            f"- **Clock correction.** In the load-then-compute runs layer 0's compute started a median "
            f"{offset * 1e3:.0f} ms after the actor's reported 'all resident' time, though it waits for the last layer: the actor "
            f"maps its stream's times to epoch seconds from a clock read before it opens the file "
            f"(`RequestActor.__init__` sets `_epoch_at_stream_start` before `stream_zqs`), so resident times come "
            f"out early by the runtime init. Every resident time above is shifted by its run's own init "
            f"(mean {mean_shift * 1e3:.0f} ms; the LOADING transition − actor_start).")
    else:
        lines.append(f"- Clock check: in the load-then-compute runs layer 0's compute started a median "
                     f"{offset * 1e3:.1f} ms after the last layer was resident: the actor's resident times and its "
                     "compute times share one clock; no correction applied.")
    same = [(d, o) for d in table for o in table if d.mode == DERIVED and o.mode == FIRST_ONE
            and (d.model, d.prompt, d.storage) == (o.model, o.prompt, o.storage) and d.first_layers == (1,)]
    if same:
        lines.append("- Where the derived N came out 1, 'streamed, derived N' and 'streamed, N=1' ran the same "
                     "configuration, so the gap between their cold TTFTs is run-to-run noise: " + "; ".join(
                         f"{d.model} {d.prompt} {d.stats['ttft'].median:.3f} vs {o.stats['ttft'].median:.3f} s"
                         for d, o in same) + ".")
    lines += [
        "- The derived N is chosen by the actor per request from its stream's throughput so far and the "
        "calibrated prefill rate; the table lists every N the runs used.",
        "- Raw per-run timings: the JSON file named in the log of the run (under `.cache/bench/cold_start/`); "
        "`--report-only RUN_JSON` rewrites this report from it.",
        "",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class HotRow:
    model: str
    prompt: str
    prompt_tokens: int
    actor: Stat  # the hot actor: request arrival -> first token
    actor_before_compute: Stat  # request arrival -> compute start
    actor_prefill: Stat  # compute start -> first token
    client: Stat  # the driver: generate.remote() -> first token received
    in_process: Stat
    in_process_prefill: Stat

    @property
    def ratio(self) -> float:
        return self.actor.median / self.in_process.median


def hot_rows(runs: list[Run], in_process: list[InProcess]) -> list[HotRow]:
    out = []
    for model, prompt in dict.fromkeys((r.model, r.prompt) for r in runs if r.storage == PAGE_CACHE):
        ms = [metrics(r, 0.0) for r in runs if (r.model, r.prompt, r.storage) == (model, prompt, PAGE_CACHE)]
        ref = [p for p in in_process if (p.model, p.prompt) == (model, prompt)]
        tokens = next(r.prompt_tokens for r in runs if (r.model, r.prompt) == (model, prompt))
        out.append(HotRow(model, prompt, tokens, *(summarize(m[k] for m in ms) for k in (
            "hot_actor", "hot_before_compute", "hot_prefill", "hot_client")),
            summarize(p.ttft for p in ref), summarize(p.prefill for p in ref)))
    return out


def _goals(table: list[Row], hot: list[HotRow]) -> list[str]:
    lines = ["## Goals", "", f"**Overlap efficiency ≤ {GOAL_OVERLAP}** (streamed rows, page cache):", ""]
    for r in table:
        if r.mode == BASELINE or r.storage != PAGE_CACHE:
            continue
        why = "" if r.efficiency <= GOAL_OVERLAP else f" — {_why_overlap_missed(r)}"
        lines.append(f"- {r.model}, {r.prompt} ({r.regime}), {r.mode}: {_verdict(r.efficiency, GOAL_OVERLAP)}{why}")
    lines += ["", f"**Cold TTFT ≤ {GOAL_VS_BASELINE} × load-then-compute where load and prefill take similar "
              "time** (balanced rows; the ideal there is 0.5):", ""]
    balanced = [r for r in table if r.mode != BASELINE and r.regime == "balanced"]
    for r in balanced:
        lines.append(f"- {r.model}, {r.prompt}, {r.storage}, {r.mode}: {_verdict(r.vs_baseline, GOAL_VS_BASELINE)}")
    if not balanced:
        lines.append("- no row came out balanced in this run, so the goal was not tested")
    others = [r for r in table if r.mode == DERIVED and r.regime != "balanced" and r.storage == PAGE_CACHE]
    if others:
        lines += ["", "Elsewhere the gain is bounded by the smaller of the two: " + "; ".join(
            f"{r.model} {r.prompt} ({r.regime}) {r.vs_baseline:.2f}×, at best "
            f"{max(r.load_ref, r.prefill_ref) / (r.load_ref + r.prefill_ref):.2f}×" for r in others) + "."]
    lines += ["", f"**Hot TTFT within {GOAL_HOT - 1:.0%} of the in-process runtime** (actor side):", ""]
    for h in hot:
        extra = (h.actor.median - h.in_process.median) * 1e3
        slower = (h.actor_prefill.median - h.in_process_prefill.median) * 1e3
        lines.append(f"- {h.model}, {h.prompt} ({h.prompt_tokens} tokens): {_verdict(h.ratio, GOAL_HOT)}; the actor "
                     f"{'adds' if extra >= 0 else 'is faster by'} {abs(extra):.1f} ms: "
                     f"{h.actor_before_compute.median * 1e3:.1f} ms from arrival to compute start (a worker thread, "
                     f"the embeddings check, the `Started` event) and a prefill {abs(slower):.1f} ms "
                     f"{'slower' if slower >= 0 else 'faster'} than in-process ({h.actor_prefill.median * 1e3:.1f} "
                     f"against {h.in_process_prefill.median * 1e3:.1f} ms; the actor's compute thread shares the "
                     f"cores with Ray's threads); the client sees {h.client.median * 1e3:.1f} ms, Ray's round trip "
                     "and the relay's stream interval included")
    return lines


def _accelerator(cals: list[Calibration]) -> list[str]:
    lines = [
        "## On an accelerator",
        "",
        "Here loading (zstd decompression into the parameters) and prefill each hold one of the two cores, and "
        "they still meet on the memory bus; a streamed prefill runs slower than a hot one by that contention "
        "and by waits on layers still arriving. On a GPU node:",
        "",
        "- prefill runs on the GPU and no longer competes with decompression: every CPU core can decompress "
        "(the reader's rate scales with threads until storage or PCIe binds), and `CudaLayerStream` copies "
        "each group from pinned staging buffers to HBM on a side stream at ~20+ GB/s, hidden behind the "
        "decompression of the next group;",
        "- prefill becomes far shorter than the load for these shapes (estimates, not measured here):",
    ]
    for c in cals:
        tokens = max(c.prompts.values())
        flops = c.prefill_flops_per_s * c.prefill_s[max(c.prompts, key=c.prompts.get)]
        lines.append(f"  - {c.model} {c.dtype}: {tokens}-token prefill ≈ {flops / 1e12:.2f} TFLOP → ~"
                     f"{flops / 100e12 * 1e3:.1f} ms at 100 TFLOP/s sustained; the load ≈ "
                     f"{c.weight_bytes / (c.load_bytes_per_s * 8) * 1e3:.0f} ms with 8 decompression threads at this "
                     f"machine's per-thread rate, plus ≥ {c.weight_bytes / 20e9 * 1e3:.0f} ms of host → HBM copy "
                     "(overlapped)")
    lines += [
        "- so every row of this table becomes load-bound: cold TTFT → load + one layer's compute after the last "
        "layer lands (well under a millisecond on the GPU), overlap efficiency → 1.0; but the ratio to "
        "load-then-compute, load ÷ (load + prefill), goes to 1 too: there is hardly any prefill left to hide;",
        "- execute-while-load pays on a GPU where the two are comparable again: large models with long prompts "
        "loaded from host memory or fast NVMe (λScale, ServerlessLLM's multi-tier loading). For example, an 8B "
        "model in bf16 (16 GB) copied from host memory at ~20 GB/s takes ~0.8 s, and an 8k-token prefill "
        "(2 × 8e9 × 8192 ≈ 130 TFLOP) ~1.3 s at the same 100 TFLOP/s: balanced, where streaming can save up "
        "to half of the cold TTFT. The decompression side then needs enough cores to keep up with the copy "
        "(here one core decodes at the rate above).",
    ]
    return lines


def _run_from_dict(d: dict[str, Any]) -> Run:
    return Run(**{**d, "cold": Timings(**d["cold"]), "hot": Timings(**d["hot"])})


# ---- main ---------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    import ray

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    return {"cores": os.cpu_count(), "cpu": cpu, "mem_gib": mem_kb / 2**20, "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__}


def _load_avg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    started, t0, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter(), _load_avg()
    torch.set_num_threads(args.compute_threads)
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
                                    storage)
                    runs.append(run)
                    log.info("%s, block %d/%d: %s %s %s, N=%d: cold TTFT %.3f s", label, k + 1, len(blocks), prompt,
                             storage, mode, run.first_layers, run.cold.first_token - run.cold.actor_start)
                if storage == PAGE_CACHE:
                    _in_process_ttft(engine, prompts[prompt])  # warm-up: the driver's model sat idle
                    in_process.append(InProcess(label, prompt, *_in_process_ttft(engine, prompts[prompt])))
    finally:
        ray.shutdown()
    meta = {"command": args.command, "started": started, "elapsed_s": time.perf_counter() - t0,
            "load_before": load_before, "load_after": _load_avg(), "load_threads": args.load_threads,
            "compute_threads": args.compute_threads, "cpu_nice": args.cpu_nice, "repeats": args.repeats,
            **_machine()}
    return {"meta": meta, "calibrations": [asdict(c) for c in calibrations], "runs": [asdict(r) for r in runs],
            "in_process": [asdict(p) for p in in_process]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small:bfloat16,small:float32", help="preset:dtype, comma-separated")
    parser.add_argument("--prompts", default="short,balanced,compute-bound")
    parser.add_argument("--repeats", type=int, default=5, help="cold actors per mode and prompt")
    parser.add_argument("--evicted-repeats", type=int, default=2, help="balanced-prompt runs after evicting the file")
    parser.add_argument("--calibration-repeats", type=int, default=3)
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
        raw = Path(args.cache_dir) / "cold_start" / f"run-{time.strftime('%Y%m%d-%H%M%S')}.json"
        raw.write_text(json.dumps(data, indent=1))
        log.info("raw results: %s", raw)
    text = report(data)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
