"""The compiled decode step (actors/compiled_step.py) against the eager one and the actors' own kernels, one process.

    .venv/bin/python -m benchmarks.bench_compiled   # ~1 min with inductor's cache on disk warm; writes compiled.md

SmolLM2-135M-Instruct (`make serve`'s model) in bf16 on two threads, rows decoding at position 150: the eager step
on the plain weights, the compiled step (its buckets of 1-8 rows and 64-256 positions compiled first, timed, and
whether inductor's cache on disk had them shows in the seconds), and the eager step on packed weights (the actors'
own kernels, as `make serve` runs). Each cell is the median of 30 steps, and the three alternate for 2 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from actors.compiled_step import CompiledDecode
from actors.layer_loader import load_zqs
from actors.model import RowInput
from actors.packed_weights import pack
from benchmarks.common import load_text, machine

ROWS = (1, 8)
POSITION = 150
ROUNDS = 2


def _median_ms(step, n: int = 30) -> float:
    step(), step()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _eager(model, num_rows: int):
    rows = [RowInput(model.new_row_cache(512), POSITION, 1) for _ in range(num_rows)]
    tokens = torch.zeros(num_rows, dtype=torch.long)
    return lambda: model.forward_rows(tokens, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zqs", type=Path, default=Path(".cache/models/smollm2-135m-instruct.zqs"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    load_before = load_text()
    plain, _ = load_zqs(args.zqs, compute_dtype="model", num_threads=2)
    packed, _ = load_zqs(args.zqs, compute_dtype="model", num_threads=2)
    pack(packed).install()
    compiled = CompiledDecode(plain, num_slots=max(ROWS), max_seq_len=512)
    t0 = time.perf_counter()
    with torch.inference_mode():
        num_compiles = compiled.compile_buckets(max_positions=POSITION + 1)
    compile_s = time.perf_counter() - t0
    cells: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for r in ROWS:
                steps = {"eager, plain weights": _eager(plain, r),
                         "compiled, plain weights": lambda r=r: compiled.decode([0] * r, list(range(r)), [POSITION] * r),
                         "eager, packed (the actors' kernels)": _eager(packed, r)}
                for name, step in steps.items():
                    cells.setdefault((name, r), []).append(_median_ms(step))
    m = machine("torch")
    lines = ["# The compiled decode step against the eager one", "",
             "Command: `.venv/bin/python -m benchmarks.bench_compiled`", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. {m['cores']} cores ({m['cpu']}), torch "
             f"{m['torch']}; load average {load_before} at the start, {load_text()} at the end.", "",
             f"SmolLM2-135M-Instruct in {plain.dtype}, two threads, every row decoding at position {POSITION}. "
             f"Compiling {len(compiled.row_buckets)} row buckets x the position buckets up to {POSITION + 1}: "
             f"{num_compiles} compilations in {compile_s:.0f} s (inductor's cache on disk as found: a cached bucket "
             "takes seconds; by hand, with the cache empty, these 12 took 380 s).", "",
             "| step | " + " | ".join(f"{r} row{'s' * (r > 1)}, ms (round 1 / 2)" for r in ROWS) + " |",
             "|---|" + "--:|" * len(ROWS)]
    for name in dict.fromkeys(n for n, _ in cells):
        lines.append(f"| {name} | " + " | ".join(" / ".join(f"{x:.1f}" for x in cells[(name, r)]) for r in ROWS)
                     + " |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
