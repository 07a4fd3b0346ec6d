"""A pytest plugin: the machine's CPU time around each test, for finding what the suite spends its CPU on.

    .venv/bin/python -m pytest -p benchmarks.suite_cpu_plugin --suite-cpu-out F

Run it without `-n`: the figure is the whole machine's busy time (every process, Ray's included) while the
test ran, so it is the test's own only when nothing else runs. Each line of F: test id, CPU seconds, wall
seconds. `benchmarks.bench_suite_cpu --tests F` sums them by module.
"""

from __future__ import annotations

import time

import pytest

TICKS_PER_S = 100  # USER_HZ, as /proc/stat counts


def busy_ticks() -> int:
    """Busy clock ticks of the whole machine since boot (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return sum(values) - values[3] - values[4]


def pytest_addoption(parser):
    parser.addoption("--suite-cpu-out", default=None, help="write each test's CPU and wall seconds here")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = item.config.getoption("--suite-cpu-out")
    ticks, t0 = busy_ticks(), time.monotonic()
    yield
    if out:
        with open(out, "a") as f:
            f.write(f"{item.nodeid}\t{(busy_ticks() - ticks) / TICKS_PER_S:.2f}\t{time.monotonic() - t0:.2f}\n")

