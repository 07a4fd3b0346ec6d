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

Where the break-even lies depends on the CPU and on what the others are: on a 2-core AVX512-BF16
host under GuideLLM (benchmarks/results/peer_threads.md), the load generator and the control
plane used 0.6-0.8 of a core in bursts, the node-CPU rule below kept the actor on one thread, and
two threads always on served 9-50% more requests at 4-8 req/s once the load generator's own start
was behind it (at the start, a whole core busy, they were far worse). So the default rule measures
instead of guessing ("measured", `StepProbe`): every step's time is set against the rule's
prediction for it (actors/step_cost.py), the steps of each count are compared on the same work,
and the count whose steps run faster is kept. The older rule ("node_cpu", `threads_for`) stays
selectable (`actor.thread_rule`), for the comparison.

`StepProbe` (pure): after a run of steps on its count ("home"), it computes `probe_steps` steps on
a neighbouring count and compares the medians of measured ÷ rule over the probe and over the home
count's last `probe_steps` steps: consecutive steps of much the same batch. The probe's count
becomes home where its steps ran faster by `margin`. A probe that loses doubles the home steps
before the next one (from `min_home_steps` up to `max_home_steps`), so that a count twice as slow
costs about 2% of the steps in probes; the home steps running `drift` slower or faster than at the
last decision (a neighbour started or stopped) probe at once.

`threads_for` (pure) keeps one thread per core that the others leave free, a core counting as
free while they use less than half of it (the table's break-even), with a margin before it adds
a thread back so that the count does not flap. `NodeCpu` measures the others' use: the node's
busy CPU time (/proc/stat) less this process's own, over the last `interval_s`.

`ThreadGovernor` applies either rule between steps (the node-CPU rule also every `interval_s`
while idle) and sets torch's thread count on the stepping thread (actors/threads.py).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import deque

log = logging.getLogger(__name__)

# A core is free while the others use less than this share of it (the table above: break-even near 0.5).
FREE_BELOW = 0.5
# A thread comes back only once the others leave its core this much freer again.
RETURN_MARGIN = 0.15
# How the count is chosen (actor.thread_rule): by the steps' measured speed, or by the others' CPU use.
THREAD_RULES = ("measured", "node_cpu")


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


class StepProbe:
    """The measured rule: which count of threads the next step computes on, from the steps so far (module docstring)."""

    def __init__(self, min_threads: int, max_threads: int, start: int, *, probe_steps: int = 4,
                 min_home_steps: int = 24, max_home_steps: int = 192, margin: float = 0.05,
                 drift: float = 0.3) -> None:
        if not (1 <= min_threads <= start <= max_threads and 1 <= probe_steps
                and 1 <= min_home_steps <= max_home_steps and 0 <= margin < 1 and drift > 0):
            raise ValueError(f"StepProbe needs 1 <= min_threads <= start <= max_threads, probe_steps >= 1, "
                             f"1 <= min_home_steps <= max_home_steps, 0 <= margin < 1 and drift > 0, got "
                             f"{min_threads}, {start}, {max_threads}, {probe_steps}, {min_home_steps}, "
                             f"{max_home_steps}, {margin}, {drift}")
        self.min_threads, self.max_threads = min_threads, max_threads
        self.probe_steps, self.min_home_steps, self.max_home_steps = probe_steps, min_home_steps, max_home_steps
        self.margin, self.drift = margin, drift
        self.home = self.threads = start  # the chosen count, and the one the next step computes on
        self.num_probes = self.num_switches = 0
        self._home_ratios: deque[float] = deque(maxlen=probe_steps)  # measured ÷ rule, the home count's last steps
        self._probe_ratios: list[float] = []
        self._level: float | None = None  # the home steps' median at the last decision
        self._home_steps = 0  # since the last decision
        self._wait_steps = min_home_steps
        self._side = 1  # the neighbour probed next: one thread more, then one fewer

    def observe(self, threads: int, ratio: float) -> int:
        """A step computed on `threads` took `ratio` times the rule's prediction; returns the next step's count."""
        if not ratio > 0:
            return self.threads
        if self.threads != self.home:  # a probe
            if threads == self.threads:
                self._probe_ratios.append(ratio)
            if len(self._probe_ratios) >= self.probe_steps:
                self._decide()
            return self.threads
        if threads != self.home:
            return self.threads
        self._home_ratios.append(ratio)
        self._home_steps += 1
        if len(self._home_ratios) < self.probe_steps:
            return self.threads
        level = statistics.median(self._home_ratios)
        if self._level is None:
            self._level = level
        is_drifted = abs(level / self._level - 1) > self.drift  # the node changed under the home count: ask now
        if is_drifted:
            self._wait_steps = self.min_home_steps
        if (is_drifted or self._home_steps >= self._wait_steps) and (other := self._neighbour()) is not None:
            self.threads, self._probe_ratios = other, []
            self.num_probes += 1
        return self.threads

    def _neighbour(self) -> int | None:
        for side in (self._side, -self._side):
            if self.min_threads <= self.home + side <= self.max_threads:
                self._side = -side
                return self.home + side
        return None

    def _decide(self) -> None:
        home, probe = statistics.median(self._home_ratios), statistics.median(self._probe_ratios)
        if probe < home * (1 - self.margin):
            log.info("computing on %d thread(s), was %d: its steps took %.2fx the rule's time, against %.2fx",
                     self.threads, self.home, probe, home)
            self.home, self._level, self._wait_steps = self.threads, probe, self.min_home_steps
            self._home_ratios = deque(self._probe_ratios[-self.probe_steps:], maxlen=self.probe_steps)
            self.num_switches += 1
        else:
            self._level, self._wait_steps = home, min(self.max_home_steps, 2 * self._wait_steps)
        self.threads, self._home_steps = self.home, 0


class ThreadGovernor:
    """Sets the stepping thread's torch threads between `min_threads` and `max_threads`, by `rule` (THREAD_RULES).
    Call `start()` on the stepping thread before its first step, then `adjust()` between steps, with the last
    step's measured ÷ rule-predicted time (None: no step since, or one the rule does not predict)."""

    def __init__(self, min_threads: int, max_threads: int, interval_s: float = 0.5,
                 node_cpu: NodeCpu | None = None, set_threads=None, rule: str = "measured",
                 probe: StepProbe | None = None) -> None:
        if not 1 <= min_threads <= max_threads or interval_s <= 0:
            raise ValueError(f"ThreadGovernor needs 1 <= min_threads <= max_threads and interval_s > 0, got "
                             f"{min_threads}, {max_threads}, {interval_s}")
        if rule not in THREAD_RULES:
            raise ValueError(f"ThreadGovernor's rule must be {' or '.join(THREAD_RULES)}, got {rule!r}")
        self.min_threads, self.max_threads, self.interval_s, self.rule = min_threads, max_threads, interval_s, rule
        self.is_active = min_threads < max_threads
        # The node-CPU rule samples the node, also while idle (BatchRunner waits `interval_s` at most then).
        self.samples_node = self.is_active and rule == "node_cpu"
        self._node_cpu = node_cpu if node_cpu is not None or not self.samples_node else NodeCpu()
        self._probe = probe if probe is not None or rule != "measured" else StepProbe(min_threads, max_threads,
                                                                                      max_threads)
        if set_threads is None:
            from actors.threads import use_threads_here as set_threads
        self._set_threads = set_threads
        self.threads = max_threads
        self.num_changes = 0
        self._next_sample = 0.0

    def start(self) -> None:
        self._set_threads(self.threads)
        self._next_sample = time.monotonic() + self.interval_s

    def adjust(self, step_ratio: float | None = None) -> int:
        """The threads the next step computes on: by the measured rule from `step_ratio`, by the node-CPU rule from
        a sample of the node once `interval_s` has passed since the last one."""
        if not self.is_active:
            return self.threads
        if self._probe is not None:
            return self._use(self._probe.observe(self.threads, step_ratio) if step_ratio is not None else
                             self.threads)
        if time.monotonic() < self._next_sample:
            return self.threads
        self._next_sample = time.monotonic() + self.interval_s
        others = self._node_cpu.others_cores()
        wanted = threads_for(self._node_cpu.num_cores, others, self.threads, self.min_threads, self.max_threads)
        if wanted != self.threads:
            log.info("computing on %d thread(s), was %d: other processes used %.2f of the node's %d cores",
                     wanted, self.threads, others, self._node_cpu.num_cores)
        return self._use(wanted)

    def _use(self, wanted: int) -> int:
        if wanted != self.threads:
            self._set_threads(wanted)
            self.threads = wanted
            self.num_changes += 1
        return self.threads
