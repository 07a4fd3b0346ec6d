"""Run an actor's worker process at a lower CPU priority before its class is imported.

The actor module pulls in torch (about 1 s of CPU); calling `os.nice` in `__init__` comes
after that import, so it would compete at full priority. Ray 2.60 runs a worker's setup
hook after connecting and before the actor class is deserialized, so the hook is the
earliest place the worker runs our code. A per-actor `worker_process_setup_hook` field is
silently ignored (only `ray.init` turns it into the env var that `default_worker` reads),
so `runtime_env_for` sets that env var itself.

Nice is per thread on Linux: a new thread inherits its creator's value, but `os.nice` and
`setpriority(PRIO_PROCESS, 0)` change only the calling thread. Ray's core worker has
started its gRPC/IO threads (nice 0) before the hook runs, so every thread is set by TID.
The main thread itself is set by Ray (`RAY_worker_niceness`, 15 by default) during connect.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

NICE_ENV = "ZQ_ACTOR_NICE"
# What `ray.init(runtime_env={"worker_process_setup_hook": ...})` sets; default_worker runs it.
_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def lower_priority() -> None:
    """The setup hook: every current thread's nice to at least $ZQ_ACTOR_NICE (default 10); never raises."""
    try:
        target = int(os.environ.get(NICE_ENV, "10"))
    except ValueError:
        log.warning("%s=%r is not an integer; priority left as it is", NICE_ENV, os.environ.get(NICE_ENV))
        return
    lower_threads(target)


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


def runtime_env_for(nice: int) -> dict:
    """The actor option `runtime_env` that starts its worker at `nice` ({} for 0: Ray's default)."""
    if nice <= 0:
        return {}
    return {"env_vars": {
        # Ray's core worker applies this to the main thread while connecting, before the hook.
        "RAY_worker_niceness": str(nice),
        _HOOK_ENV: f"{__name__}.lower_priority",
        NICE_ENV: str(nice),
    }}
