"""What the test suite's CPU goes to: an idle Ray cluster with Serve, the imports every new process pays,
and (from a sequential run with benchmarks/suite_cpu_plugin.py) the CPU each test module took.

    .venv/bin/python -m benchmarks.bench_suite_cpu [--tests F]

Each idle figure is a fresh `ray.init` + `serve.start` in a child process, measured over 20 s once started,
with Serve's controller loop at Ray's default (0.1 s) and at 0.5 s, alternately, twice each. Writes
benchmarks/results/suite_cpu.md. Run on a quiet machine: the idle figures are the whole machine's.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import cores, load_text, python_version, version_of
from benchmarks.suite_cpu_plugin import TICKS_PER_S, busy_ticks

IDLE_S = 20.0
IDLE_CLUSTER = """
import time, ray
from ray import serve
ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
serve.start(http_options={"host": "127.0.0.1", "port": 8799})
time.sleep(8)  # started: the controller, the proxy and the agents have settled
print("ready", flush=True)
time.sleep(%r)
ray.shutdown()
"""


def idle_share(loop_s: float) -> float:
    """The machine's busy share (of all its cores) over IDLE_S with a started, idle cluster and Serve."""
    env = {**os.environ, "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": str(loop_s), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-c", IDLE_CLUSTER % (IDLE_S + 5)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline().strip() == "ready"
    ticks, t0 = busy_ticks(), time.monotonic()
    time.sleep(IDLE_S)
    share = (busy_ticks() - ticks) / TICKS_PER_S / (time.monotonic() - t0) / (cores() or 1)
    proc.wait(120)
    return share


def import_cpu_s(module: str) -> float:
    """CPU seconds (user + system) of a fresh interpreter that imports `module`, interpreter start included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def by_module(tsv: Path) -> list[tuple[str, float, float]]:
    cpu, wall = collections.Counter(), collections.Counter()
    for line in tsv.read_text().splitlines():
        nodeid, c, w = line.split("\t")
        cpu[nodeid.split("::")[0]] += float(c)
        wall[nodeid.split("::")[0]] += float(w)
    return [(m, c, wall[m]) for m, c in cpu.most_common()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, default=None, help="a --suite-cpu-out file to sum by module")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/suite_cpu.md"))
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.bench_suite_cpu",
                          *(sys.argv[1:] if argv is None else argv)])
    load = load_text()
    idle: dict[float, list[float]] = {0.1: [], 0.5: []}
    for _ in range(2):
        for loop_s, shares in idle.items():
            shares.append(idle_share(loop_s))
    imports = {m: import_cpu_s(m) for m in ("ray", "torch", "actors.engine", "actors.request_actor", "serve_app.app")}
    lines = [
        "# What the test suite's CPU goes to", "", f"Command: `{command}`", "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cores()} cores, load {load} at the start; "
        f"Python {python_version()}, ray {version_of('ray')}, torch {version_of('torch')}.", "",
        f"## An idle cluster with Serve started (whole machine, {IDLE_S:.0f} s)", "",
        "| Serve controller loop | busy share of all cores, each run |", "|---|--:|",
        *[f"| {s} s | {' / '.join(f'{x:.1%}' for x in shares)} |" for s, shares in idle.items()], "",
        "## What a new process pays to import (CPU s, interpreter start included)", "",
        "| module | CPU s |", "|---|--:|", *[f"| `{m}` | {s:.2f} |" for m, s in imports.items()], "",
    ]
    if args.tests is not None:
        rows = by_module(args.tests)
        lines += [f"## CPU by test module (`{args.tests.name}`, a sequential run)", "",
                  f"Total: {sum(c for _, c, _ in rows):.0f} CPU s over {sum(w for _, _, w in rows):.0f} s of tests.",
                  "", "| module | CPU s | wall s |", "|---|--:|--:|",
                  *[f"| `{m}` | {c:.1f} | {w:.1f} |" for m, c, w in rows[:20]], ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
