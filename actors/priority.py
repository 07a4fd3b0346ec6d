"""Run request actors' worker processes at a lowered CPU priority from their first instruction.

On CPU slots a starting actor competes with the proxy, the ingress and the registry for the
same cores: its interpreter start, `import ray` and `import torch` take over a second of
CPU before `__init__` runs, and a nice set there (or in a worker setup hook, which runs
after Ray has connected) leaves all of that at full priority. So the worker's interpreter
itself is started under `nice` (runtime_env `py_executable`): every instruction of the
process, and every thread it starts, runs at that priority. Ray's core worker would then
"adjust" its main thread to `RAY_worker_niceness` (15 by default) while connecting, raising
it where it may (as root), so that is set to the same value.

Two costs: a runtime_env gives the actor a worker process of its own, never a pooled one
(a start costs a fresh interpreter), and Ray's runtime-env setup step for it still runs at
normal priority.

The control plane is the other side of the same setting. Ray runs every worker's Python
threads at `RAY_worker_niceness`, 15 by default: the registry, the ingress replica and
the proxy would compute at nice 15, with 2.4 times the CPU share of a request actor at 19
but 1/28 of any process at nice 0 (a load generator on the same machine, a build), by the
kernel's weights for those nice values (36, 15 and 1024). `control_plane_runtime_env()`
keeps an actor's Python at nice 0; the registry and the ingress are started with it. Serve's
proxy and controller, which Serve starts, stay at Ray's 15.

`lower_threads` lowers every thread of the calling process in place (nice is per thread on
Linux: a new thread inherits its creator's value): the actor calls it in `__init__`, a
no-op when its worker started niced, the fallback when it did not (a driver's own actor).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)


def control_plane_runtime_env() -> dict:
    """The runtime_env of the control plane's actors: their Python threads at nice 0, not Ray's 15."""
    return {"env_vars": {"RAY_worker_niceness": "0"}}


def runtime_env_for(nice: int, python: str | None = None) -> dict:
    """The actor option `runtime_env` that starts its worker process at `nice` ({} for 0: Ray's default)."""
    if nice <= 0:
        return {}
    return {"py_executable": f"nice -n {int(nice)} {python or sys.executable}",
            "env_vars": {"RAY_worker_niceness": str(int(nice))}}


def lower_threads(target: int) -> None:
    """Every current thread's nice to at least `target` (threads started later inherit it); never raises."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs (not Linux): there PRIO_PROCESS 0 is the whole process
        tids = [0]
    for tid in tids:
        try:
            # Only ever lower a thread's priority: going back up needs CAP_SYS_NICE.
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as e:
            log.warning("could not set thread %d to nice %d: %s", tid, target, e)
