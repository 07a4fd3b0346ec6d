"""How many threads a batch's steps compute on: fewer while other processes use the node's cores.

A step splits each op over the stepping thread's OpenMP team, and every op ends at a barrier:
it is as slow as its slowest thread. A thread that shares its core with another busy process
gets a time slice in turn, and every barrier of the step waits for it. On the 2-core host
(benchmarks/results/threads.md: SmolLM2 in fp32, the actors' AVX2 kernels, at nice 19), alone
two threads prefill 128 tokens in 213 ms against one thread's 352; beside a process busy a
quarter of a core, 271 against 356; half a core, 334 against 341 (break-even); a whole core,
653-761 against 357-360, and a one-row step's P90 97-134 ms against 14-15.

So a team is worth its threads only while each of them has a core to itself: the load
generator starting beside the server, another slot's actor, or the node's own control plane at
load take a core now and then, and a step on two threads then takes up to twice as long as on
one, its slowest steps several times.

`threads_for` (pure) keeps one thread per core that the others leave free, a core counting as
free while they use less than half of it (the table's break-even), with a margin before it adds
a thread back so that the count does not flap. `NodeCpu` measures the others' use: the node's
busy CPU time (/proc/stat) less this process's own, over the last `interval_s`.
`ThreadGovernor` samples it between steps (and every `interval_s` while idle) and sets torch's
thread count on the stepping thread (actors/threads.py).
"""

from __future__ import annotations

import logging
import math
import os
import time

log = logging.getLogger(__name__)

# A core is free while the others use less than this share of it (the table above: break-even near 0.5).
FREE_BELOW = 0.5
# A thread comes back only once the others leave its core this much freer again.
RETURN_MARGIN = 0.15


def threads_for(num_node_cores: float, others_cores: float, current: int, min_threads: int, max_threads: int) -> int:
    """Threads to compute on, given the cores of the node that other processes used (on average) lately."""
    free = num_node_cores - max(0.0, others_cores)
    fits = math.floor(free + FREE_BELOW)  # cores the others leave at least half free
    # Down at once; up only as far as the margin allows.
    wanted = fits if fits < current else max(current, math.floor(free + FREE_BELOW - RETURN_MARGIN))
    return max(min_threads, min(max_threads, wanted))


class NodeCpu:
    """The cores other processes of this node used since the last `others_cores()` (the first call: since made)."""

    def __init__(self, stat_path: str = "/proc/stat", clock=time.monotonic, own_cpu_s=time.process_time) -> None:
        self._stat_path, self._clock, self._own_cpu_s = stat_path, clock, own_cpu_s
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self.num_cores = os.cpu_count() or 1  # /proc/stat's cores: the node's, not an affinity mask's
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        """(wall, node busy CPU s, this process's CPU s)."""
        with open(self._stat_path) as f:
            fields = f.readline().split()  # "cpu user nice system idle iowait irq softirq steal guest guest_nice"
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
        busy = (user + nice + system + irq + softirq) / self._ticks_per_s
        return self._clock(), busy, self._own_cpu_s()

    def others_cores(self) -> float:
        now = self._sample()
        wall = now[0] - self._last[0]
        others = ((now[1] - self._last[1]) - (now[2] - self._last[2])) / wall if wall > 0 else 0.0
        self._last = now
        return max(0.0, others)


class ThreadGovernor:
    """Sets the stepping thread's torch threads between `min_threads` and `max_threads` (`threads_for`).
    Call `start()` on the stepping thread before its first step, then `adjust()` between steps."""

    def __init__(self, min_threads: int, max_threads: int, interval_s: float = 0.5,
                 node_cpu: NodeCpu | None = None, set_threads=None) -> None:
        if not 1 <= min_threads <= max_threads or interval_s <= 0:
            raise ValueError(f"ThreadGovernor needs 1 <= min_threads <= max_threads and interval_s > 0, got "
                             f"{min_threads}, {max_threads}, {interval_s}")
        self.min_threads, self.max_threads, self.interval_s = min_threads, max_threads, interval_s
        self.is_active = min_threads < max_threads
        self._node_cpu = node_cpu if node_cpu is not None or not self.is_active else NodeCpu()
        if set_threads is None:
            from actors.threads import use_threads_here as set_threads
        self._set_threads = set_threads
        self.threads = max_threads
        self.num_changes = 0
        self._next_sample = 0.0

    def start(self) -> None:
        self._set_threads(self.threads)
        self._next_sample = time.monotonic() + self.interval_s

    def adjust(self) -> int:
        """Sample the node once `interval_s` has passed since the last sample; returns the threads to compute on."""
        if not self.is_active or time.monotonic() < self._next_sample:
            return self.threads
        self._next_sample = time.monotonic() + self.interval_s
        others = self._node_cpu.others_cores()
        wanted = threads_for(self._node_cpu.num_cores, others, self.threads, self.min_threads, self.max_threads)
        if wanted != self.threads:
            log.info("computing on %d thread(s), was %d: other processes used %.2f of the node's %d cores",
                     wanted, self.threads, others, self._node_cpu.num_cores)
            self._set_threads(wanted)
            self.threads = wanted
            self.num_changes += 1
        return self.threads
