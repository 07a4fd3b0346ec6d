"""Which threads compute in parallel: a batch's stepping thread, and no other.

torch's intra-op threads (and the actors' kernels, through `at::parallel_for`) are OpenMP: every
thread that opens a parallel region keeps a team of workers of its own. Once two threads have formed
teams, libgomp counts more workers than cores and throttles their waiting: they sleep between regions,
and each of a decode step's ~150 regions pays a wake-up. Timed by hand on 2 cores (SmolLM2, one row),
a decode step on a thread of its own took 27 ms on two threads once another thread had formed a
team, 19 ms on one thread, and 12 ms on two threads when no other thread had formed one.

So an actor loads on one thread (`compute_on_one_thread`, before it starts loading), its stepping
thread switches to `compute_threads` before its first step (`use_threads_here`; fewer while other processes
use the node's cores: actors/thread_governor.py) and forms the
process's one team, what else computes once the actor runs (a warm actor's kernel choice, compiling)
runs on the stepping thread between steps (`RequestActor._on_stepping_thread`), and its packing thread copies weights with numpy, not torch
(bf16_linear.pack). torch's thread count is the process's: a thread that set one would set it for
the stepping thread too.
"""

from __future__ import annotations

import torch


def compute_on_one_thread() -> None:
    """torch computes on one thread: no thread forms a team until `use_threads_here`."""
    torch.set_num_threads(1)


def use_threads_here(num_threads: int) -> None:
    """torch computes on `num_threads` from here on; the calling thread's next parallel region forms a team."""
    torch.set_num_threads(num_threads)
