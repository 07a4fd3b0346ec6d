"""A slot's steps beside other busy processes: two threads, one thread, and the thread governor, in one run.

    .venv/bin/python -m benchmarks.bench_threads           # ~4 min; writes benchmarks/results/threads.md (+ .json)
    .venv/bin/python -m benchmarks.bench_threads --quick   # a harness check; writes .cache/bench/threads/

The model `make serve` serves (SmolLM2-135M-Instruct) through the actors' engine in one process
at the actors' priority (nice 19), as an actor computes it (`compute_dtype: auto`, its weights
packed). Beside it, in turn: nothing; one process busy a share of a core (25, 50, 100%) at nice
0, as Ray's, the ingress's or HAProxy's processes run; one busy all of a core at nice 19, as a
load generator started beside the actors or another slot's actor. In each, three ways to step:
a fixed two threads, a fixed one, and the governor (actors/thread_governor.py: between one and
two, by what the other processes use, sampled every 0.5 s as an actor does).

Per cell: a 128-token prompt's prefill (the median of 3) and decode steps of 1 and 8 rows at
that context (P50 and P90 of 30 steps), after 2 s of steps that let the governor settle.
Contexts are visited in rotation `--repeats` times; each figure is the median over repeats.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_features, load_average, machine, write_report

log = logging.getLogger("bench_threads")
PROMPT_TOKENS = 128
# (name, nice, share of a core it keeps busy); None: nothing beside the steps.
BESIDE = (("nothing", None, 0.0), ("25% of a core, nice 0", 0, 0.25), ("50% of a core, nice 0", 0, 0.5),
          ("a whole core, nice 0", 0, 1.0), ("a whole core, nice 19", 19, 1.0))
MODES = ("2 threads", "1 thread", "governor 1-2")


def _busy(nice: int, share: float) -> subprocess.Popen:
    """A process busy `share` of a core: spins for share x 10 ms, sleeps the rest of each 10 ms."""
    code = (f"import os, time\nos.nice({nice})\n"
            + ("while True: pass" if share >= 1 else
               f"while True:\n t = time.perf_counter()\n while time.perf_counter() - t < {0.01 * share}: pass\n"
               f" time.sleep({0.01 * (1 - share)})"))
    return subprocess.Popen([sys.executable, "-c", code])


class _Stepper:
    """The engine stepped as the batch runner steps it: the governor's adjust() before each step."""

    def __init__(self, zqs: str) -> None:
        from actors.actor_config import ActorConfig
        from actors.engine import Engine
        from actors.layer_loader import load_zqs
        from actors.thread_governor import ThreadGovernor
        from actors.threads import use_threads_here

        model, tokenizer = load_zqs(zqs, num_threads=1, compute_dtype="auto",
                                    is_weight_packed=ActorConfig().is_weight_packed)
        self.engine = Engine(model, tokenizer, max_batch=8, prefill_chunk_tokens=1_000_000)
        self.dtype = str(model.dtype).removeprefix("torch.")
        self._use_threads = use_threads_here
        self._governor_type = ThreadGovernor
        self.governor = None

    def use(self, mode: str) -> None:
        if mode == "governor 1-2":
            self.governor = self._governor_type(1, 2)
            self.governor.start()
        else:
            self.governor = None
            self._use_threads(1 if mode == "1 thread" else 2)

    def step(self) -> None:
        if self.governor is not None:
            self.governor.adjust()
        self.engine.step()

    def prefill_s(self, seed: int) -> float:
        from actors.sampling import SamplingParams
        from benchmarks.bench_batch import raise_errors, random_prompt

        self.engine.add(random_prompt(PROMPT_TOKENS, seed), SamplingParams(max_tokens=1, temperature=0.0),
                        raise_errors)
        t0 = time.perf_counter()
        while self.engine.has_work:
            self.step()
        return time.perf_counter() - t0

    def steps_s(self, batch: int, num_steps: int, settle_s: float) -> list[float]:
        from actors.sampling import SamplingParams
        from benchmarks.bench_batch import raise_errors, random_prompt

        params = SamplingParams(max_tokens=4000, temperature=0.0)  # more steps than a cell takes
        rows = [self.engine.add(random_prompt(PROMPT_TOKENS, i), params, raise_errors) for i in range(batch)]
        t0 = time.monotonic()
        while any(r.num_out == 0 for r in rows) or time.monotonic() - t0 < settle_s:
            self.step()
        times = []
        for _ in range(num_steps):
            t = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t)
        for r in rows:
            self.engine.cancel(r)
        self.step()
        return times


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def measure(zqs: str, repeats: int, num_steps: int, settle_s: float) -> dict:
    os.nice(19)  # the actors' priority (ActorConfig.cpu_nice)
    stepper = _Stepper(zqs)
    cells: dict[str, dict[str, list[dict]]] = {}
    for repeat in range(repeats):
        for name, nice, share in BESIDE:
            proc = _busy(nice, share) if nice is not None else None
            try:
                time.sleep(0.5)
                for mode in MODES:
                    stepper.use(mode)
                    stepper.steps_s(1, 2, settle_s)  # the governor settles beside this neighbour
                    prefill = statistics.median(stepper.prefill_s(seed) for seed in range(3))
                    one, eight = stepper.steps_s(1, num_steps, 0.0), stepper.steps_s(8, num_steps, 0.0)
                    cell = {"prefill_s": prefill, "step1_p50_s": _pct(one, 50), "step1_p90_s": _pct(one, 90),
                            "step8_p50_s": _pct(eight, 50), "step8_p90_s": _pct(eight, 90),
                            "threads_after": stepper.governor.threads if stepper.governor else None}
                    cells.setdefault(name, {}).setdefault(mode, []).append(cell)
                    log.info("repeat %d, beside %s, %s: %s", repeat, name, mode, cell)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    return {"dtype": stepper.dtype, "cells": cells}


def _median_cell(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "threads_after"} | {
        "threads_after": [r["threads_after"] for r in runs]}


def report(data: dict) -> str:
    lines = ["# A slot's steps beside other busy processes: two threads, one, and the thread governor", "",
             f"Command: `{data['command']}`", "",
             f"Machine: {data['cores']} cores, {data['cpu']} ({', '.join(data['cpu_features'])}), "
             f"Python {data['python']}, torch {data['torch']}; load average {data['load_before'][0]:.2f} at the "
             f"start; {data['elapsed_s'] / 60:.1f} min. Nothing else of ours ran meanwhile.", "",
             f"Model: SmolLM2-135M-Instruct as `make serve` packs it, computed in {data['dtype']} (`auto` here), "
             f"in one process at nice 19. Each figure: the median over {data['repeats']} repeats of a 128-token "
             "prefill (median of 3) and of decode steps' P50 / P90 (30 steps), in ms.", "",
             "| beside the steps | threads | prefill 128 | step, 1 row: P50 / P90 | step, 8 rows: P50 / P90 | "
             "governor's threads at the end |", "|---|---|--:|--:|--:|---|"]
    for name, modes in data["cells"].items():
        for mode, runs in modes.items():
            c = _median_cell(runs)
            after = ", ".join(str(t) for t in c["threads_after"]) if mode.startswith("governor") else "—"
            lines.append(f"| {name} | {mode} | {1e3 * c['prefill_s']:.0f} | {1e3 * c['step1_p50_s']:.1f} / "
                         f"{1e3 * c['step1_p90_s']:.1f} | {1e3 * c['step8_p50_s']:.1f} / {1e3 * c['step8_p90_s']:.1f} "
                         f"| {after} |")
    lines += ["", "## The governor against the better fixed count", "",
              "Its time ÷ the faster of two threads and one thread, per context (1.00: it chose as well as the "
              "better fixed count; the prefill and the 8-row step's P90).", ""]
    for name, modes in data["cells"].items():
        cells = {mode: _median_cell(runs) for mode, runs in modes.items()}
        ratios = []
        for key in ("prefill_s", "step8_p90_s"):
            best = min(cells["2 threads"][key], cells["1 thread"][key])
            ratios.append(f"{key.removesuffix('_s').replace('_', ' ')} {cells['governor 1-2'][key] / best:.2f}×")
        lines.append(f"- beside {name}: " + ", ".join(ratios))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zqs", default=".cache/models/smollm2-135m-instruct.zqs")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one repeat of few steps, written under .cache/bench")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not Path(args.zqs).exists():
        print(f"missing {args.zqs}: `make serve` packs it", file=sys.stderr)
        return 2
    repeats, num_steps, settle_s = (1, 8, 1.0) if args.quick else (args.repeats, 30, 2.0)
    out = Path(".cache/bench/threads") if args.quick else Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_threads", *(argv or sys.argv[1:])])
    load, t0 = load_average(), time.monotonic()
    data = measure(args.zqs, repeats, num_steps, settle_s)
    data |= ({"command": command, "elapsed_s": time.monotonic() - t0, "load_before": load, "repeats": repeats}
             | machine("torch") | {"cpu_features": cpu_features()})
    write_report(out, "threads", data, report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
