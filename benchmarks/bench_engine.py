"""The engine's settings on the served model, side by side in one run: compute dtype, threads per slot, batch.

    .venv/bin/python -m benchmarks.bench_engine           # 11 min; writes benchmarks/results/engine.md (+ .json)
    .venv/bin/python -m benchmarks.bench_engine --quick   # a harness check; writes .cache/bench/engine/

The model `make serve` serves (SmolLM2-135M-Instruct, stored bf16) through the actors' engine
(`actors/engine.py`), each cell in a fresh process as an actor would run it, with GuideLLM's
profile's shapes: 128-token prompts, decode steps at that context.

1. Compute dtype × torch threads × batch, one process alone on the machine: a 128-token
   prefill (one row's time to first token, compute only) and a decode step (= per-row TPOT;
   tokens/s = rows / step); with `auto`'s dtype also a decode step's layers called one by one from
   Python against all in one call (actors/decode_layers.py).
2. The CPU slot's trade-off at equal rows, with the compute dtype `auto` picks here: two
   slots of one thread each (two processes stepping at once, B rows each) against one slot of
   two threads (one process, 2B rows), and two slots of two threads each (four threads on the
   two cores: what a slot's second thread costs when the other slot computes too). Aggregate
   decode tokens/s and per-row TPOT.
3. The rule's constants (actors/step_cost.py, the app config's `rule_scorer`) fitted for the
   served model as an actor computes it (`auto`'s dtype, configs/serve.yaml's
   `actor.compute_threads`, or `--fit-threads`): the step at batch 1,
   a step's growth per extra row (the median over the batch sizes), prompt tokens a second
   beyond a one-row step and the prompt's attention pairs a second (from a 128- and a 1,024-token
   prompt, actors/step_cost.py),
   and the KV bytes a second the extra reads of a batch at a long context cost.
4. Why: the weight bytes a second the kernels stream for 1 and 8 rows (60 of the model's MLP
   weights, 212 MB in fp32: beyond any cache, as in a real step) at 1 and 2 threads, beside a
   plain sum over 540 MB (what the memory system gives one reader).

Cells are visited in rotation `--repeats` times and each figure is the median over repeats
of the median of `--steps` timed steps, so a noisy neighbour slows every cell alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    cores,
    cpu_model,
    load_average,
    python_version,
    served_threads,
    version_of,
    was_busy,
)

log = logging.getLogger("bench_engine")
PROMPT_TOKENS = 128
LONG_CONTEXT, LONG_BATCH = 1024, 8  # the KV term's step: 8 rows of 1,024 tokens against 8 of 128
DTYPES = ("bfloat16", "float32")
PLAIN_FP32 = "float32-plain"  # the cell of fp32 with its widened weights unpacked (AVX2 hosts only)
ONE_BY_ONE = "+layers"  # `auto`'s dtype with a decode step's layers called one by one from Python, not in one call


def _measure(zqs: str, dtype: str, threads: int, batches: list[int], steps: int, is_long_context: bool = False,
             barrier=None) -> dict:
    """In a fresh process: prefill seconds of one prompt, and the median decode step per batch size. `dtype`
    PLAIN_FP32: float32 with its weights left plain; a dtype + ONE_BY_ONE: its decode steps through the layers one
    by one (Transformer.decode_layers off)."""
    import torch

    from actors.actor_config import ActorConfig
    from actors.engine import Engine
    from actors.layer_loader import load_zqs
    from benchmarks.bench_batch import step_time
    from weights_tool.dtypes import model_dtype

    torch.set_num_threads(threads)
    # As an actor computes: its weights packed where it packs them (actors/packed_weights.py).
    is_one_by_one, dtype = dtype.endswith(ONE_BY_ONE), dtype.removesuffix(ONE_BY_ONE)
    is_packed = ActorConfig().is_weight_packed and dtype != PLAIN_FP32
    model, tokenizer = load_zqs(zqs, num_threads=1, compute_dtype="float32" if dtype == PLAIN_FP32 else dtype,
                                is_weight_packed=is_packed)
    if is_one_by_one:
        model.decode_layers = None
    engine = Engine(model, tokenizer, max_batch=max(batches), prefill_chunk_tokens=1_000_000)
    dtype_name = model_dtype(model.dtype)
    out: dict = {"dtype": dtype_name, "prefill_s": [], "step_s": {},
                 "kv_bytes_per_token": model.config.kv_bytes_per_token(dtype_name)}
    out["prefill_s"] = _prefill_times(engine, PROMPT_TOKENS, 3)
    if barrier is not None:
        barrier.wait()  # both slots start stepping together
    for batch in batches:
        out["step_s"][str(batch)] = step_time(engine, batch, PROMPT_TOKENS, steps)
    if is_long_context:
        out["long_prefill_s"] = _prefill_times(engine, LONG_CONTEXT, 2)
        out["long_step_s"] = step_time(engine, LONG_BATCH, LONG_CONTEXT, steps)
        out["short_step_s"] = step_time(engine, LONG_BATCH, PROMPT_TOKENS, steps)
    return out


def _prefill_times(engine, num_tokens: int, attempts: int) -> list[float]:
    """Seconds of a `num_tokens`-token prompt's prefill to its first token, timed in all attempts but the first (which
    touches every buffer at that length)."""
    from actors.sampling import SamplingParams
    from benchmarks.bench_batch import raise_errors, random_prompt

    times = []
    for attempt in range(attempts):
        row = engine.add(random_prompt(num_tokens, attempt), SamplingParams(max_tokens=1, temperature=0.0),
                         raise_errors)
        t0 = time.perf_counter()
        while engine.has_work:
            engine.step()
        if attempt:
            times.append(time.perf_counter() - t0)
        assert row.num_out == 1
    return times


def _kernels(threads: int, barrier=None) -> dict:
    """GB/s of weight streamed: F.linear for 1 and 8 fp32 rows, torch's bf16 kernels, the actors' own kernels where
    they run, and a sum."""
    import torch
    import torch.nn.functional as F

    from actors import bf16_linear, bf16_weight_linear
    from actors.cpu_kernels import avx2_extension, is_available
    from actors.layers import linear

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 576, generator=g) for _ in range(60)]  # [I, h] x 60: 212 MB fp32
    halves = [w.bfloat16() for w in weights]
    big = torch.randn(135_000_000, generator=g)  # 540 MB: the fp32 model's weights

    def gb_per_s(run, nbytes: int) -> float:
        run()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9

    fp32_bytes, bf16_bytes = sum(w.nbytes for w in weights), sum(w.nbytes for w in halves)
    one, eight = torch.randn(1, 576, generator=g), torch.randn(8, 576, generator=g)
    own = {}
    if is_available():  # bf16 rows, the weights in pairs: the AVX512-BF16 kernel the actors pack for
        pairs = [bf16_linear.pack(h) for h in halves]
        own |= {f"bf16 rows, packed in pairs: {n} (bf16_linear)": gb_per_s(
            lambda rows=rows: [bf16_linear.linear(rows.bfloat16(), p, 1536) for p in pairs], bf16_bytes)
            for n, rows in (("1 row", one), ("8 rows", eight))}
    if avx2_extension() is not None:  # fp32 rows over bf16 weights: the AVX2 kernel's bytes are the halves'
        packs = [bf16_weight_linear.pack(h.float()) for h in halves]
        own |= {f"bf16 weights, fp32 rows: {n} (bf16_weight_linear)": gb_per_s(
            lambda rows=rows: [bf16_weight_linear.linear(rows, p, 1536) for p in packs], bf16_bytes)
            for n, rows in (("1 row", one), ("8 rows", eight))}
    return {
        "fp32 F.linear, 1 row": gb_per_s(lambda: [F.linear(one, w) for w in weights], fp32_bytes),
        "fp32 F.linear, 8 rows": gb_per_s(lambda: [F.linear(eight, w) for w in weights], fp32_bytes),
        "bf16, 1 row, unpacked (mv or F.linear, as layers.linear picks)": gb_per_s(
            lambda: [linear(one.bfloat16(), w) for w in halves], bf16_bytes),
        "bf16 F.linear, 8 rows": gb_per_s(lambda: [F.linear(eight.bfloat16(), w) for w in halves], bf16_bytes),
        **own,
        "sum over 540 MB": gb_per_s(lambda: big.sum(), big.nbytes),
    }


def measure_in_process(args: tuple) -> dict:
    """`_measure(*args)`, for a process pool (bench_served_decode's engine-alone step uses it too)."""
    return _measure(*args)


def _run(pool_args: list[tuple]) -> list[dict]:
    """Each tuple's `_measure` in its own fresh process, all at once (a barrier lines up their steps)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Manager().Barrier(len(pool_args)) if len(pool_args) > 1 else None
    with ctx.Pool(len(pool_args)) as pool:
        return pool.map(measure_in_process, [(*a, barrier) for a in pool_args])


def measure(zqs: str, batches: list[int], steps: int, repeats: int, fit_threads: int) -> dict:
    from actors.compute_dtype import compute_dtype_for
    from actors.cpu_kernels import is_avx2_supported

    auto = compute_dtype_for("auto", "bfloat16", "cpu")
    cells: dict[str, list] = {}
    slots: dict[str, list] = {}
    dtypes = (*DTYPES, PLAIN_FP32) if is_avx2_supported() else DTYPES
    dtypes = (*dtypes, auto + ONE_BY_ONE)
    for repeat in range(repeats):
        for dtype in dtypes:
            for threads in (1, 2):
                [r] = _run([(zqs, dtype, threads, batches, steps, dtype == auto and threads == fit_threads)])
                cells.setdefault(f"{dtype}/{threads}", []).append(r)
                log.info("repeat %d %s x %d thread(s): prefill %.0f ms, steps %s", repeat, dtype, threads,
                         statistics.median(r["prefill_s"]) * 1e3,
                         {b: round(s * 1e3, 1) for b, s in r["step_s"].items()})
        two = _run([(zqs, auto, 1, batches, steps, False)] * 2)
        one = _run([(zqs, auto, 2, [2 * b for b in batches], steps, False)])
        crowded = _run([(zqs, auto, 2, batches, steps, False)] * 2)
        slots.setdefault("2x1", []).append(two)
        slots.setdefault("1x2", []).append(one)
        slots.setdefault("2x2", []).append(crowded)
        log.info("repeat %d slots: 2x1 %s | 1x2 %s | 2x2 %s", repeat, [t["step_s"] for t in two], one[0]["step_s"],
                 [t["step_s"] for t in crowded])
    kernels = {str(threads): _run_kernels(threads) for threads in (1, 2)}
    return {"auto": auto, "cells": cells, "slots": slots, "kernels": kernels, "fit_threads": fit_threads}


def _run_kernels(threads: int) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_kernels, (threads,))


def fit_rule(runs: list[dict], batches: list[int]) -> dict[str, float]:
    """The rule's constants (actors/step_cost.py) from one cell's runs (module docstring, 3)."""
    one = _median_step(runs, 1)
    growth = [(_median_step(runs, b) / one - 1) / (b - 1) for b in batches if b > 1]
    prefill = statistics.median(statistics.median(r["prefill_s"]) for r in runs)
    extra_s = statistics.median(r["long_step_s"] - r["short_step_s"] for r in runs)
    extra_bytes = LONG_BATCH * (LONG_CONTEXT - PROMPT_TOKENS) * runs[0]["kv_bytes_per_token"]
    rule = {"decode_s_per_token": one, "batch_row_cost": max(0.0, statistics.median(growth)),
            # Marginal: the prompt's step less a one-row step (its weights' pass), per further token.
            "prefill_tokens_per_s": (PROMPT_TOKENS - 1) / (prefill - one),
            "kv_read_bytes_per_s": extra_bytes / extra_s if extra_s > 0 else float("inf")}
    if all("long_prefill_s" in r for r in runs):  # runs before it was measured price no attention
        long = statistics.median(statistics.median(r["long_prefill_s"]) for r in runs)
        rule |= prefill_rates(((PROMPT_TOKENS, prefill - one), (LONG_CONTEXT, long - one)))
    return rule


def prefill_rates(points: tuple[tuple[int, float], tuple[int, float]]) -> dict[str, float]:
    """`prefill_tokens_per_s` and `attention_pairs_per_s` (actors/step_cost.py) from two prompts' seconds beyond a
    one-row step: n tokens take (n - 1) / tokens_per_s + n (n - 1) / 2 / pairs_per_s. Pairs that cost nothing
    measurable (the long prompt no slower per token than the short one) are left unpriced (inf)."""
    (n1, y1), (n2, y2) = points
    a1, p1, a2, p2 = n1 - 1, n1 * (n1 - 1) / 2, n2 - 1, n2 * (n2 - 1) / 2
    det = a1 * p2 - a2 * p1
    per_token, per_pair = (y1 * p2 - y2 * p1) / det, (a1 * y2 - a2 * y1) / det
    if per_pair <= 0 or per_token <= 0:  # no quadratic part: the per-token rate of both prompts together
        return {"prefill_tokens_per_s": (a1 + a2) / (y1 + y2), "attention_pairs_per_s": float("inf")}
    return {"prefill_tokens_per_s": 1 / per_token, "attention_pairs_per_s": 1 / per_pair}


def rule_constants(data: dict) -> list[str]:
    auto, threads = data["auto"], data.get("fit_threads", 1)
    runs = data["cells"][f"{auto}/{threads}"]
    batches = sorted(int(b) for b in runs[0]["step_s"])
    rule = fit_rule(runs, batches)
    return [
        f"## 3. The rule's constants for this model and machine ({auto}, {threads} thread{'s' if threads > 1 else ''}: "
        "as the actors of the config they are for compute)",
        "",
        "For the app config's `rule_scorer` (the router's predictions and the engine's step planner, "
        "actors/step_cost.py):",
        "",
        "```yaml",
        "rule_scorer:",
        f"  decode_s_per_token: {rule['decode_s_per_token']:.4f}   # the step at batch 1",
        f"  batch_row_cost: {rule['batch_row_cost']:.3f}   # per extra row, a share of that step (median over "
        f"batches {', '.join(str(b) for b in batches if b > 1)})",
        f"  prefill_tokens_per_s: {rule['prefill_tokens_per_s']:.0f}   # a {PROMPT_TOKENS}-token prompt's step less "
        f"a one-row step, per further token" + (", beside its attention (below)" if "attention_pairs_per_s" in rule
                                                else ""),
        *([f"  attention_pairs_per_s: {rule['attention_pairs_per_s']:.3g}   # and a {LONG_CONTEXT}-token prompt's: "
           f"{statistics.median(statistics.median(r['long_prefill_s']) for r in runs) * 1e3:.0f} ms against "
           f"{statistics.median(statistics.median(r['prefill_s']) for r in runs) * 1e3:.0f}"]
          if "attention_pairs_per_s" in rule else []),
        f"  kv_read_bytes_per_s: {rule['kv_read_bytes_per_s']:.3g}   # {LONG_BATCH} rows at {LONG_CONTEXT} tokens "
        f"against {PROMPT_TOKENS}: "
        + " / ".join(f"{statistics.median(r[k] for r in runs) * 1e3:.1f}" for k in ("long_step_s", "short_step_s"))
        + " ms",
        "```",
    ]


def _median_step(runs: list[dict], batch: int) -> float:
    return statistics.median(r["step_s"][str(batch)] for r in runs)


def report(data: dict, batches: list[int], steps: int, repeats: int, command: str, elapsed_s: float,
           load: tuple[float, float]) -> str:
    cells, auto = data["cells"], data["auto"]
    lines = [
        "# The engine's settings: compute dtype, threads per CPU slot, batch",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {cores()} cores, {cpu_model()}, Python {python_version()}, torch {version_of('torch')}. "
        f"Load average {load[0]:.2f} at the start{' (busy: other work shared the machine)' if was_busy(load[0]) else ''}"
        f", {load[1]:.2f} at the end; {elapsed_s / 60:.1f} min. Nothing else of ours ran meanwhile.",
        "",
        f"Model: SmolLM2-135M-Instruct as `make serve` packs it (bf16 file; 30 layers, hidden 576, 9 heads / 3 KV "
        f"heads, vocab 49,152, tied embeddings) through the actors' engine, each cell a fresh process. "
        f"{PROMPT_TOKENS}-token prompts; every figure is the median over {repeats} repeats of the median of "
        f"{steps} timed steps. `auto` picks **{auto}** on this CPU.",
        "",
        "## 1. Compute dtype × threads × batch (one process alone)",
        "",
        f"| compute dtype | threads | prefill {PROMPT_TOKENS} tokens (ms) | "
        + " | ".join(f"step at batch {b} (ms)" for b in batches) + f" | tokens/s at batch {max(batches)} |",
        "|---|--:|--:|" + "--:|" * len(batches) + "--:|",
    ]
    for dtype in (*DTYPES, PLAIN_FP32, auto + ONE_BY_ONE):
        for threads in (1, 2):
            runs = cells.get(f"{dtype}/{threads}")
            if runs is None:  # PLAIN_FP32: measured on AVX2 hosts only; ONE_BY_ONE: in runs since it was added
                continue
            prefill = statistics.median(statistics.median(r["prefill_s"]) for r in runs)
            row_steps = [_median_step(runs, b) for b in batches]
            label = _LABELS.get(dtype, dtype) if PLAIN_FP32 + "/1" in cells or ONE_BY_ONE in dtype else dtype
            lines.append(f"| {label} | {threads} | "
                         f"{prefill * 1e3:.0f} | "
                         + " | ".join(f"{s * 1e3:.1f}" for s in row_steps)
                         + f" | {max(batches) / row_steps[-1]:.0f} |")
    bf, fp = cells["bfloat16/1"], cells["float32/1"]
    lines += [
        "",
        "bf16 ÷ fp32 time, one thread: prefill "
        f"{statistics.median(statistics.median(r['prefill_s']) for r in bf) / statistics.median(statistics.median(r['prefill_s']) for r in fp):.2f}×"
        + "".join(f", step at batch {b} {_median_step(bf, b) / _median_step(fp, b):.2f}×" for b in batches) + ".",
        *_ratio_lines(cells, PLAIN_FP32, "float32", "fp32 with widened weights plain ÷ with bf16 weights (time; "
                      "above 1: the kernel is faster):", batches),
        *_ratio_lines(cells, auto + ONE_BY_ONE, auto, f"{auto}: a decode step's layers one by one from Python ÷ in one "
                      "call (time; above 1: the one call is faster; the prefill is the same path in both):", batches,
                      is_prefill_shown=False),
        "",
        f"## 2. Two slots × one thread against one slot × two threads ({auto}, equal rows)",
        "",
        "Each cell: its step (ms, = per-row TPOT) and the decode tokens/s of all its rows. 2 × 2: two slots of two "
        "threads each, four threads on the two cores.",
        "",
        "| rows in all | 2 slots × 1 thread | 1 slot × 2 threads | 2 slots × 2 threads | 1×2 tokens/s ÷ 2×1 |",
        "|--:|--:|--:|--:|--:|",
    ]

    def pair_step(key: str, b: int) -> float | None:
        pairs = data["slots"].get(key)
        return None if not pairs else statistics.median(statistics.median(t["step_s"][str(b)] for t in pair)
                                                        for pair in pairs)

    def cell(step: float | None, rows: int) -> str:
        return "not measured" if step is None else f"{step * 1e3:.1f} ms, {rows / step:.0f} tokens/s"

    for b in batches:
        two, crowded = pair_step("2x1", b), pair_step("2x2", b)
        one = statistics.median(r[0]["step_s"][str(2 * b)] for r in data["slots"]["1x2"])
        lines.append(f"| {2 * b} | {cell(two, 2 * b)} | {cell(one, 2 * b)} | {cell(crowded, 2 * b)} | "
                     f"{two / one:.2f} |")
    lines += ["", *rule_constants(data)]
    kernels = data["kernels"]
    lines += [
        "",
        "## 4. What the kernels stream (GB of weights a second, fresh process, nothing cached)",
        "",
        "| kernel | 1 thread | 2 threads |",
        "|---|--:|--:|",
        *(f"| {name} | {kernels['1'][name]:.1f} | {kernels['2'].get(name, float('nan')):.1f} |"
          for name in kernels["1"]),
        "",
    ]
    return "\n".join(lines)


_LABELS = {"float32": "float32, bf16 weights (bf16_weight_linear)", PLAIN_FP32: "float32, widened weights plain",
           "bfloat16" + ONE_BY_ONE: "bfloat16, layers one by one", "float32" + ONE_BY_ONE: "float32, layers one by one"}


def _ratio_lines(cells: dict, slower: str, faster: str, title: str, batches: list[int],
                 is_prefill_shown: bool = True) -> list[str]:
    """Cell `slower`'s time ÷ cell `faster`'s, per thread count: prefill (where the two differ there) and steps."""
    if f"{slower}/1" not in cells:
        return []
    out = ["", title]
    for threads in (1, 2):
        slow, fast = cells[f"{slower}/{threads}"], cells[f"{faster}/{threads}"]
        parts = [f"step at batch {b} {_median_step(slow, b) / _median_step(fast, b):.2f}×" for b in batches]
        if is_prefill_shown:
            pre = (statistics.median(statistics.median(r["prefill_s"]) for r in slow)
                   / statistics.median(statistics.median(r["prefill_s"]) for r in fast))
            parts.insert(0, f"prefill {pre:.2f}×")
        out.append(f"- {threads} thread{'s' if threads > 1 else ''}: " + ", ".join(parts) + ".")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two batch sizes, one repeat: a harness check")
    parser.add_argument("--zqs", default=".cache/models/smollm2-135m-instruct.zqs",
                        help="the served model (`make serve` packs it there)")
    parser.add_argument("--out", help="default benchmarks/results/engine.md (.cache/bench/engine/ with --quick)")
    parser.add_argument("--fit-threads", type=int, choices=(1, 2), default=None,
                        help="the threads section 3 fits the rule's constants at (default: configs/serve.yaml's "
                             "actor.compute_threads; benchmarks/load.yaml's actors compute on 1)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the run's JSON beside --out, measuring nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not Path(args.zqs).exists():
        print(f"{args.zqs} is missing: `make serve` (or `zq-weights fetch smollm2-135m-instruct -o {args.zqs}`) "
              "packs it", file=sys.stderr)
        return 2
    batches, steps, repeats = ([1, 8], 4, 1) if args.quick else ([1, 4, 8, 16], 16, 2)
    out = Path(args.out or (".cache/bench/engine/engine.md" if args.quick else "benchmarks/results/engine.md"))
    if args.report_only:
        data = json.loads(out.with_suffix(".json").read_text())
        text = out.read_text()
        header, _, _ = text.partition("## 1.")
        # The run's own header (its command, machine, load and duration) stays; the sections are rewritten.
        sections = report({k: v for k, v in data.items() if k != "command"}, batches, steps, repeats, "", 0.0,
                          (0.0, 0.0))
        out.write_text(header + "## 1." + sections.partition("## 1.")[2])
        print(out.read_text())
        return 0
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_engine", *(argv or sys.argv[1:])])
    load_start = load_average()[0]
    t0 = time.monotonic()
    data = measure(args.zqs, batches, steps, repeats, args.fit_threads or served_threads())
    text = report(data, batches, steps, repeats, command, time.monotonic() - t0, (load_start, load_average()[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"command": command, **data}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
