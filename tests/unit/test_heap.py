"""Freed activation memory stays in the process for the next layer, and goes back when asked."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.heap import glibc

MIB = 1 << 20

# Allocate, touch and free 64 MiB blocks through malloc, as a prefill's activations do
# per layer; report page faults, resident memory and huge pages after each stage.
_PROBE = textwrap.dedent("""
    import ctypes, json, resource, sys
    from actors.heap import glibc, release_freed_memory, retain_freed_memory

    libc = glibc()

    def faults_per_cycle(num_cycles=4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(num_cycles):
            p = libc.malloc(64 << 20)
            ctypes.memset(p, 1, 64 << 20)
            libc.free(p)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / num_cycles

    def kib(field, path="/proc/self/status"):
        return next(int(l.split()[1]) for l in open(path) if l.startswith(field))

    out = {"applied": retain_freed_memory(256 << 20) if sys.argv[1] == "retain" else False}
    faults_per_cycle()  # the first touch always faults
    out["steady"] = faults_per_cycle()
    out["huge_kib"] = kib("AnonHugePages:", "/proc/self/smaps_rollup")
    rss = kib("VmRSS:")
    release_freed_memory(128 << 20)
    out["kept_drop_kib"] = rss - kib("VmRSS:")
    out["after_keep"] = faults_per_cycle(1)
    rss = kib("VmRSS:")
    release_freed_memory(0)
    out["released_drop_kib"] = rss - kib("VmRSS:")
    print(json.dumps(out))
""")


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def _thp_allowed() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.is_file() and ("[madvise]" in path.read_text() or "[always]" in path.read_text())


@pytest.mark.skipif(glibc() is None, reason="needs glibc's mallopt")
def test_freed_blocks_are_reused_on_huge_pages_and_released_down_to_what_is_kept():
    default, retained = _probe("default"), _probe("retain")
    pages = 64 * MIB // 4096
    assert default["steady"] > pages / 2  # glibc unmaps 64 MiB on free: every cycle faults again
    assert retained["applied"] is True
    assert retained["steady"] < pages / 20  # the same pages, reused
    # Trimming down to 128 MiB keeps the 64 MiB block's pages: nothing to fault again.
    assert retained["kept_drop_kib"] < 16 * 1024 and retained["after_keep"] < pages / 20
    assert retained["released_drop_kib"] > 48 * 1024  # malloc_trim(0) gave them back
    if _thp_allowed():
        assert retained["huge_kib"] >= 32 * 1024


def test_idle_trimmer_trims_once_only_after_a_quiet_delay():
    import threading
    import time

    from actors.heap import IdleTrimmer

    trimmed = threading.Event()
    calls = []

    def trim():
        calls.append(time.monotonic())
        trimmed.set()

    trimmer = IdleTrimmer(0.2, trim)
    trimmer.request_ended()
    time.sleep(0.1)
    trimmer.request_started()  # a request within the delay: its pages are reused, nothing trimmed
    time.sleep(0.3)
    assert calls == []
    ended = time.monotonic()
    trimmer.request_ended()
    trimmer.request_ended()  # a second end restarts the delay instead of adding a trim
    assert trimmed.wait(5.0)
    time.sleep(0.3)
    assert len(calls) == 1 and calls[0] - ended >= 0.2
    with pytest.raises(ValueError, match="delay_s"):
        IdleTrimmer(-1.0, trim)
