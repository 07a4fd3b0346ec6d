"""A joiner beside rows past their TPOT target: its prompt paced by its TTFT target against the TPOT bound alone.

    .venv/bin/python -m benchmarks.bench_paced_prefill          # ~2 min; writes benchmarks/results/paced_prefill.md
    .venv/bin/python -m benchmarks.bench_paced_prefill --quick  # a harness check; writes .cache/bench/paced_prefill/

`make serve`'s model and engine (configs/serve.yaml: SmolLM2-135M-Instruct, its rule constants, its
default TTFT and TPOT targets) in one process, on one torch thread (a served actor's steps while the
node's other processes are busy: actors/thread_governor.py). Rows decode with a TPOT target below any
step this engine takes, so that they have no slack from their first token on: the state a busy host
puts a batch in when its steps run several times what the router priced (bench_peer's traces). A
newcomer then joins with the served model's targets, and the engine feeds its prompt either *paced*
(at least the tokens a step that keep its first token within its TTFT target: actors/scheduler.py,
tokens_due; `actor.is_prefill_paced_by_ttft`, the default) or *unpaced* (the decoding rows' bound
alone: one prompt token a step). The two alternate, `--repeats` times each: the newcomer's TTFT and
steps to its first token, and the running rows' mean step meanwhile (what pacing costs them).
"""

from __future__ import annotations

import argparse
import logging
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_features, load_average, machine, write_report
from benchmarks.load_setup import ServedEngine

log = logging.getLogger("bench_paced_prefill")
CONFIG = "configs/serve.yaml"
MODES = ("paced", "unpaced")
NUM_RUNNING = 4  # rows decoding when the newcomer joins
PROMPT_TOKENS = 158  # bench_peer's GuideLLM requests: ~128 prompt tokens and the chat template
RUNNING_OUT = 1000  # enough that the running rows outlast an unpaced newcomer's prompt
PAST_TARGET_S = 0.001  # the running rows' TPOT target: below any step, so they never have slack
THREADS = 1  # configs/serve.yaml's actor.min_compute_threads: its actors' steps while the node is busy


def _params(max_tokens: int):
    from actors.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def join_beside_rows_past_their_target(bench: ServedEngine, mode: str, rng: random.Random) -> dict:
    """The newcomer's TTFT and steps to its first token; the running rows' mean step while it waited."""
    from actors.events import TokenEvent

    engine = bench.engine()

    def prompt() -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(PROMPT_TOKENS)]

    running = [engine.add(prompt(), _params(RUNNING_OUT), lambda e: None, tpot_target_s=PAST_TARGET_S)
               for _ in range(NUM_RUNNING)]
    while any(r.num_out == 0 for r in running):
        engine.step()
    first: list[float] = []
    arrival = time.time()
    due = arrival + bench.targets.ttft_target_s if mode == "paced" else None
    engine.add(prompt(), _params(4), lambda e: first.append(time.time()) if isinstance(e, TokenEvent) else None,
               tpot_target_s=bench.targets.tpot_target_s, first_token_due=due)
    out_before, num_steps = running[0].num_out, 0
    while not first and running[0].num_out < RUNNING_OUT:
        engine.step()
        num_steps += 1
    if not first:
        raise RuntimeError(f"the newcomer had no token within the running rows' {RUNNING_OUT} tokens")
    for row in running:
        engine.cancel(row)
    return {"ttft_s": first[0] - arrival, "steps": num_steps,
            "running_step_s": (first[0] - arrival) / max(1, running[0].num_out - out_before)}


def measure(repeats: int) -> dict:
    bench = ServedEngine(CONFIG, threads=THREADS)
    out: dict = {"facts": bench.facts, "threads": bench.threads, "dtype": bench.dtype,
                 "ttft_target_s": bench.targets.ttft_target_s, "tpot_target_s": bench.targets.tpot_target_s,
                 "step_cost": vars(bench.step_cost), "runs": {m: [] for m in MODES}}
    join_beside_rows_past_their_target(bench, "paced", random.Random(-1))  # pages touched, the step check learns
    for i in range(repeats):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            out["runs"][mode].append(join_beside_rows_past_their_target(bench, mode, random.Random(i)))
            log.info("%s: %s", mode, out["runs"][mode][-1])
    out["correction"] = bench.engine().step_check.correction
    return out


def report(data: dict) -> str:
    f, cost = data["facts"], data["step_cost"]
    lines = ["# A joiner beside rows past their TPOT target: paced by its TTFT target against the TPOT bound alone",
             "", f"Command: `{data['command']}`", "",
             f"Machine: {data['cores']} cores, {data['cpu']} ({', '.join(data['cpu_features'])}), Python "
             f"{data['python']}, torch {data['torch']}; load average {data['load_before'][0]:.2f} at the start; "
             f"{data['elapsed_s'] / 60:.1f} min. Nothing else of ours ran meanwhile.", "",
             f"Model: `make serve`'s `{f['id']}` ({f['params_m']:.0f} M parameters, {f['layers']} layers), computed "
             f"in {data['dtype']} on {data['threads']} thread(s), in one process; the rule's constants of "
             f"configs/serve.yaml ({cost['decode_s_per_token']} s a one-row step, {cost['prefill_tokens_per_s']:g} "
             f"prompt tokens a second) times the engine's measured ÷ predicted steps ({data['correction']:.2f} at the "
             "end).", "",
             f"{NUM_RUNNING} rows decode with a TPOT target of {PAST_TARGET_S * 1e3:g} ms, below any step: from their "
             "first token on they have no slack, as a batch has on a host whose steps run several times what the "
             f"router priced. A newcomer of {PROMPT_TOKENS} prompt tokens joins with the served model's targets "
             f"(TTFT {data['ttft_target_s']:g} s, TPOT {data['tpot_target_s']:g} s); *paced*: every step carries at "
             "least the prompt tokens that keep its first token within its TTFT target (the default); *unpaced*: "
             "the running rows' bound alone (`actor.is_prefill_paced_by_ttft: false`). The median (min–max) of "
             f"{data['repeats']} runs each, alternating.", "",
             "| mode | newcomer's TTFT s | steps to its first token | running rows' mean step meanwhile ms |",
             "|---|---|--:|---|"]
    for mode in MODES:
        runs = data["runs"][mode]

        def cell(key, scale=1.0, runs=runs):
            values = [scale * r[key] for r in runs]
            return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"
        lines.append(f"| {mode} | {cell('ttft_s')} | {statistics.median(r['steps'] for r in runs):.0f} | "
                     f"{cell('running_step_s', 1e3)} |")
    paced, unpaced = (statistics.median(r["ttft_s"] for r in data["runs"][m]) for m in MODES)
    lines += ["", f"Paced, the newcomer's first token came {unpaced / paced:.1f}× sooner"
              f"{' and within' if paced <= data['ttft_target_s'] else ', past'} its {data['ttft_target_s']:g} s "
              "target; the running rows, already past theirs, take longer steps while its prompt runs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one run of each, written under .cache/bench")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    repeats = 1 if args.quick else args.repeats
    out = Path(".cache/bench/paced_prefill") if args.quick else Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_paced_prefill", *(argv or sys.argv[1:])])
    load, t0 = load_average(), time.monotonic()
    data = measure(repeats)
    data |= ({"command": command, "elapsed_s": time.monotonic() - t0, "load_before": load, "repeats": repeats}
             | machine("torch") | {"cpu_features": cpu_features()})
    write_report(out, "paced_prefill", data, report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
