"""Steps while no row decodes yet: bounded by the prompts' TPOT target, against their prompts whole, in one run.

    .venv/bin/python -m benchmarks.bench_idle_steps           # ~6 min; writes benchmarks/results/idle_steps.md (+ .json)
    .venv/bin/python -m benchmarks.bench_idle_steps --quick   # a harness check; writes .cache/bench/idle_steps/

The model and engine of bench_load's apps (benchmarks/load.yaml: the `small` shape, one torch
thread, its rule constants and TPOT target), in one process. Two ways to plan a step while every
row of the batch is still in its prompt (actors/scheduler.py): *bounded*, the engine's (within
twice the prompts' tightest TPOT target, each chunk past the first one more pass over the
weights), and *whole*, every prompt in one step (the engine's planner before, put back here by
giving it no budget in that case).

1. Behind a long prompt: a 600-token request starts alone on the idle engine and a 24-token one
   arrives 50 ms later, as bench_load's long and short classes. Their TTFTs (from each one's
   arrival to its first token), the median over `--repeats`, the planners alternating.
2. Closed loops: N rows (3, then 12), each replaced by a new request of bench_load's class mix
   the moment it ends, for `--seconds` per run, the planners alternating `--repeats` times:
   requests and output tokens a second. What the bound costs in throughput.
"""

from __future__ import annotations

import argparse
import logging
import random
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import cpu_features, load_average, machine, write_report
from benchmarks.load_scenarios import CLASSES, MIXED, RequestClass
from benchmarks.load_setup import ServedEngine

log = logging.getLogger("bench_idle_steps")
CONFIG = "benchmarks/load.yaml"
PLANNERS = ("bounded", "whole")
JOIN_AFTER_S = 0.05
LOOP_ROWS = (3, 12)


class _Bench(ServedEngine):
    """bench_load's engine, its planner switchable between bounded and whole."""

    def __init__(self) -> None:
        super().__init__(CONFIG)
        self.tpot_target_s = self.targets.tpot_target_s

    def engine(self, planner: str):  # every row runs to max_tokens, as bench_load's requests are asked to
        engine = super().engine()
        if planner == "whole":
            bounded = engine._prefill_budget
            engine._prefill_budget = lambda rows: None if all(r.is_prefilling for r in rows) else bounded(rows)
        return engine


def _params(max_tokens: int):
    from actors.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def behind_a_long_prompt(bench: _Bench, planner: str, rng: random.Random) -> dict:
    """The long request's and the short one's TTFT, each from its own arrival."""
    from actors.events import TokenEvent

    engine = bench.engine(planner)
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}

    def add(name: str, num_prompt: int, num_out: int) -> None:
        def emit(event, name=name):
            if isinstance(event, TokenEvent) and name not in first:
                first[name] = time.perf_counter()
        prompt = [rng.randrange(100, 30_000) for _ in range(num_prompt)]
        arrived[name] = time.perf_counter()
        engine.add(prompt, _params(num_out), emit, tpot_target_s=bench.tpot_target_s)

    add("long", CLASSES["long"].input_tokens, 4)
    joiner = threading.Timer(JOIN_AFTER_S, add, ("short", CLASSES["short"].input_tokens, 4))
    joiner.start()
    while len(first) < 2:
        if engine.has_work:
            engine.step()
        else:
            time.sleep(0.001)
    joiner.join()
    return {name: first[name] - arrived[name] for name in ("long", "short")}


def _draw_class(rng: random.Random) -> RequestClass:
    """One of bench_load's classes, drawn by its share of the mix, as its schedules draw them."""
    return CLASSES[rng.choices([name for name, _ in MIXED], [share for _, share in MIXED])[0]]


def closed_loop(bench: _Bench, planner: str, num_rows: int, seconds: float, rng: random.Random) -> dict:
    """Requests and output tokens a second of `num_rows` rows kept busy for `seconds`."""
    from actors.events import FinishEvent

    engine = bench.engine(planner)
    ended: list[int] = []

    def submit() -> None:
        cls = _draw_class(rng)
        num_prompt, num_out = cls.input_tokens, cls.output_tokens
        prompt = [rng.randrange(100, 30_000) for _ in range(num_prompt)]
        engine.add(prompt, _params(num_out), lambda e, n=num_out: ended.append(n) if isinstance(e, FinishEvent)
                   else None, tpot_target_s=bench.tpot_target_s)

    for _ in range(num_rows):
        submit()
    num_done = num_tokens = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        engine.step()
        while ended:
            num_done, num_tokens = num_done + 1, num_tokens + ended.pop()
            submit()
    wall = time.perf_counter() - t0
    return {"requests_per_s": num_done / wall, "output_tokens_per_s": num_tokens / wall}


def measure(repeats: int, seconds: float) -> dict:
    from actors.scheduler import RowProgress

    bench = _Bench()
    out: dict = {"facts": bench.facts, "threads": bench.threads, "dtype": bench.dtype,
                 "tpot_target_s": bench.tpot_target_s, "step_cost": vars(bench.step_cost),
                 "behind": {p: [] for p in PLANNERS}, "loops": {str(n): {p: [] for p in PLANNERS} for n in LOOP_ROWS}}
    # The first steps touch every page and let the step check learn this machine: not a planner's figures.
    closed_loop(bench, "bounded", LOOP_ROWS[-1], seconds / 3, random.Random(0))
    for i in range(repeats):
        for planner in PLANNERS if i % 2 == 0 else PLANNERS[::-1]:
            out["behind"][planner].append(behind_a_long_prompt(bench, planner, random.Random(i)))
            log.info("behind a long prompt, %s: %s", planner, out["behind"][planner][-1])
    engine = bench.engine("bounded")
    out["correction"] = engine.step_check.correction
    out["idle_budget_tokens"] = engine._prefill_budget([RowProgress(0, 100_000, 0, 0, bench.tpot_target_s)])
    for num_rows in LOOP_ROWS:
        for i in range(repeats):
            for planner in PLANNERS if i % 2 == 0 else PLANNERS[::-1]:
                run = closed_loop(bench, planner, num_rows, seconds, random.Random(100 + i))
                out["loops"][str(num_rows)][planner].append(run)
                log.info("%d rows, %s: %s", num_rows, planner, run)
    return out


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(data: dict) -> str:
    f, cost = data["facts"], data["step_cost"]
    lines = ["# Steps while no row decodes yet: bounded by the TPOT target against the prompts whole", "",
             f"Command: `{data['command']}`", "",
             f"Machine: {data['cores']} cores, {data['cpu']} ({', '.join(data['cpu_features'])}), Python "
             f"{data['python']}, torch {data['torch']}; load average {data['load_before'][0]:.2f} at the start; "
             f"{data['elapsed_s'] / 60:.1f} min. Nothing else of ours ran meanwhile.", "",
             f"Model: bench_load's `{f['preset']}` shape with random weights ({f['params_m']:.0f} M parameters, "
             f"{f['layers']} layers), computed in {data['dtype']} on {data['threads']} thread(s), in one process. "
             f"TPOT target {data['tpot_target_s']} s (benchmarks/load.yaml): a bounded step while nobody decodes is "
             f"planned within {2 * data['tpot_target_s']:g} s by the rule ({cost['decode_s_per_token']} s a "
             f"one-row step, {cost['prefill_tokens_per_s']:g} prompt tokens a second) times the engine's correction, "
             f"its measured ÷ predicted steps ({data['correction']:.2f} at the end: the bound holds "
             f"~{data['idle_budget_tokens']} prompt tokens a step alone).", "",
             f"## 1. A short request {1e3 * JOIN_AFTER_S:.0f} ms behind a {CLASSES['long'].input_tokens}-token one on an "
             "idle engine", "",
             f"TTFT from each request's arrival, the median (min–max) of {data['repeats']}.", "",
             "| planner | short request's TTFT s | long request's TTFT s |", "|---|---|---|"]
    for planner in PLANNERS:
        runs = data["behind"][planner]
        cells = [f"{statistics.median(r[k] for r in runs):.3f} ({min(r[k] for r in runs):.3f}–"
                 f"{max(r[k] for r in runs):.3f})" for k in ("short", "long")]
        lines.append(f"| {planner} | {cells[0]} | {cells[1]} |")
    lines += ["", "## 2. Closed loops: what the bound costs in throughput", "",
              f"N rows kept busy with bench_load's class mix, {data['seconds']:g} s a run, the planners alternating; "
              f"the median of {data['repeats']} runs.", "",
              "| rows | planner | requests/s | output tokens/s | × whole (requests) |", "|--:|---|--:|--:|--:|"]
    for num_rows, by_planner in data["loops"].items():
        whole = _median(by_planner["whole"], "requests_per_s")
        for planner in PLANNERS:
            rps = _median(by_planner[planner], "requests_per_s")
            lines.append(f"| {num_rows} | {planner} | {rps:.2f} | "
                         f"{_median(by_planner[planner], 'output_tokens_per_s'):.1f} | {rps / whole:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="one repeat of 3 s loops, written under .cache/bench")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    repeats, seconds = (1, 3.0) if args.quick else (args.repeats, args.seconds)
    out = Path(".cache/bench/idle_steps") if args.quick else Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_idle_steps", *(argv or sys.argv[1:])])
    load, t0 = load_average(), time.monotonic()
    data = measure(repeats, seconds)
    data |= ({"command": command, "elapsed_s": time.monotonic() - t0, "load_before": load, "repeats": repeats,
              "seconds": seconds} | machine("torch") | {"cpu_features": cpu_features()})
    write_report(out, "idle_steps", data, report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
