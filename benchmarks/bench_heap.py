"""What the prefill heap setting (actors/heap.py) buys: page faults and time per prefill layer.

Each heap mode runs in a fresh Python process (mallopt is process-wide and cannot be
undone): load the `small` shape in bf16, then prefill the same prompt `--repeats` times
on one thread, timing every layer and counting minor page faults (getrusage). A second
probe times the first touch of fresh memory (64 MiB through malloc and memset), on
4 KiB pages and on transparent huge pages, which is what every fault costs here.

    .venv/bin/python -m benchmarks.bench_heap    # ~2 min; writes benchmarks/results/heap.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import cores, load_average, python_version

MODES = {
    "glibc defaults": "default",
    "freed memory kept, 4 KiB pages": "retain",
    "freed memory kept, huge pages (the actors' setting)": "retain-thp",
}

_PREFILL = """
import json, resource, sys, time
import torch
from actors.heap import retain_freed_memory
from actors.layer_loader import load_zqs

mode, zqs, num_tokens, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode != "default":
    retain_freed_memory(1 << 30 if mode == "retain-thp" else 0)
torch.set_num_threads(1)
model, _ = load_zqs(zqs, num_threads=1)
tokens = torch.tensor([[100 + (i * 37) % 20000 for i in range(num_tokens)]])
runs = []
for _ in range(repeats):
    marks = []
    def mark(i):
        marks.append((time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt))
    model.setup_cache(num_tokens + 1)
    with torch.inference_mode():
        model.prefill(tokens, wait_layer=mark)
    mark(None)
    model.drop_cache()
    layers = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks[1:-2], marks[2:-1])]  # decoder layers only
    runs.append({"total_s": marks[-1][0] - marks[0][0], "faults": marks[-1][1] - marks[0][1],
                 "layer_s": [s for s, _ in layers], "layer_faults": [f for _, f in layers]})
print(json.dumps(runs))
"""

_FIRST_TOUCH = """
import ctypes, json, mmap, resource, sys, time
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
n, huge = 64 << 20, 2 << 20
p = libc.malloc(n + huge)
start = -(-p // huge) * huge
if sys.argv[1] == "huge":
    libc.madvise(start, n, getattr(mmap, "MADV_HUGEPAGE", 14))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = time.perf_counter()
ctypes.memset(start, 1, n)
print(json.dumps({"s": time.perf_counter() - t, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}))
"""


def _run(code: str, *args: str) -> object:
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_cold_start import prepare_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1456)
    parser.add_argument("--repeats", type=int, default=4, help="prefills per process; the first pays first touch")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per mode, interleaved")
    parser.add_argument("--cache-dir", default=".cache/bench")
    parser.add_argument("--out", default="benchmarks/results/heap.md")
    args = parser.parse_args(argv)
    command = " ".join([".venv/bin/python -m benchmarks.bench_heap", *(sys.argv[1:] if argv is None else argv)])
    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average()[0]
    zqs = prepare_model("small", "bfloat16", Path(args.cache_dir))

    runs: dict[str, list[dict]] = {label: [] for label in MODES}
    touch: dict[str, list[dict]] = {"4 KiB pages": [], "huge pages": []}
    for _ in range(args.processes):
        for label, mode in MODES.items():
            runs[label] += _run(_PREFILL, mode, str(zqs), str(args.tokens), str(args.repeats))
            if len(runs[label]) % args.repeats != 0:
                raise RuntimeError("a probe returned a partial set of runs")
        touch["4 KiB pages"].append(_run(_FIRST_TOUCH, "small"))
        touch["huge pages"].append(_run(_FIRST_TOUCH, "huge"))

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    lines = [
        "# Prefill heap: page faults and time per layer", "",
        f"Command: `{command}`. Run {started}; {cores()} cores, Python {python_version()}; "
        f"1-minute load {load_before:.2f} at the start.", "",
        f"The `small` shape in bf16 (12 layers), one {args.tokens}-token prefill repeated {args.repeats} times in "
        f"each of {args.processes} fresh processes per mode, one torch thread. 'First' is each process's first "
        "prefill (its activations touch fresh memory); 'later' the rest. Medians over processes and layers.", "",
        "| heap | first prefill s | later prefill s | faults, first | faults, later | "
        "layer 0 ms, first | layer ms, later |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for label, rs in runs.items():
        first, later = rs[:: args.repeats], [r for k, r in enumerate(rs) if k % args.repeats]
        lines.append(
            f"| {label} | {med([r['total_s'] for r in first]):.3f} | {med([r['total_s'] for r in later]):.3f} | "
            f"{med([r['faults'] for r in first]):,.0f} | {med([r['faults'] for r in later]):,.0f} | "
            f"{med([r['layer_s'][0] for r in first]) * 1e3:.0f} | "
            f"{med([s for r in later for s in r['layer_s']]) * 1e3:.0f} |")
    lines += ["", "First touch of 64 MiB of fresh memory (malloc, then memset), one fresh process each:", "",
              "| pages | seconds, median (min–max) | faults | µs per fault |", "|---|--:|--:|--:|"]
    for label, ts in touch.items():
        s = [t["s"] for t in ts]
        faults = med([t["faults"] for t in ts])
        lines.append(f"| {label} | {med(s):.3f} ({min(s):.3f}–{max(s):.3f}) | {faults:,.0f} | "
                     f"{med(s) / max(faults, 1) * 1e6:.1f} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
