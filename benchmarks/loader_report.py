"""The loader benchmark's report: machine, weights, command, tables per regime, goals, method notes.

Every figure comes from one run of `benchmarks.bench_loader` (its raw results are kept as
JSON, so `--report-only` rewrites this report without measuring again). The goals are
judged from those figures; where one is missed the text says by how much, and what
bounds it, from the same run's rows and machine limits.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from benchmarks.common import cores, cpu_model, kernel, mem_gib, versions
from benchmarks.loader_artefacts import XZ_PRESET, ZST_LEVEL
from benchmarks.loader_cells import Cell, Cells, ShapeInfo, shape_info
from benchmarks.loader_goals import MB, ZQS, goals, seed_comparison
from benchmarks.loader_methods import NUM_THREADS, REGIMES

ORDER = ("tar.xz", "zst-whole", *ZQS, "st-pread", "st-pread-emul", "st-mmap-copy", "st-mmap-touch")

DESCRIPTIONS = {
    "tar.xz": f"the seed's first baseline: a tar.xz (preset {XZ_PRESET}) of model.safetensors, streamed "
              "through `tarfile` into memory, then `safetensors.torch.load`",
    "zst-whole": f"the seed's second: model.safetensors zstd-compressed whole (level {ZST_LEVEL}), read "
                 "whole, decompressed to memory, then `safetensors.torch.load`",
    "zqs-bytegroup": f"this project (the seed's third): `.zqs` packed with the defaults (byte-grouped zstd level "
                     f"1), `LayerStream` on {NUM_THREADS} threads, verification on (each zstd frame's XXH64 content "
                     "checksum, checked by libzstd as it decodes), one 4 MiB read ahead per thread, into caller tensors",
    "zqs-zstd": "as zqs-bytegroup, packed with `byte_group=False` (plain zstd level 1)",
    "zqs-raw": "as zqs-bytegroup, packed with `codec=\"raw\"` (stored uncompressed; the crc32 is still checked)",
    "zqs-raw-nocrc": "zqs-raw read with `verify=False`, as a trusted local copy may be (bounds and sizes are "
                     "still enforced; safetensors checks no checksum either)",
    "st-pread": "`safetensors.torch.load_file(path, backend=\"pread\")`",
    "st-pread-emul": "what the pread backend does, done by the harness so that it can be throttled: the header, "
                     "then one fresh tensor per entry and 4 MiB preads into it, on one thread",
    "st-mmap-copy": "`safetensors.torch.load_file(path)` (default mmap backend), then `copy_` into the "
                    "destination tensors, which is what `load_state_dict` does",
    "st-mmap-touch": "reference, not a load: `load_file`'s mmap with one byte of every page read. The tensors "
                     "stay page-cache pages (file-backed, shared): what CPU-only serving gets for free; a device "
                     "copy would still read every byte",
}


def write_report(out: Path, run: dict[str, Any], cache: Path) -> str:
    """Write the markdown report for `run` (bench_loader's saved results) to `out`, a plot beside it."""
    shapes, results, limits = run["shapes"], run["results"], run["limits"]
    infos = {s: shape_info(s, cache) for s in shapes}
    grouped: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        grouped[(r["shape"], r["regime"], r["method"], r["dest"])].append(r)
    cells: Cells = {k: Cell(tuple(v)) for k, v in grouped.items()}
    built = [f"{shape}: " + ", ".join(f"{k} {s:.0f} s" for k, s in b.items()) for shape, b in run["built"].items() if b]
    lines = [
        "# Loader benchmark: the same bf16 weights, every way, in four storage regimes", "",
        *_machine(run["load"], [r["load_avg"] for r in results]),
        *_shapes(infos, cache),
        "## Command", "",
        f"    .venv/bin/{run['command']}", "",
        f"Run {run['started']}"
        + (f" (interrupted, and resumed with `--resume` at {', '.join(run['resumed'])}: the runs already done were "
           "kept, the rest of the same schedule run)" if run.get("resumed") else "")
        + f", {run['elapsed_s'] / 60:.1f} minutes of measuring in all; repeats per cell: "
        + ", ".join(f"{s} {n}" for s, n in run["repeats"].items()) + f" (tar.xz: {run['xz_repeats']}). "
        + ("Built in this run: " + "; ".join(built) + "." if built else "Every artefact was cached from an "
           "earlier run (the tar.xz of the 1.1B shape takes about 5 minutes to build here)."), "",
        *_limits(limits),
    ]
    for shape in shapes:
        for regime in REGIMES:
            lines += _regime_table(infos[shape], regime, cells)
    plot = out.with_suffix(".png")
    if _plot(plot, infos[shapes[-1]], cells):
        lines += [f"![median seconds per method and regime, {shapes[-1]}]({plot.name})", ""]
    lines += seed_comparison(infos[shapes[-1]], cells)
    lines += goals(infos, cells, limits)
    lines += _method_notes(results, infos, cells, limits)
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def _machine(load: list[list[float]], during: list[float]) -> list[str]:
    v, ver = zstandard.ZSTD_VERSION, versions("torch", "zstandard", "safetensors", "numpy")
    return [
        "## Machine", "",
        f"- {cores()} cores ({cpu_model()}), {mem_gib():.1f} GiB RAM, Linux {kernel()}, "
        f"root filesystem `{_root_device()}` (a virtio disk)",
        f"- Python {ver['python']}, torch {ver['torch']} ({torch.get_num_threads()} threads), "
        f"zstandard {ver['zstandard']} (libzstd {v[0]}.{v[1]}.{v[2]}), safetensors {ver['safetensors']}, "
        f"numpy {ver['numpy']}",
        f"- load average (1/5/15 min): {' / '.join(f'{x:.2f}' for x in load[0])} at the start, "
        f"{' / '.join(f'{x:.2f}' for x in load[1])} at the end; the 1-minute figure at the start of each "
        f"measurement: median {statistics.median(during):.2f}, range {min(during):.2f}–{max(during):.2f} "
        + ("(the benchmark's own threads: nothing else of note ran). "
           if statistics.median(during) < 1.6 else
           "(other jobs — tests and benchmarks of other parts of the project — shared this 2-core VM). ")
        + "Runs are interleaved and their order rotated each repeat so that such noise slows every method alike, the "
        "comparisons below are ratios within this run, and the CPU-seconds column shows what each load costs "
        "whatever the neighbours do; a load that needs both cores (LayerStream's two threads) loses more to a "
        "busy neighbour than a one-thread load does.",
        "",
    ]


def _root_device() -> str:
    for line in open("/proc/mounts"):
        dev, mount, fs = line.split()[:3]
        if mount == "/":
            return f"{dev}, {fs}"
    return "?"


def _shapes(infos: dict[str, ShapeInfo], cache: Path) -> list[str]:
    lines = [
        "## Weights and files", "",
        f"Random normal(0, 0.02) bf16 weights (`weights_tool.synth`, seed 0), cached under `{cache}/` (gitignored; "
        "delete it to rebuild). In brackets: ratio = weight bytes / file bytes.", "",
        "| shape | params | layers | per layer | embeddings | model.safetensors | tar.xz | whole .zst | "
        ".zqs byte-grouped | .zqs zstd | .zqs raw |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for i in infos.values():
        sizes = " | ".join(f"{i.files[k] / MB:,.0f} MB ({i.ratio(k):.3f})"
                           for k in ("safetensors", "tar.xz", "zst", "zqs-bytegroup", "zqs-zstd", "zqs-raw"))
        lines.append(f"| {i.name} | {i.num_params / 1e6:,.1f} M | {i.num_layers} | {i.layer_bytes / MB:.1f} MB | "
                     f"{i.embed_bytes / MB:.1f} MB | {sizes} |")
    return lines + [""]


def _limits(limits: dict[str, float]) -> list[str]:
    lines = ["## Machine limits (same run, on the larger shape's files)", "", "| what | GB/s |", "|---|--:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in limits.items()]
    return lines + [""]


def _baseline(regime: str) -> str:
    return "st-pread" if regime in ("warm", "cold") else "st-pread-emul"


def _regime_table(info: ShapeInfo, regime: str, cells: Cells) -> list[str]:
    rows = sorted(((m, d, c) for (s, r, m, d), c in cells.items() if s == info.name and r == regime),
                  key=lambda x: (ORDER.index(x[0]), x[1]))
    if not rows:
        return []
    base = cells.get((info.name, regime, _baseline(regime), "own"))
    counts = "/".join(map(str, sorted({len(c.runs) for _, _, c in rows})))
    lines = [
        f"## {info.name}, {regime}", "",
        f"{info.model_bytes / 1e9:.3f} GB of weights; median of {counts} runs per row. GB/s = weight bytes / "
        f"median seconds. × = {_baseline(regime)}'s seconds / the row's (above 1: faster than it). CPU s = the "
        "load's user + system CPU time, all threads (median).", "",
        "| method | destination | seconds | range | GB/s | × | CPU s | first layer (s) | peak RSS (MB) | extra RSS (MB) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for method, dest, c in rows:
        speedup = f"{base.seconds / c.seconds:.2f}" if base else "—"
        first = f"{c.first_layer_s:.3f}" if c.first_layer_s is not None else "at end"
        lines.append(f"| {method} | {dest} | {c.seconds:.3f} | {c.spread()} | {info.model_bytes / c.seconds / 1e9:.2f} "
                     f"| {speedup} | {c.cpu_s:.2f} | {first} | {c.peak_rss / MB:,.0f} | {c.extra / MB:,.0f} |")
    return lines + [""]


def _plot(path: Path, info: ShapeInfo, cells: Cells) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    regimes = [r for r in REGIMES if any(k[0] == info.name and k[1] == r for k in cells)]
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.2 * len(regimes), 4.6), sharey=True, sharex=True)
    labels = [f"{m} ({d})" for m in ORDER for d in ("own", "fresh", "prefaulted", "mapped")
              if any(k[0] == info.name and k[2] == m and k[3] == d for k in cells)]
    for ax, regime in zip(np.atleast_1d(axes), regimes, strict=True):
        values = []
        for label in labels:
            method, dest = label[:-1].split(" (")
            c = cells.get((info.name, regime, method, dest))
            values.append(c.seconds if c else np.nan)
        colors = ["tab:blue" if lab.startswith("zqs") else "tab:gray" for lab in labels]
        ax.barh(range(len(labels)), values, color=colors)
        for y, v in enumerate(values):
            if not np.isnan(v):
                ax.text(v, y, f" {v:.2f}", va="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_title(regime)
        ax.set_xlabel("seconds (log)")
        ax.grid(axis="x", which="both", alpha=0.3)
    np.atleast_1d(axes)[0].set_yticks(range(len(labels)), labels)
    np.atleast_1d(axes)[0].invert_yaxis()
    fig.suptitle(f"Loading {info.name} ({info.model_bytes / 1e9:.2f} GB bf16) into private memory, median seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- how it was measured ------------------------------------------------------------------


def _method_notes(results: list[dict[str, Any]], infos: dict[str, ShapeInfo], cells: Cells,
                  limits: dict[str, float]) -> list[str]:
    cold = [r for r in results if r["regime"] == "cold"]
    warm = [r for r in results if r["regime"] != "cold"]
    warm_full = sum(r["resident_pages_at_start"] == r["file_pages"] for r in warm)
    least_resident = min((r["resident_pages_at_start"] / r["file_pages"] for r in warm), default=float("nan"))
    throttled = [r for r in results if r["throttled_bytes"] is not None]
    through = min((r["throttled_bytes"] / r["bytes_to_read"] for r in throttled), default=float("nan"))
    emul = []
    for s in infos:
        a, b = cells.get((s, "warm", "st-pread-emul", "own")), cells.get((s, "warm", "st-pread", "own"))
        if a and b:
            emul.append(f"{s} {a.seconds:.3f} s against {b.seconds:.3f} s")
    cold_read = next((v for k, v in limits.items() if k.startswith("cold read")), float("nan"))
    lines = ["## How it was measured", ""]
    lines += [f"- **{name}**: {text}." for name, text in DESCRIPTIONS.items()]
    lines += [
        "",
        "**Done** means every byte sits in private memory of its destination tensor (what a device copy needs). "
        "Methods that build their own tensors (tar.xz, zst-whole, st-pread, st-pread-emul; destination *own*) "
        "count those as the destinations, as `load_state_dict(assign=True)` adopts them, so no extra copy is "
        "charged to them. Methods that fill caller tensors are timed into *fresh* tensors (allocated inside the "
        "timed region, so first-touch page faults count for them as for the others) and, warm, into *prefaulted* "
        "ones (allocated and zeroed before the clock starts: buffers an actor keeps and reuses, as "
        "CudaLayerStream's pinned staging ring is). st-mmap-touch's tensors are *mapped* page cache. torch runs "
        "on one thread in every measurement (it matters only to st-mmap-copy's `copy_`): with other jobs on this "
        "2-core VM, a 2-thread OpenMP copy ran ten times slower than a 1-thread one whenever a core was taken.",
        "",
        "Each measurement runs in its own process, forked from a server that imported torch once. Peak RSS is "
        "VmHWM, reset through `/proc/self/clear_refs` just before the load; *extra* = peak − RSS before the load "
        "− the destination bytes the load allocated: what the method held beyond its result. For the mmap rows "
        "that extra is the mapped file (page cache counted in RSS, reclaimable), not anonymous memory. Time to "
        "first layer: when `wait(-1)` (embeddings) and `wait(0)` have both returned, counted from the start of "
        "the load, opening the file included; methods that return every tensor at once have it only at the end. "
        "After every load its bytes are checked against model.safetensors (each tensor's first and last 64 KiB, "
        "the middle tensor whole; untimed).",
        "",
        f"- **warm**: the method's file is read once before the load; {warm_full} of {len(warm)} warm and "
        f"throttled runs started with every page of it resident (mincore), and none with less than "
        f"{least_resident:.2%} of its pages.",
        f"- **cold**: `fsync` + `posix_fadvise(POSIX_FADV_DONTNEED)` on the method's file, after which mincore "
        f"counted 0 resident pages in all {len(cold)} cold runs (a run with any page left fails). The disk is a "
        f"virtio block device; cold reads ran at {cold_read:.2f} GB/s on one thread, so *cold* here means a "
        "local disk of about that speed. Whether the host caches the image below the guest cannot be seen from "
        "inside; if it does, a real cold disk would be slower, which favours the compressed files.",
        "- **throttled**: the page cache is warm underneath and every read goes through one `Throttle` per load: "
        "a link of 1e9 or 0.5e9 bytes/s shared by all of the load's threads, each read returning no sooner than "
        "its bytes could have crossed the link after the previous read's; no credit accrues while the link is "
        "idle, so a reader overlaps storage with decoding only by keeping a read in flight itself (the `.zqs` "
        "reader keeps one 4 MiB read ahead per decoding thread; the other methods read and then decode). The "
        "archives are read through it in 4 MiB reads, st-pread-emul header and tensors alike, and the `.zqs` "
        "reader by swapping the `os` of `weights_tool.reader` and `weights_tool.frames` for one whose "
        "`pread`/`preadv` go through the throttle (no change to the reader). Every throttled run checked that everything it had to read crossed the link (the whole file; "
        f"for .zqs, every frame): at least {through:.2f}× that did. safetensors' own backends cannot be throttled "
        "from outside (Rust preads, mmap page faults), so st-pread-emul stands for the uncompressed file there; "
        "warm, it took " + ("; ".join(emul) if emul else "—") + " for st-pread.",
        "",
    ]
    return lines
