"""bf16 against fp32 compute on this CPU, at the default model's matrix shapes, side by side.

The default model is packed bf16 and the runtime computes in the packed dtype. Whether
that pays depends on the CPU: with native bf16 (AVX512_BF16, AMX) it halves the bytes
read; without it, each bf16 product goes through conversions. This times one decoder
layer's seven projections of SmolLM2-135M-Instruct (hidden 576, 9 query heads and 3 KV
heads of 64, MLP 1536) and its lm_head (49,152 rows) for 1, 8, 64 and 256 rows (a decode
step of that batch, or a prefill chunk of that many tokens), one thread, both dtypes
interleaved, and reports the time per call and the bf16/fp32 ratio.

    .venv/bin/python -m benchmarks.bench_dtype    # ~30 s; writes benchmarks/results/dtype.md
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import load_text, machine

HIDDEN, KV, MLP, VOCAB = 576, 3 * 64, 1536, 49152
# One layer's projections, (out_features, in_features): q, k, v, o, gate, up, down.
LAYER = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]
ROWS = (1, 8, 64, 256)
REPEATS = 7


def _time(weights: list[torch.Tensor], rows: int, dtype: torch.dtype, calls: int) -> float:
    """Seconds per pass through `weights`, each fed `rows` rows (the median of REPEATS)."""
    xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in weights]
    for x, w in zip(xs, weights, strict=True):
        torch.nn.functional.linear(x, w)  # warm-up: kernels chosen, buffers allocated
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(calls):
            for x, w in zip(xs, weights, strict=True):
                torch.nn.functional.linear(x, w)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def measure() -> list[dict]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows_out = []
    for name, shapes in (("decoder layer (7 projections)", LAYER), ("lm_head", [(VOCAB, HIDDEN)])):
        weights = {dt: [torch.randn(o, i, dtype=dt) for o, i in shapes] for dt in (torch.float32, torch.bfloat16)}
        for rows in ROWS:
            calls = max(2, 64 // rows)
            # Interleaved, so both dtypes see the same machine state.
            fp32 = _time(weights[torch.float32], rows, torch.float32, calls)
            bf16 = _time(weights[torch.bfloat16], rows, torch.bfloat16, calls)
            rows_out.append({"what": name, "rows": rows, "fp32_ms": fp32 * 1e3, "bf16_ms": bf16 * 1e3})
    return rows_out


def report(rows: list[dict], command: str, load_before: str) -> str:
    m = machine("torch")
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split()
                    if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}) \
        if Path("/proc/cpuinfo").exists() else []
    lines = [
        "# bf16 against fp32 compute on this CPU", "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M')}). Machine: {m['cores']} cores, {m['cpu']}, "
        f"CPU flags {', '.join(flags) or 'none of avx2/avx512/amx'}; torch {m.get('torch')}, one thread; "
        f"load before {load_text() if not load_before else load_before}.",
        "Shapes: SmolLM2-135M-Instruct, the model `make serve` serves; median of "
        f"{REPEATS} timings of each.", "",
        "| what | rows | fp32 (ms) | bf16 (ms) | bf16 / fp32 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['what']} | {r['rows']} | {r['fp32_ms']:.3f} | {r['bf16_ms']:.3f} "
                     f"| {r['bf16_ms'] / r['fp32_ms']:.2f}× |")
    lines += ["", "A ratio above 1 means this CPU computes the bf16 model slower than it would the same "
              "weights in fp32 (at twice their memory).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/dtype.md")
    args = parser.parse_args(argv)
    load_before = load_text()
    command = " ".join(["python -m benchmarks.bench_dtype", shlex.join(sys.argv[1:])]).strip()
    text = report(measure(), command, load_before)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
