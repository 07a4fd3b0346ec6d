"""The stepping thread's thread count: one thread per core the node's other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from actors.thread_governor import NodeCpu, ThreadGovernor, threads_for


@pytest.mark.parametrize(("cores", "others", "current", "expected"), [
    (2, 0.0, 2, 2),  # nothing else runs: both threads
    (2, 0.45, 2, 2),  # the other half of a core still counts as free
    (2, 0.6, 2, 1),  # a core more than half used by others: one thread
    (2, 1.9, 2, 1),  # never below the minimum
    (2, 0.4, 1, 1),  # back up only with a margin: no flapping at the threshold
    (2, 0.3, 1, 2),
    (16, 3.2, 4, 4),  # a big node with cores to spare: the configured count
    (16, 13.4, 4, 3),  # 2.6 free cores: three threads
    (16, 13.4, 2, 2),  # ...but up from two only past the margin
])
def test_threads_for(cores, others, current, expected):
    assert threads_for(cores, others, current, min_threads=1, max_threads=min(4, cores)) == expected


def test_threads_for_keeps_within_its_bounds():
    assert threads_for(2, 2.0, 2, min_threads=2, max_threads=2) == 2
    assert threads_for(64, 0.0, 1, min_threads=1, max_threads=4) == 4


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stat(path, user: int, nice: int, system: int, idle: int) -> None:
    path.write_text(f"cpu  {user} {nice} {system} {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def test_node_cpu_counts_what_the_others_used(tmp_path):
    """The node's busy time (user + nice + system) over the interval, less this process's own."""
    stat, clock, own = tmp_path / "stat", _Clock(), [5.0]
    ticks = os.sysconf("SC_CLK_TCK")
    _stat(stat, 0, 0, 0, 0)
    node = NodeCpu(str(stat), clock=clock, own_cpu_s=lambda: own[0])
    # 2 s later: the node was busy 3 CPU-seconds, 1.2 of them this process's.
    clock.now += 2.0
    own[0] += 1.2
    _stat(stat, 1 * ticks, 1 * ticks, 1 * ticks, 1 * ticks)
    assert node.others_cores() == pytest.approx(0.9)
    clock.now += 1.0  # idle since: nothing used
    assert node.others_cores() == pytest.approx(0.0)


class _Node:
    """What other processes use, as the test says; the node has 2 cores."""

    num_cores = 2

    def __init__(self, others: list[float]) -> None:
        self.others = others

    def others_cores(self) -> float:
        return self.others.pop(0)


def test_the_governor_sets_the_count_it_decides_and_samples_once_an_interval():
    set_to: list[int] = []
    governor = ThreadGovernor(1, 2, interval_s=0.05, node_cpu=_Node([1.0, 1.0, 0.1]), set_threads=set_to.append)
    governor.start()
    assert set_to == [2] and governor.threads == 2
    assert governor.adjust() == 2  # within the first interval: no sample
    time.sleep(0.06)
    assert governor.adjust() == 1 and set_to == [2, 1]
    time.sleep(0.06)
    assert governor.adjust() == 1 and set_to == [2, 1]  # still busy: no call
    time.sleep(0.06)
    assert governor.adjust() == 2 and set_to == [2, 1, 2] and governor.num_changes == 2


def test_a_fixed_count_never_samples_the_node():
    set_to: list[int] = []
    governor = ThreadGovernor(2, 2, interval_s=0.001, node_cpu=_Node([]), set_threads=set_to.append)
    governor.start()
    time.sleep(0.01)
    assert governor.adjust() == 2 and set_to == [2] and not governor.is_active


def test_the_governor_drops_to_one_thread_while_busy_processes_take_every_core():
    """Real processes, the real /proc/stat: one busy process per core leaves no core free for a second thread."""
    node = NodeCpu()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(node.num_cores)]
    try:
        governor = ThreadGovernor(1, 2, interval_s=0.3, node_cpu=node, set_threads=lambda n: None)
        governor.start()
        deadline = time.monotonic() + 20
        while governor.threads != 1 and time.monotonic() < deadline:
            time.sleep(0.35)
            governor.adjust()
        assert governor.threads == 1
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
