"""A request actor's start on a busy node: how much longer a fresh process takes to its first token while
other actors compute on the same cores, against the rule's share of the cores (`node_cpus`, serve_app/scorer.py).

Each measured start is a fresh process doing what a cold actor does before its first token — import torch and
the runtime, load the served model's `.zqs`, run a 32-token prompt and sample one token — at the actors'
nice (19) and thread count (1). Beside it run 0, 1 or 2 busy processes, each a hot actor's loop: the same
model stepping a batch of 4 rows back to back, at the same nice. The file is in the page cache after the first
start, so the figures are CPU contention, not disk.

    .venv/bin/python -m benchmarks.bench_busy_start    # ~3 min; writes benchmarks/results/busy_start.md and .json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = ".cache/models/smollm2-135m-instruct.zqs"
NICE = 19  # ActorConfig.cpu_nice


def _child_setup() -> None:
    os.nice(NICE - os.nice(0))
    import torch

    torch.set_num_threads(1)


def busy(model: str) -> None:
    """A hot actor's loop: 4 rows decoding back to back, until killed."""
    _child_setup()
    import torch

    from actors.layer_loader import load_zqs
    from actors.model import RowInput

    m, _ = load_zqs(model, compute_dtype="auto")
    rows = [m.new_row_cache(4096) for _ in range(4)]
    for caches in rows:
        m.forward_rows(torch.randint(0, 1000, (64,)), [RowInput(caches, 0, 64)])
    print("ready", flush=True)
    pos = 64
    while True:
        m.forward_rows(torch.full((4,), 5), [RowInput(c, pos, 1) for c in rows])
        pos = 64 + (pos - 63) % 4000


def start(model: str, spawned_at: float) -> None:
    """A cold actor's way to its first token; prints seconds since the parent spawned this process."""
    _child_setup()
    import torch

    from actors.layer_loader import load_zqs
    from actors.model import RowInput

    imported = time.time()
    m, _ = load_zqs(model, compute_dtype="auto")
    loaded = time.time()
    logits = m.forward_rows(torch.randint(0, 1000, (32,)), [RowInput(m.new_row_cache(64), 0, 32)])
    int(logits.argmax())
    first = time.time()
    print(json.dumps({"import_s": imported - spawned_at, "load_s": loaded - imported, "prefill_s": first - loaded,
                      "first_token_s": first - spawned_at}), flush=True)


def _run(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "benchmarks.bench_busy_start", *args], **kw)


def measure(model: str, num_busy: int, repeats: int) -> list[dict]:
    workers = [_run(["--role", "busy", "--model", model], stdout=subprocess.PIPE, text=True) for _ in range(num_busy)]
    try:
        for w in workers:
            assert w.stdout.readline().strip() == "ready", "a busy worker did not start"
        time.sleep(2.0)  # every worker in its loop
        out = []
        for _ in range(repeats):
            p = _run(["--role", "start", "--model", model, "--spawned-at", repr(time.time())],
                     stdout=subprocess.PIPE, text=True)
            stdout, _ = p.communicate(timeout=600)
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        for w in workers:
            w.kill()
            w.wait()


def report(runs: dict[int, list[dict]], command: str, took_s: float, load: tuple[float, float]) -> str:
    med = {k: {f: statistics.median(r[f] for r in rs) for f in rs[0]} for k, rs in runs.items()}
    base = med[0]["first_token_s"]
    cores = os.cpu_count() or 1
    lines = [
        "# A request actor's start on a busy node",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}. Load average {load[0]:.2f} at the start, {load[1]:.2f} at the end; "
        f"{took_s / 60:.1f} min. Nothing else of ours ran meanwhile.",
        "",
        "Each start: a fresh process at nice 19 and 1 thread (as an actor) imports torch and the runtime, loads "
        f"`{Path(MODEL).name}` (bf16 where the CPU has it), runs a 32-token prompt and samples a token. Beside it, "
        "N busy processes at the same nice each step 4 rows of the same model back to back (a hot actor). "
        f"Medians of {len(runs[0])} starts; seconds from the spawn.",
        "",
        "| busy processes | imports (s) | load (s) | prompt (s) | first token (s) | ÷ idle | the rule's share |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for k, m in med.items():
        lines.append(f"| {k} | {m['import_s']:.2f} | {m['load_s']:.2f} | {m['prefill_s']:.2f} | "
                     f"{m['first_token_s']:.2f} | {m['first_token_s'] / base:.2f} | {max(1.0, (k + 1) / cores):.2f} |")
    lines += ["", f"The rule's share: max(1, (busy + 1) / node_cpus) with node_cpus = {cores}, this machine's cores: "
              "a start beside fewer busy actors than cores has one to itself, and beside more it gets its share."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("main", "busy", "start"), default="main", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--busy", default="0,1,2", help="busy processes beside each start, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/busy_start.md")
    args = parser.parse_args(argv)
    if args.role == "busy":
        busy(args.model)
        return 0
    if args.role == "start":
        start(args.model, args.spawned_at)
        return 0
    t0, load0 = time.time(), os.getloadavg()[0]
    counts = [int(k) for k in args.busy.split(",")]
    if counts[0] != 0:
        parser.error("--busy must start with 0: the idle start is the reference")
    runs = {k: measure(args.model, k, args.repeats) for k in counts}
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_busy_start", *(argv or sys.argv[1:])])
    text = report(runs, command, time.time() - t0, (load0, os.getloadavg()[0]))
    out = Path(args.out)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "runs": runs}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
