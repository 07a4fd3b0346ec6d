"""Loading the same bf16 weights every way the seed document compares, under four kinds of storage.

One run, side by side on one machine, for the `small` shape and TinyLlama-1.1B's shape
(random normal(0, 0.02) bf16 weights from `weights_tool.synth`). Methods (loader_methods):
the seed's three (tar.xz + load, whole-file zstd + load, `.zqs` streamed by LayerStream),
`.zqs` with plain zstd and uncompressed, and safetensors' `load_file` with its mmap and
pread backends. Regimes: a warm page cache; cold (every file the method reads evicted
with posix_fadvise(DONTNEED), mincore confirming 0 pages resident); and storage throttled
to 1 GB/s and 0.5 GB/s by a rate limiter the harness puts in front of every read.

A load is done when every byte sits in private memory of its destination tensor (what a
device copy needs). Methods that build their own tensors (the archives, st-pread) count
those tensors as the destinations, as `load_state_dict(assign=True)` would adopt them.
Methods that fill caller tensors (`.zqs`, st-mmap-copy) are timed into fresh tensors
(allocated inside the timed region, so first-touch page faults count as they do for the
others) and, on a warm cache, into prefaulted ones (buffers an actor keeps and reuses).

Every measurement runs in its own process forked from a server that has imported torch,
so one method's allocations and page cache state cannot leak into the next; runs are
interleaved, the order rotated each repeat, and each figure is the median.

    .venv/bin/python -m benchmarks.bench_loader            # writes benchmarks/results/loader.md
    .venv/bin/python -m benchmarks.bench_loader --quick    # small shape, 1 repeat
    .venv/bin/python -m benchmarks.bench_loader --resume .cache/bench/loader/run-*.json   # after an interruption
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing as mp
import re
import resource
import shlex
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from benchmarks.common import load_average
from benchmarks.loader_artefacts import artefact_paths, build_artefacts
from benchmarks.loader_methods import (
    BY_NAME,
    METHODS,
    RATES,
    REGIMES,
    Tensors,
    TensorSpec,
    prefaulted_tensors,
    safetensors_specs,
)
from benchmarks.loader_storage import Throttle, evict, read_through, resident_pages, warm
from weights_tool.reader import ShardReader

log = logging.getLogger("bench_loader")

SHAPES = ("small", "tinyllama-1.1b")
CACHE = Path(".cache/bench/loader")
RESULTS = Path(__file__).resolve().parent / "results" / "loader.md"


# ---- one measurement, in its own process ------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    shape: str
    regime: str
    method: str
    dest: str
    repeat: int
    cache: str


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Time one load; call in a fresh process (peak RSS is the process's own)."""
    # torch ops (st-mmap-copy's copy_) on one thread: on this shared 2-core VM a 2-thread OpenMP copy ran
    # 10x slower than one thread whenever another job held a core; Ray workers default to one thread too.
    torch.set_num_threads(1)
    method = BY_NAME[spec.method]
    paths = artefact_paths(spec.shape, Path(spec.cache))
    path = paths[method.artefact]
    specs = safetensors_specs(paths["safetensors"])  # before any eviction: it reads the header page
    dests = prefaulted_tensors(specs) if spec.dest == "prefaulted" else None
    if spec.regime == "cold":
        resident = evict(path)
        if resident:
            raise RuntimeError(f"{path}: {resident} pages still resident after POSIX_FADV_DONTNEED")
    else:
        resident = warm(path)
    throttle = Throttle(RATES[spec.regime]) if spec.regime in RATES else None
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
    rss_before = _status_bytes("VmRSS")
    load_avg = load_average()[0]
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    tensors, first = method.load(paths, specs, throttle, dests)
    seconds = time.perf_counter() - t0
    cpu_s = _cpu_seconds() - cpu0
    peak = _status_bytes("VmHWM")
    rss_file = _status_bytes("RssFile")
    if throttle is not None and throttle.num_bytes < _bytes_to_read(path):
        raise RuntimeError(f"only {throttle.num_bytes} of {_bytes_to_read(path)} bytes went through the throttle")
    _check_bytes(tensors, specs, paths["safetensors"])
    model_bytes = sum(s.size for s in specs)
    return {
        **asdict(spec), "seconds": seconds, "first_layer_s": None if first is None else first - t0,
        "cpu_s": cpu_s, "load_avg": load_avg,
        "rss_before": rss_before, "peak_rss": peak, "rss_file_after": rss_file,
        "fresh_dest_bytes": model_bytes if spec.dest in ("own", "fresh") else 0,
        "resident_pages_at_start": resident, "file_pages": resident_pages(path)[1], "file_bytes": path.stat().st_size,
        "throttled_bytes": None if throttle is None else throttle.num_bytes, "bytes_to_read": _bytes_to_read(path),
    }


def _bytes_to_read(path: Path) -> int:
    """What a load must read of `path`: the whole file, or a .zqs file's frames (not the header's padding)."""
    if path.suffix != ".zqs":
        return path.stat().st_size
    with ShardReader(path) as reader:
        return sum(f.stored_size for g in reader.groups for f in g.frames)


def _check_bytes(tensors: Tensors, specs: list[TensorSpec], st_path: Path) -> None:
    """Every tensor's head and tail, and the middle tensor whole, against the safetensors file (untimed)."""
    source = np.memmap(st_path, dtype=np.uint8, mode="r")
    if set(tensors) != {s.name for s in specs}:
        raise AssertionError("loaded tensor names differ from the checkpoint's")
    middle = specs[len(specs) // 2].name
    for s in specs:
        got = tensors[s.name].reshape(-1).view(torch.uint8).numpy()
        want = source[s.offset : s.offset + s.size]
        k = s.size if s.name == middle else min(s.size, 1 << 16)
        if got.size != s.size or not (np.array_equal(got[:k], want[:k]) and np.array_equal(got[-k:], want[-k:])):
            raise AssertionError(f"tensor {s.name} was loaded wrong")


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _status_bytes(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1)) * 1024


def _child(spec: RunSpec, conn: Any) -> None:
    try:
        conn.send(("ok", run_one(spec)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_in_child(ctx: Any, spec: RunSpec, timeout_s: float = 900) -> dict[str, Any]:
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec, send), daemon=True)
    proc.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            proc.kill()
            raise TimeoutError(f"{spec} did not finish in {timeout_s} s")
        status, payload = receive.recv()
    finally:
        proc.join()
    if status != "ok":
        raise RuntimeError(f"{spec} failed:\n{payload}")
    return payload


# ---- the machine's limits -------------------------------------------------------------


def machine_limits(paths: dict[str, Path], repeats: int = 3) -> dict[str, float]:
    """GB/s of what bounds every method: page-cache and cold reads, memcpy, zstd, crc32, the reader per core."""
    st = paths["safetensors"]
    specs = safetensors_specs(st)
    size = st.stat().st_size
    limits: dict[str, float] = {}
    read_through(st)
    limits["page-cache read, 1 thread, reused 4 MiB buffer"] = size / _best(lambda: read_through(st), repeats)
    if evict(st) == 0:
        limits["cold read (after DONTNEED), 1 thread"] = size / _best(lambda: read_through(st), 1)
    n = min(512 << 20, size)
    src = np.ones(n, dtype=np.uint8)
    limits[f"memcpy into fresh memory ({n >> 20} MiB)"] = n / _best(lambda: np.copyto(np.empty_like(src), src), repeats)
    dst = np.zeros_like(src)
    limits[f"memcpy into prefaulted memory ({n >> 20} MiB)"] = n / _best(lambda: np.copyto(dst, src), repeats)
    biggest = max(specs, key=lambda s: s.size if ".layers.0." in s.name else 0)
    sample = np.ascontiguousarray(np.memmap(st, dtype=np.uint8, mode="r")[biggest.offset : biggest.offset + biggest.size])
    packed = zstandard.ZstdCompressor(level=1).compress(sample)
    out = np.empty_like(sample)

    def decode() -> None:
        r = zstandard.ZstdDecompressor().stream_reader(packed)
        pos = 0
        while pos < len(out):
            pos += r.readinto(memoryview(out)[pos:])

    limits[f"zstd level-1 decode, 1 core ({biggest.name.split('.', 3)[-1]}, {sample.size >> 20} MiB)"] = (
        sample.size / _best(decode, repeats))
    limits["zlib.crc32, 1 core"] = sample.size / _best(lambda: zlib.crc32(sample), repeats)
    layer0 = [s for s in specs if ".layers.0." in s.name]
    into = {s.name: np.zeros(s.size, dtype=np.uint8) for s in layer0}
    for key in ("zqs-bytegroup", "zqs-zstd", "zqs-raw"):
        warm(paths[key])
        with ShardReader(paths[key]) as r:
            limits[f"{key} reader, 1 core (layer 0 into prefaulted, verified)"] = (
                sum(s.size for s in layer0) / _best(lambda r=r: r.read_layer(0, into=into), repeats))
    return {k: v / 1e9 for k, v in limits.items()}


def _best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ---- the run --------------------------------------------------------------------------


def schedule(shapes: list[str], repeats: dict[str, int], xz_repeats: int) -> list[RunSpec]:
    """Every (regime, method, destination) once per repeat, the method order rotated each repeat."""
    runs = []
    for shape in shapes:
        for r in range(repeats[shape]):
            for regime in REGIMES:
                cells = [(m, d) for m in METHODS if regime in m.regimes for d in m.dests
                         if d != "prefaulted" or regime == "warm"]
                cells = cells[r % len(cells):] + cells[: r % len(cells)]
                runs += [RunSpec(shape, regime, m.name, d, r, str(CACHE)) for m, d in cells
                         if m.name != "tar.xz" or r < xz_repeats]
    return runs


def main(argv: list[str] | None = None) -> int:
    from benchmarks.loader_report import write_report  # here: the measuring children need none of it

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shape, 1 repeat (development)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per cell for the small shape (median reported)")
    p.add_argument("--large-repeats", type=int, default=3, help="repeats per cell for the 1.1B shape")
    p.add_argument("--xz-repeats", type=int, default=1, help="tar.xz repeats (~90 s each for the 1.1B shape)")
    p.add_argument("--out", type=Path, default=None, help=f"report path (default {RESULTS}; --quick: under {CACHE})")
    p.add_argument("--report-only", type=Path, metavar="RUN_JSON", help="rewrite the report from a saved run")
    p.add_argument("--resume", type=Path, metavar="RUN_JSON", help="finish an interrupted run's schedule")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = args.out or (CACHE / "loader-quick.md" if args.quick else RESULTS)
    if args.report_only:
        write_report(out, json.loads(args.report_only.read_text()), CACHE)
        log.info("wrote %s from %s", out, args.report_only)
        return 0

    t_start = time.perf_counter()
    if args.resume:
        saved = args.resume
        run = json.loads(saved.read_text())
        run.setdefault("resumed", []).append(time.strftime("%Y-%m-%d %H:%M %Z"))
        elapsed_before, load_start = run["elapsed_s"], run["load"][0]
    else:
        shapes = ["small"] if args.quick else list(SHAPES)
        repeats = {"small": 1 if args.quick else args.repeats, "tinyllama-1.1b": args.large_repeats}
        repeats = {s: repeats[s] for s in shapes}
        elapsed_before, load_start = 0.0, load_average()
        run = {
            "command": "python -m benchmarks.bench_loader " + shlex.join(sys.argv[1:] if argv is None else argv),
            "started": time.strftime("%Y-%m-%d %H:%M %Z"), "shapes": shapes, "repeats": repeats,
            "xz_repeats": 1 if args.quick else args.xz_repeats,
            "built": {s: build_artefacts(s, CACHE) for s in shapes},
            "limits": machine_limits(artefact_paths(shapes[-1], CACHE)), "results": [],
        }
        log.info("machine limits: %s", json.dumps({k: round(v, 2) for k, v in run["limits"].items()}))
        saved = CACHE / f"run-{time.strftime('%Y%m%d-%H%M%S')}.json"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "safetensors.torch", "zstandard", "numpy", "weights_tool.layer_stream"])
    runs = schedule(run["shapes"], run["repeats"], run["xz_repeats"])
    done = {(r["shape"], r["regime"], r["method"], r["dest"], r["repeat"]) for r in run["results"]}
    for k, spec in enumerate(runs):
        if (spec.shape, spec.regime, spec.method, spec.dest, spec.repeat) in done:
            continue
        run["results"].append(run_in_child(ctx, spec))
        run.update(elapsed_s=elapsed_before + time.perf_counter() - t_start, load=[load_start, load_average()])
        saved.write_text(json.dumps(run, indent=1))  # after every run, so an interrupted run can be resumed
        log.info("[%d/%d] %s %-18s %-14s %-10s r%d  %.3f s", k + 1, len(runs), spec.shape, spec.regime,
                 spec.method, spec.dest, spec.repeat, run["results"][-1]["seconds"])
    print(write_report(out, run, CACHE))
    log.info("wrote %s; raw results in %s (--report-only rewrites the report from them)", out, saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
